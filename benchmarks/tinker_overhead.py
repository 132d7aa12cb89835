"""What the Tinker API costs over the session core, measured in one run on the embedded stack.

``manage.py up`` (SQLite, the filesystem broker, a Celery worker, the trainer service, the
inference server) runs in a temporary data folder; the unmodified ``tinker`` SDK trains on it, and
the same updates run in this process on a ``TrainingSession`` of the same base model, adapter shape
and seed. Sides are interleaved step by step.

- ``train``: seconds per ``forward_backward`` + ``optim_step`` (both submitted, then awaited) through
  the SDK, against the same two calls in-process; the SDK's losses must equal the in-process ones.
- ``sample``: seconds per ``sample`` (one completion, ``--max-tokens`` greedy tokens) through the SDK
  (worker → trainer service), against the same completion through the gateway's
  ``/v1/chat/completions`` (inference server).

    .venv/bin/python -m benchmarks.tinker_overhead --steps 8            # the bundled model
    .venv/bin/python -m benchmarks.tinker_overhead --tiny --steps 3     # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks._model import ROOT, add_model_arguments, prepared_model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _manage(env: dict[str, str], code: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def _wait_up(url: str, process: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the stack stopped:\n{log.read_text()[-3000:]}")
        if "artweb is up" in log.read_text():
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                    return
            except OSError:
                pass
        time.sleep(0.5)
    raise SystemExit(f"the stack did not come up in {timeout}s:\n{log.read_text()[-3000:]}")


@contextmanager
def live_stack(cache: Path, source: str, broker: str = "") -> Iterator[tuple[str, dict[str, str]]]:
    """``manage.py up`` on ``source`` in a scratch data folder (SQLite; the embedded filesystem
    broker unless ``broker`` names one), up until the block ends: its URL and environment."""
    data_dir = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    (data_dir / "models").symlink_to(cache.resolve(), target_is_directory=True)
    port = _free_port()
    env = {**os.environ, "ARTWEB_DATA_DIR": str(data_dir), "DEBUG": "1", "HF_HUB_OFFLINE": "1",
           "TINKER_POLL_S": "10", "GATEWAY_RATE_LIMIT_PER_MINUTE": "0"}  # fmt: skip
    env.pop("DATABASE_URL", None)
    env.pop("CELERY_BROKER_URL", None)
    if broker:
        env["CELERY_BROKER_URL"] = broker
    log = data_dir / "up.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as handle:
        stack = subprocess.Popen(
            [sys.executable, "manage.py", "up", "--port", str(port), "--demo-steps", "0", "--base-model", source,
             "--inference-port", "0", "--trainer-port", str(_free_port())],
            cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_up(url, stack, log)
        yield url, env
    finally:
        stack.terminate()
        try:
            stack.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stack.kill()


def _datums(tokenizer: Any, count: int, seed: int) -> list[tuple[list[int], list[float]]]:
    """(tokens, weights): a prompt of letters, then an answer the loss is on."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = "Repeat after me: " + " ".join(rng.choice(["red", "blue", "green"]) for _ in range(8))
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(" The answer is yes.", add_special_tokens=False)
        out.append((prompt_ids + answer_ids, [0.0] * len(prompt_ids) + [1.0] * len(answer_ids)))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--broker", default="", help="a Celery broker URL (e.g. redis://127.0.0.1:6379/14); "
                        "default: the embedded filesystem broker, which polls once a second")  # fmt: skip
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)

    import tinker
    import torch
    from tinker import types

    from training.base_models import load_base_model, load_tokenizer
    from training.config import LoraSpec, TrainConfig
    from training.session.contract import Datum
    from training.session.local import TrainingSession
    from training.session.policy import Policy

    with live_stack(cache, source, args.broker) as (url, env):
        base_name = _manage(env, "from projects.models import BaseModel; print(BaseModel.objects.get().name)")
        key = _manage(env, "from projects import services; from projects.models import Team; "
                      "team, _ = Team.objects.get_or_create(name='bench'); "
                      "print(services.api_key_create(team=team, name='bench').plaintext)")  # fmt: skip
        tokenizer = load_tokenizer(source, cache)
        pairs = _datums(tokenizer, args.batch, seed=0)
        sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                                loss_fn_inputs={"target_tokens": t[1:], "weights": w[1:]}) for t, w in pairs]  # fmt: skip
        local_data = [Datum(model_input=t[:-1], loss_fn_inputs={"target_tokens": [float(x) for x in t[1:]],
                                                                   "weights": w[1:]}) for t, w in pairs]  # fmt: skip

        client = tinker.ServiceClient(base_url=f"{url}/tinker", api_key=f"tml-{key}")
        trainer = client.create_lora_training_client(base_model=base_name, rank=args.rank, seed=0).result()
        lora = LoraSpec(rank=args.rank, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"])  # fmt: skip
        model, _ = load_base_model(source, cache)
        local = TrainingSession(Policy(model, tokenizer, TrainConfig(seed=0), lora, "cpu"))
        adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}

        report: dict[str, Any] = {"model": source, "threads": torch.get_num_threads(), "steps": args.steps,
                                  "batch": args.batch, "train": {"sdk": [], "local": []}, "losses": []}  # fmt: skip
        for _ in range(args.steps):
            started = time.perf_counter()
            backward = trainer.forward_backward(sdk_data, "cross_entropy")
            step = trainer.optim_step(types.AdamParams(**adam))
            remote_loss = backward.result().metrics["loss:sum"]
            step.result()
            report["train"]["sdk"].append(time.perf_counter() - started)
            started = time.perf_counter()
            local_loss = local.forward_backward(local_data, "cross_entropy").loss
            local.optim_step(learning_rate=adam["learning_rate"], beta1=adam["beta1"], beta2=adam["beta2"],
                             eps=adam["eps"], weight_decay=0.0, max_grad_norm=float("inf"))  # fmt: skip
            report["train"]["local"].append(time.perf_counter() - started)
            report["losses"].append((remote_loss, local_loss))

        sampler = client.create_sampling_client(base_model=base_name).result()
        prompt_text = "Name a colour."
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}], tokenize=True,
                                                   add_generation_prompt=True, return_dict=True)["input_ids"]  # fmt: skip
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        report["sample"] = {"sdk": [], "gateway": [], "sdk_tokens": [], "gateway_tokens": []}
        for _ in range(args.samples):
            started = time.perf_counter()
            result = sampler.sample(types.ModelInput.from_ints(list(prompt_ids)), 1, params).result()
            report["sample"]["sdk"].append(time.perf_counter() - started)
            report["sample"]["sdk_tokens"].append(len(result.sequences[0].tokens))
            body = json.dumps({"model": base_name, "messages": [{"role": "user", "content": prompt_text}],
                               "max_tokens": args.max_tokens, "temperature": 0}).encode()  # fmt: skip
            request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, method="POST")
            request.add_header("Content-Type", "application/json")
            request.add_header("Authorization", f"Bearer {key}")
            started = time.perf_counter()
            with urllib.request.urlopen(request, timeout=300) as response:
                reply = json.loads(response.read())
            report["sample"]["gateway"].append(time.perf_counter() - started)
            report["sample"]["gateway_tokens"].append(reply["usage"]["completion_tokens"])

    # The first step of each side loads (the service opens the session): medians of the rest.
    sdk_train = statistics.median(report["train"]["sdk"][1:] or report["train"]["sdk"])
    local_train = statistics.median(report["train"]["local"][1:] or report["train"]["local"])
    sdk_sample = statistics.median(report["sample"]["sdk"][1:] or report["sample"]["sdk"])
    gateway_sample = statistics.median(report["sample"]["gateway"][1:] or report["sample"]["gateway"])
    report["summary"] = {
        "train_seconds": {"sdk": sdk_train, "in_process": local_train, "ratio": sdk_train / local_train,
                          "added": sdk_train - local_train},
        "sample_seconds": {"sdk": sdk_sample, "gateway": gateway_sample, "ratio": sdk_sample / gateway_sample},
        "losses_equal": all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in report["losses"]),
    }  # fmt: skip
    summary = report["summary"]
    print(
        f"== {source}, batch {args.batch}, rank {args.rank}, {args.steps} steps, broker {args.broker or 'embedded'}"
    )
    print(f"forward_backward + optim_step: SDK {sdk_train:.3f} s, in-process {local_train:.3f} s "
          f"(ratio {summary['train_seconds']['ratio']:.2f}, +{summary['train_seconds']['added']:.3f} s)")  # fmt: skip
    print(f"sample ({args.max_tokens} tokens max): SDK {sdk_sample:.3f} s, gateway {gateway_sample:.3f} s "
          f"(ratio {summary['sample_seconds']['ratio']:.2f})")  # fmt: skip
    print(f"SDK losses equal the in-process ones: {summary['losses_equal']} {report['losses'][:3]}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
