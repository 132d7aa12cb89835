"""Rollouts sampled on an inference server: the engine of a run whose rollouts overlap training on the
inference servers (``rollouts_on: inference_servers``). Two dialects, by the server's engine:

- ``transformers`` (training.serving.app): ``POST /generate``, the adapter named in a header;
- ``vllm`` (vLLM's own OpenAI server, training.serving.vllm): ``POST /v1/completions`` with the
  prompt as token ids and ``return_tokens_as_token_ids`` (every sampled token comes back as
  ``token_id:<id>`` with its logprob), one request per prompt when seeded (vLLM seeds each request
  on its own: one seed for a group's copies of a prompt would sample them alike), sent together so
  vLLM batches them; each checkpoint loaded through vLLM's runtime LoRA API under a name of the
  run's own (``adapter_prefix``) from the folder its host's checkpoint fetcher answers
  (training.serving.fetch_server, by store key and digest), and unloaded when the run moves on.
  vLLM reports logprobs under the trainer's convention only with ``--logprobs-mode
  processed_logprobs`` (which ``vllm_serve_command`` passes) and without top-p/top-k/min-p
  truncation (refused here, as by the in-process vLLM engine).
  NOT RUN against a real vLLM here (CPU machines): tested against a double that speaks vLLM's
  documented completions and LoRA endpoints over the transformers engine
  (tests/training/vllm_double.py).

The worker keeps no copy of the model for sampling: each checkpoint the rollouts use is named to
the server, by its store key and digest when it has been recorded (``RolloutServer.locate``; any
host's server fetches it into its verified cache) or else by its folder, for a server on the same
host. The trainer checks every checkpoint the server samples (training.session.adapter_check: the files
named are the ones saved, and the server's logprobs of the probe prompts are the trainer's).
Prompts go as token ids and completions come back as token ids with their logprobs: nothing is
re-tokenised, exactly as with an engine in the worker.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from training.serving.protocol import ADAPTER_HEADER, ADAPTER_KEY_HEADER, ADAPTER_SHA256_HEADER, FETCH_PATH
from training.wire.openai_errors import error_message

log = logging.getLogger(__name__)

VLLM_NAME = "vllm_name"  # an adapter's entry: the name vLLM knows it by
TOKEN_ID_PREFIX = "token_id:"  # how vLLM spells a token with return_tokens_as_token_ids


@dataclass
class RolloutServer:
    """An inference server of the run's base model, as the worker that drives the run found it."""

    url: str
    token: str = ""
    # A checkpoint folder of the run -> (store key, sha256) once it is recorded in the store; None:
    # named by its folder (a server on this host reads it there).
    locate: Callable[[Path], tuple[str, str] | None] | None = None
    timeout_s: float = 3600.0  # one call is a turn of a whole step's rollouts
    engine: str = "transformers"  # the server's engine, so its dialect: transformers | vllm
    # vLLM only: its host's checkpoint fetcher (empty: none; a checkpoint is then named by its
    # folder, for a server on this host), the base model's name there (--served-model-name), and
    # the prefix of the adapter names this run loads (unique to the run on a shared server).
    fetch_url: str = ""
    served_model: str = ""
    adapter_prefix: str = ""
    concurrency: int = 64  # vLLM only: requests in flight at once (one per seeded prompt)


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

    @property
    def vllm(self) -> bool:
        return self.server.engine == "vllm"

    def load_adapter(self, name: str, path: Path) -> None:
        path = Path(path)
        located = self.server.locate(path) if self.server.locate is not None else None
        if self.vllm:
            self._adapters[name] = (path, {VLLM_NAME: self._vllm_load(name, path, located)})
            return
        if located is not None:
            headers = {ADAPTER_KEY_HEADER: located[0], ADAPTER_SHA256_HEADER: located[1]}
        else:
            headers = {ADAPTER_HEADER: str(path)}
        self._adapters[name] = (path, headers)

    def unload_adapter(self, name: str) -> None:
        # The transformers server keeps what it loaded in its own LRU; vLLM is told.
        entry = self._adapters.pop(name, None)
        if entry is not None and self.vllm:
            try:
                self._post_json(
                    self.url, "/v1/unload_lora_adapter", {"lora_name": entry[1][VLLM_NAME]}, answer=False
                )
            except RemoteEngineError as exc:  # best effort: one vLLM does not know is as good as unloaded
                log.warning("%s", exc)

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
        if self.vllm:
            model = self._adapters[adapter][1][VLLM_NAME] if adapter is not None else self.server.served_model
            try:
                choices = self._vllm_generate(prompt_token_ids, sampling, model)
            except RemoteEngineError as exc:
                # A restarted vLLM has forgotten the adapter: load it again and try once more.
                if adapter is None or "does not exist" not in str(exc):
                    raise
                self.load_adapter(adapter, self._adapters[adapter][0])
                choices = self._vllm_generate(prompt_token_ids, sampling, model)
            return report_finished_after(report_after(choices, on_token), on_finished)
        headers = dict(self._adapters[adapter][1]) if adapter is not None else {}
        answer = self._post({"prompts": prompt_token_ids, "sampling": sampling_body(sampling)}, headers)
        if set(answer.get("stop_token_ids") or []) != set(self.stop_token_ids):
            raise RemoteEngineError(
                f"the inference server at {self.url} ends completions at tokens {sorted(answer.get('stop_token_ids') or [])}, "
                f"the trainer's model at {sorted(self.stop_token_ids)}: it does not serve the run's base model"
            )
        choices = choices_of(prompt_token_ids, answer["choices"])
        return report_finished_after(report_after(choices, on_token), on_finished)

    # ------------------------------------------------------------------ vLLM
    def _vllm_load(self, name: str, path: Path, located: tuple[str, str] | None) -> str:
        """Load the checkpoint into vLLM under the run's own name for it; returns that name."""
        folder = str(path)
        if located is not None and self.server.fetch_url:
            answer = self._post_json(
                self.server.fetch_url, FETCH_PATH, {"key": located[0], "sha256": located[1]}
            )
            folder = str(answer.get("path") or "")
            if not folder:
                raise RemoteEngineError(
                    f"the checkpoint fetcher at {self.server.fetch_url} answered without a path"
                )
        vllm_name = f"{self.server.adapter_prefix}{name}"
        try:
            self._post_json(
                self.url, "/v1/load_lora_adapter", {"lora_name": vllm_name, "lora_path": folder}, answer=False
            )
        except RemoteEngineError as exc:
            if not ("already" in str(exc) and "loaded" in str(exc)):
                raise
        return vllm_name

    def _vllm_generate(self, prompts: list[list[int]], sampling: SamplingParams, model: str) -> list[Choice]:
        from training.engines.vllm_engine import check_logprob_convention, request_seed

        check_logprob_convention(sampling)
        body = vllm_completion_body(
            sampling, model, sorted(self.stop_token_ids | set(sampling.stop_token_ids))
        )
        if sampling.seed is None:  # one request: vLLM samples its prompts independently
            answer = self._post_json(self.url, "/v1/completions", {**body, "prompt": prompts})
            return choices_of_vllm(prompts, answer, sampling.top_logprobs)
        requests = [
            {**body, "prompt": [prompt], "seed": request_seed(sampling.seed, index)}
            for index, prompt in enumerate(prompts)
        ]
        workers = max(1, min(self.server.concurrency, len(requests)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-rollouts") as pool:
            answers = list(
                pool.map(lambda request: self._post_json(self.url, "/v1/completions", request), requests)
            )
        return [
            choices_of_vllm([prompt], answer, sampling.top_logprobs)[0]
            for prompt, answer in zip(prompts, answers, strict=True)
        ]

    def _post_json(
        self, base: str, path: str, body: dict[str, Any], *, answer: bool = True
    ) -> dict[str, Any]:
        """POST ``body``; its JSON answer (``answer=False``: none read, vLLM's LoRA routes answer
        plain text)."""
        return self._send(f"{base.rstrip('/')}{path}", body, {}, answer=answer)

    # ------------------------------------------------------------------ HTTP
    def _post(self, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        return self._send(f"{self.url}/generate", body, headers)

    def _send(
        self, url: str, body: dict[str, Any], headers: dict[str, str], *, answer: bool = True
    ) -> dict[str, Any]:
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        request.add_header("content-type", "application/json")
        if self.server.token:
            request.add_header("authorization", f"Bearer {self.server.token}")
        for name, value in headers.items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=self.server.timeout_s) as response:  # noqa: S310 (the registry's URL)
                data = response.read()
                return json.loads(data) if answer else {}  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            message = error_message(exc.read()) or str(exc.reason)
            raise RemoteEngineError(f"{self._who(url)} answered {exc.code}: {message}") from None
        except OSError as exc:
            raise RemoteEngineError(f"{self._who(url)} cannot be reached: {exc}") from None

    def _who(self, url: str) -> str:
        if url.startswith(self.url):
            return f"the inference server at {self.url}"
        return f"the inference server's checkpoint fetcher at {url.removesuffix(FETCH_PATH)}"


def vllm_completion_body(sampling: SamplingParams, model: str, stop_token_ids: list[int]) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` body for ``sampling``, less the prompt and seed: the sampled
    tokens come back as ``token_id:<id>`` with their logprobs (``logprobs``: the k alternatives
    asked for; 0 is the sampled token's alone), the text cut before a stop string, stop tokens
    kept last in the tokens as an eos is (the in-process vLLM engine's settings)."""
    return {
        "model": model,
        "n": 1,
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "stop": list(sampling.stop),
        "stop_token_ids": stop_token_ids,
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "logprobs": sampling.top_logprobs,
        "return_tokens_as_token_ids": True,
        "stream": False,
    }


def _token_id(token: Any) -> int:
    if not (isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX)):
        raise RemoteEngineError(
            f"vLLM sent token {token!r}, not {TOKEN_ID_PREFIX}<id>: it ignored return_tokens_as_token_ids"
        )
    return int(token[len(TOKEN_ID_PREFIX) :])


def choices_of_vllm(prompts: list[list[int]], answer: dict[str, Any], top_logprobs: int) -> list[Choice]:
    """Our Choices from a vLLM completion of ``prompts`` (n=1: choice ``index`` i is prompt i).
    Raises RemoteEngineError on an answer that does not have one finished, logprobbed completion
    per prompt."""
    by_index = {
        c["index"]: c
        for c in answer.get("choices") or []
        if isinstance(c, dict) and isinstance(c.get("index"), int)
    }
    if sorted(by_index) != list(range(len(prompts))):
        raise RemoteEngineError(f"vLLM answered {len(by_index)} completions for {len(prompts)} prompts")
    choices = []
    for index, prompt in enumerate(prompts):
        completion = by_index[index]
        finish = completion.get("finish_reason")
        if finish not in ("stop", "length"):
            raise RemoteEngineError(f"vLLM did not finish completion {index} (finish_reason={finish!r})")
        logprobs = completion.get("logprobs") or {}
        tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
        if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
            raise RemoteEngineError(f"vLLM sent completion {index} without a logprob per token")
        token_ids = [_token_id(token) for token in tokens]
        if any(value is None for value in values):
            raise RemoteEngineError(f"vLLM sent completion {index} with a token without its logprob")
        alternatives = None
        if top_logprobs:
            rows = logprobs.get("top_logprobs")
            if not isinstance(rows, list) or len(rows) != len(tokens):
                raise RemoteEngineError(f"vLLM sent completion {index} without its top logprobs")
            alternatives = [
                sorted(((_token_id(t), float(v)) for t, v in (row or {}).items()), key=lambda p: -p[1])[
                    :top_logprobs
                ]
                for row in rows
            ]
        choices.append(
            Choice(
                text=str(completion.get("text") or ""),
                prompt_token_ids=list(prompt),
                token_ids=token_ids,
                logprobs=[float(value) for value in values],
                finish_reason=finish,
                top_logprobs=alternatives,
            )
        )
    return choices
