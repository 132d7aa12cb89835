"""Rollouts sampled on an inference server (training.serving.app's ``POST /generate``): the engine of
a run whose rollouts overlap training on the inference servers (``rollouts_on: inference_servers``).

The worker keeps no copy of the model for sampling: each checkpoint the rollouts use is named to
the server, by its store key and digest when it has been recorded (``RolloutServer.locate``; any
host's server fetches it into its verified cache) or else by its folder, for a server on the same
host. The trainer checks every checkpoint the server samples (training.adapter_check: the files
named are the ones saved, and the server's logprobs of the probe prompts are the trainer's).
Prompts go as token ids and completions come back as token ids with their logprobs: nothing is
re-tokenised, exactly as with an engine in the worker.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.engines.base import (
    Choice,
    Engine,
    OnFinished,
    OnToken,
    SamplingParams,
    report_after,
    report_finished_after,
)
from training.engines.token_wire import choices_of, sampling_body
from training.serving.protocol import ADAPTER_HEADER, ADAPTER_KEY_HEADER, ADAPTER_SHA256_HEADER


@dataclass
class RolloutServer:
    """An inference server of the run's base model, as the worker that drives the run found it."""

    url: str
    token: str = ""
    # A checkpoint folder of the run -> (store key, sha256) once it is recorded in the store; None:
    # named by its folder (a server on this host reads it there).
    locate: Callable[[Path], tuple[str, str] | None] | None = None
    timeout_s: float = 3600.0  # one call is a turn of a whole step's rollouts


class RemoteEngineError(RuntimeError):
    """The inference server refused or failed a request (its status and message)."""


class RemoteEngine(Engine):
    def __init__(
        self, server: RolloutServer, tokenizer: Any, *, stop_token_ids: set[int] | frozenset[int]
    ) -> None:
        self.server = server
        self.url = server.url.rstrip("/")
        self.tokenizer = tokenizer
        # The trainer's model's: the server must end completions at the same tokens (checked).
        self.stop_token_ids = frozenset(stop_token_ids)
        self._adapters: dict[str, tuple[Path, dict[str, str]]] = {}

    def load_adapter(self, name: str, path: Path) -> None:
        path = Path(path)
        located = self.server.locate(path) if self.server.locate is not None else None
        if located is not None:
            headers = {ADAPTER_KEY_HEADER: located[0], ADAPTER_SHA256_HEADER: located[1]}
        else:
            headers = {ADAPTER_HEADER: str(path)}
        self._adapters[name] = (path, headers)

    def unload_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)  # the server keeps what it loaded in its own LRU

    def adapter_path(self, name: str) -> Path:
        """The folder of the checkpoint loaded as ``name`` (what the server is told to sample)."""
        return self._adapters[name][0]

    def generate_from_tokens(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingParams,
        adapter: str | None = None,
        *,
        on_token: OnToken | None = None,
        grammars: Sequence[str | None] | None = None,
        on_finished: OnFinished | None = None,
    ) -> list[Choice]:
        if not prompt_token_ids:
            return []
        if grammars is not None and any(grammar is not None for grammar in grammars):
            raise NotImplementedError(
                "constrained decoding is not offered by rollouts on the inference servers"
            )
        if adapter is not None and adapter not in self._adapters:
            raise ValueError(f"no adapter {adapter!r} was loaded")
        headers = dict(self._adapters[adapter][1]) if adapter is not None else {}
        answer = self._post({"prompts": prompt_token_ids, "sampling": sampling_body(sampling)}, headers)
        if set(answer.get("stop_token_ids") or []) != set(self.stop_token_ids):
            raise RemoteEngineError(
                f"the inference server at {self.url} ends completions at tokens {sorted(answer.get('stop_token_ids') or [])}, "
                f"the trainer's model at {sorted(self.stop_token_ids)}: it does not serve the run's base model"
            )
        choices = choices_of(prompt_token_ids, answer["choices"])
        return report_finished_after(report_after(choices, on_token), on_finished)

    def _post(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/generate", data=json.dumps(body).encode(), method="POST"
        )
        request.add_header("content-type", "application/json")
        if self.server.token:
            request.add_header("authorization", f"Bearer {self.server.token}")
        for name, value in headers.items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=self.server.timeout_s) as response:  # noqa: S310 (the registry's URL)
                return json.loads(response.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = str(exc.reason)
            raise RemoteEngineError(
                f"the inference server at {self.url} answered {exc.code}: {message}"
            ) from None
        except OSError as exc:
            raise RemoteEngineError(f"the inference server at {self.url} cannot be reached: {exc}") from None
