"""artweb's CPU inference server against vLLM's CPU build, side by side in one run on one machine.

Both serve the bundled SmolLM2-135M-Instruct (the local HF folder converted from its GGUF). artweb's
side is training.serving's InferenceApp over TransformersEngine, started as a child process by this
module's own launcher (``--serve-artweb``, no Django), with ``--threads`` torch threads. vLLM's side
is ``.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server`` with the command line and
environment the platform uses (training.serving.vllm.vllm_serve_command: LoRA enabled, the bearer
guard), a 2 GiB KV cache and vLLM's own CPU thread binding (``--vllm-omp-bind`` overrides it).

For each dtype (bf16, fp32) each server is started, then measured:
- start: seconds from process start to ``GET /health`` answering 200;
- throughput: generated tokens per second with 1 and with 16 concurrent clients (token-id prompts:
  artweb's ``POST /generate``, vLLM's ``POST /v1/completions``; ``--tokens`` new tokens,
  temperature 1, no stop: vLLM gets ``ignore_eos`` and the artweb launcher empties the engine's stop
  token ids, so every request generates exactly ``--tokens`` tokens on both), each without and with
  a LoRA adapter, each alone and beside a busy process (a 2-thread torch matmul loop, as a
  training job on the same host would be);
- TTFT: median time to the first streamed token of a chat completion, 1 client, alone;
- memory: peak resident set of the server's process tree (the process and all its descendants,
  summed from /proc; pages shared between them count once per process, so PSS is in the JSON too);
- logprob agreement: the logprob each engine reports for each sampled token against the
  teacher-forced logprob of the same token from a plain transformers forward pass in fp32,
  log_softmax(logits / temperature) (the trainer's convention, training.engines.base), without and
  with the adapter: max and mean absolute difference (a bf16 server's includes its rounding).

artweb's engine runs bf16 weights on the CPU (the launcher loads them so; decoding packs bf16
linears too), but the platform's serve_inference loads with dtype "auto", which is fp32 on a CPU
(training.base_models.resolve_dtype): its bf16 rows are what the engine can do, not what is deployed.

The adapter is a peft LoRA of rank 8 on the trainer's target modules (training.session.policy's
peft_lora_config) with small random B factors: peft initialises B to zero, which would make the
adapter a no-op. artweb's server takes it by path (x-artweb-adapter, under its adapter root);
vLLM through ``POST /v1/load_lora_adapter``.

    .venv/bin/python -m benchmarks.engines_cpu --json /tmp/engines_cpu.json   # full
    .venv/bin/python -m benchmarks.engines_cpu --quick    # fp32 alone, 16 tokens: a check in < 3 min

Each row is one measurement: on a machine other work shares, the numbers move from run to run.

Ports are drawn at random from 18000-18999. The servers and the busy process are children of this
process and are stopped when it ends.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import contextlib
import http.client
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "engines-bench-token"  # both servers' bearer token; handed to children in the environment
TOKEN_VARIABLE = "ENGINES_BENCH_TOKEN"
MODEL_NAME = "smollm2-bench"
ADAPTER_NAME = "bench-lora"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PROMPTS = [
    "The history of the river valley begins with the first farmers, who",
    "In the workshop the old clockmaker explained how a pendulum keeps time:",
    "A short guide to baking bread at home. First, mix the flour and water",
    "The committee met on Tuesday to discuss the new library, and the first speaker",
    "When the train left the station, the passengers in the last carriage",
    "Photosynthesis turns light into chemical energy. In the leaves of a plant,",
]
CHAT_MESSAGES = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]


# ---------------------------------------------------------------------------- pure helpers


def tree_pids(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and all its descendants, given each pid's parent."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def read_parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """Every process's parent pid, from /proc/<pid>/stat (its command name may hold spaces and
    parentheses: the fields after the last ')' are the ones read)."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
    return parents


def tree_memory_kib(root: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """Summed VmRSS and Pss (KiB) of `root`'s process tree; processes gone meanwhile count 0."""
    total = {"rss": 0, "pss": 0}
    for pid in tree_pids(root, read_parents(proc)):
        try:
            status = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        total["rss"] += _kib_field(status, "VmRSS:")
        with contextlib.suppress(OSError):  # smaps_rollup needs Linux 4.14
            total["pss"] += _kib_field((proc / str(pid) / "smaps_rollup").read_text(), "Pss:")
    return total


def _kib_field(text: str, name: str) -> int:
    for line in text.splitlines():
        if line.startswith(name):
            return int(line.split()[1])
    return 0


def logprob_difference(reported: Sequence[float], reference: Sequence[float]) -> dict[str, float]:
    """Max and mean absolute difference of two equally long logprob lists."""
    if len(reported) != len(reference) or not reported:
        raise ValueError(f"cannot compare {len(reported)} logprobs with {len(reference)}")
    gaps = [abs(a - b) for a, b in zip(reported, reference, strict=True)]
    return {"max": max(gaps), "mean": sum(gaps) / len(gaps), "tokens": len(gaps)}


def tempered_logprobs(logits: Any, token_ids: Sequence[int], temperature: float) -> list[float]:
    """log_softmax(logits / temperature) at each sampled token (logits [T, V], one row per token),
    the convention every engine reports under (training.engines.base)."""
    import torch

    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    logprobs = torch.log_softmax(scaled, dim=-1)
    index = torch.tensor(list(token_ids), dtype=torch.long)
    return logprobs[torch.arange(len(index)), index].tolist()


def vllm_token_ids(choice: dict[str, Any]) -> list[int]:
    """The sampled token ids of a vLLM completion choice: its `token_ids` when it has them, else
    from `return_tokens_as_token_ids` tokens ("token_id:123")."""
    if choice.get("token_ids"):
        return [int(t) for t in choice["token_ids"]]
    return [int(token.removeprefix("token_id:")) for token in choice["logprobs"]["tokens"]]


def median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


ROW_KEYS = ("dtype", "adapter", "load", "clients")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (engine, dtype, adapter, load, clients). TTFT and the logprob difference
    belong to (engine, dtype, adapter): they are shown on its 1-client row alone; start and memory
    belong to the server (engine, dtype)."""
    header = ["engine", "dtype", "adapter", "load", "clients", "tokens/s", "TTFT ms", "start s",
              "RSS GiB", "logprob diff max / mean"]  # fmt: skip
    lines = []
    for row in rows:
        first = row["load"] == "alone" and row["clients"] == 1
        diff = row.get("logprob_diff") if first else None
        lines.append([
            row["engine"], row["dtype"], row["adapter"], row["load"], str(row["clients"]),
            _cell(row["tokens_per_s"]),
            _cell(row["ttft_s"] * 1000 if first and row.get("ttft_s") is not None else None, 0),
            _cell(row.get("start_s")), _cell(row.get("rss_gib"), 2),
            f"{diff['max']:.4f} / {diff['mean']:.5f}" if diff else "",
        ])  # fmt: skip
    return markdown_table(header, lines)


def ratio_rows(
    rows: Sequence[dict[str, Any]], engine: str = "vllm", base: str = "artweb"
) -> list[dict[str, Any]]:
    """`engine` / `base` for every (dtype, adapter, load, clients) both have, measured in this run."""
    by_key = {(row["engine"], *(row[k] for k in ROW_KEYS)): row for row in rows}
    found = []
    for row in rows:
        if row["engine"] != base:
            continue
        key = tuple(row[k] for k in ROW_KEYS)
        other = by_key.get((engine, *key))
        if other is None:
            continue
        first = row["load"] == "alone" and row["clients"] == 1
        found.append({
            **dict(zip(ROW_KEYS, key, strict=True)),
            "tokens_per_s": ratio(other["tokens_per_s"], row["tokens_per_s"]),
            "ttft": ratio(other.get("ttft_s"), row.get("ttft_s")) if first else None,
            "start": ratio(other.get("start_s"), row.get("start_s")),
            "rss": ratio(other.get("rss_gib"), row.get("rss_gib")),
        })  # fmt: skip
    return found


def ratios_table(ratios: Sequence[dict[str, Any]]) -> str:
    header = ["dtype", "adapter", "load", "clients", "tokens/s vLLM/artweb", "TTFT", "start", "RSS"]
    lines = [
        [r["dtype"], r["adapter"], r["load"], str(r["clients"]), _cell(r["tokens_per_s"], 2),
         _cell(r["ttft"], 2), _cell(r["start"], 2), _cell(r["rss"], 2)]
        for r in ratios
    ]  # fmt: skip
    return markdown_table(header, lines)


# ---------------------------------------------------------------------------- HTTP


def request_json(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                 timeout_s: float = 600) -> tuple[int, Any]:  # fmt: skip
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", path, json.dumps(body), {
            "content-type": "application/json", "authorization": f"Bearer {TOKEN}", **(headers or {}),
        })  # fmt: skip
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode(errors="replace")


def first_token_seconds(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> float:
    """Seconds from sending a streamed chat completion to the first event that carries a token."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    started = time.perf_counter()
    try:
        connection.request("POST", path, json.dumps({**body, "stream": True}), {
            "content-type": "application/json", "authorization": f"Bearer {TOKEN}", **headers,
        })  # fmt: skip
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}: {response.read()[:500]!r}")
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and ((choices[0].get("delta") or {}).get("content") or choices[0].get("logprobs")):
                return time.perf_counter() - started
        return time.perf_counter() - started  # no token carried text: the stream's end
    finally:
        connection.close()


# ---------------------------------------------------------------------------- the servers


@dataclass
class Sample:
    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float]


class Server:
    """A running server of one engine: how to sample from it and how to stop it."""

    engine = ""

    def __init__(self, process: subprocess.Popen, url: str, log: Path, adapter_dir: Path) -> None:
        self.process, self.url, self.log, self.adapter_dir = process, url, log, adapter_dir
        self.peak = {"rss": 0, "pss": 0}
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_memory, daemon=True)
        self._sampler.start()

    def _sample_memory(self) -> None:
        while not self._stop.is_set():
            memory = tree_memory_kib(self.process.pid)
            for key in self.peak:
                self.peak[key] = max(self.peak[key], memory[key])
            self._stop.wait(0.5)

    def stop(self) -> None:
        from training.serving.vllm import stop_child

        self._stop.set()
        self._sampler.join(timeout=5)
        stop_child(self.process, grace_s=30)

    def sample(self, prompt: list[int], tokens: int, adapter: bool) -> Sample:
        raise NotImplementedError

    def ttft(self, tokens: int, adapter: bool) -> float:
        raise NotImplementedError


class ArtwebServer(Server):
    engine = "artweb"

    def sample(self, prompt: list[int], tokens: int, adapter: bool) -> Sample:
        headers = {"x-artweb-adapter": str(self.adapter_dir)} if adapter else {}
        body = {"prompts": [prompt], "sampling": {"temperature": 1.0, "max_new_tokens": tokens}}
        status, answer = request_json(self.url, "/generate", body, headers)
        if status != 200:
            raise RuntimeError(f"artweb /generate answered {status}: {answer}")
        choice = answer["choices"][0]
        return Sample(prompt, choice["token_ids"], choice["logprobs"])

    def ttft(self, tokens: int, adapter: bool) -> float:
        headers = {"x-artweb-adapter": str(self.adapter_dir)} if adapter else {}
        body = {"model": MODEL_NAME, "messages": CHAT_MESSAGES, "max_tokens": tokens, "temperature": 1.0}
        return first_token_seconds(self.url, "/v1/chat/completions", body, headers)


class VLLMServer(Server):
    engine = "vllm"

    def load_adapter(self) -> None:
        from training.serving.vllm import load_adapter_call

        call = load_adapter_call(ADAPTER_NAME, self.adapter_dir)
        status, answer = request_json(self.url, call.path, call.json)
        if status != 200:
            raise RuntimeError(f"vLLM {call.path} answered {status}: {answer}")

    def sample(self, prompt: list[int], tokens: int, adapter: bool) -> Sample:
        body = {
            "model": ADAPTER_NAME if adapter else MODEL_NAME, "prompt": prompt, "max_tokens": tokens,
            "temperature": 1.0, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
        }  # fmt: skip
        status, answer = request_json(self.url, "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"vLLM /v1/completions answered {status}: {answer}")
        choice = answer["choices"][0]
        return Sample(
            prompt, vllm_token_ids(choice), [float(x) for x in choice["logprobs"]["token_logprobs"]]
        )

    def ttft(self, tokens: int, adapter: bool) -> float:
        body = {"model": ADAPTER_NAME if adapter else MODEL_NAME, "messages": CHAT_MESSAGES,
                "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}  # fmt: skip
        return first_token_seconds(self.url, "/v1/chat/completions", body, {})


def free_port() -> int:
    """A free port in 18000-18999 (the range this machine's helpers share), drawn at random."""
    for _ in range(200):
        port = random.randint(18000, 18999)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 18000-18999")


def wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Return once `url`/health answers 200; the log's end in the error if the server never does."""
    from training.serving.vllm import VLLMStartError, wait_until_healthy

    try:
        wait_until_healthy(process, url, timeout_s=timeout_s)
    except VLLMStartError as exc:
        process.kill()
        raise RuntimeError(f"{exc}; the log's end:\n{log.read_text()[-3000:]}") from None


def start_artweb(args: argparse.Namespace, dtype: str, adapter_dir: Path, work: Path) -> tuple[Server, float]:
    port = free_port()
    log = work / f"artweb-{dtype}.log"
    env = {**os.environ, TOKEN_VARIABLE: TOKEN, "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "benchmarks.engines_cpu", "--serve-artweb", "--model-dir",
               str(args.model_dir), "--dtype", dtype, "--threads", str(args.threads), "--port", str(port),
               "--adapter-root", str(adapter_dir.parent)]  # fmt: skip
    started = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, log, timeout_s=300)
    return ArtwebServer(process, url, log, adapter_dir), time.perf_counter() - started


def start_vllm_server(
    args: argparse.Namespace, dtype: str, adapter_dir: Path, work: Path
) -> tuple[Server, float]:
    from training.serving.vllm import API_SERVER_MODULE, VLLMServeOptions, start_vllm, vllm_serve_command

    port = free_port()
    log = work / f"vllm-{dtype}.log"
    options = VLLMServeOptions(
        model_dir=args.model_dir, served_model_name=MODEL_NAME, port=port, api_key=TOKEN,
        dtype=DTYPES[dtype], cpu_kv_cache_gib=2, max_model_len=2048, seed=0,
        max_loras=1, max_lora_rank=8, max_cpu_loras=1,
    )  # fmt: skip
    command, extra = vllm_serve_command(options, [args.vllm_python, "-m", API_SERVER_MODULE],
                                        python_path=os.environ.get("PYTHONPATH", ""))  # fmt: skip
    env = {**os.environ, **extra}
    if args.vllm_omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    started = time.perf_counter()
    with log.open("w") as output:
        # start_vllm's child inherits our stdout; send its (long) log to a file instead.
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
        try:
            process = start_vllm(command, env)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, log, timeout_s=600)
    seconds = time.perf_counter() - started
    server = VLLMServer(process, url, log, adapter_dir)
    server.load_adapter()
    return server, seconds


# ---------------------------------------------------------------------------- load


def run_clients(send: Callable[[list[int]], int], prompts: Sequence[list[int]], clients: int,
                requests_per_client: int) -> dict[str, float]:  # fmt: skip
    """`clients` threads, each sending `requests_per_client` requests back to back; tokens per
    second over the wall time from the common start to the last answer."""
    barrier = threading.Barrier(clients + 1)
    counts = [0] * clients
    errors: list[BaseException] = []

    def client(index: int) -> None:
        barrier.wait()
        try:
            for number in range(requests_per_client):
                counts[index] += send(prompts[(index + number * clients) % len(prompts)])
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    return {"tokens": sum(counts), "seconds": wall, "tokens_per_s": sum(counts) / wall}


class BusyProcess:
    """A separate process running a 2-thread torch matmul loop (``--busy``) while it is held."""

    def __enter__(self) -> BusyProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.process = subprocess.Popen([sys.executable, "-m", "benchmarks.engines_cpu", "--busy"], cwd=ROOT,
                                        env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.process.stdout is not None
        self.process.stdout.readline()  # "busy": its loop has begun
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def busy_loop() -> None:
    import torch

    torch.set_num_threads(2)
    a = torch.randn(768, 768)
    b = torch.randn(768, 768)
    print("busy", flush=True)
    while True:
        a = torch.tanh(a @ b)


def measure_server(server: Server, args: argparse.Namespace, dtype: str, prompts: list[list[int]],
                   start_s: float) -> tuple[list[dict[str, Any]], dict[str, list[Sample]]]:  # fmt: skip
    """Every throughput row of one server, its TTFT, and the samples for the logprob check."""
    rows = []
    samples: dict[str, list[Sample]] = {}
    for adapter in (False, True):
        name = "lora" if adapter else "none"

        def send(prompt: list[int], adapter: bool = adapter) -> int:
            return len(server.sample(prompt, args.tokens, adapter).token_ids)

        run_clients(send, prompts, 2, 1)  # warm-up (and artweb's first adapter load)
        server.ttft(args.ttft_tokens, adapter)  # the chat route's first call renders a template: not timed
        ttfts = [server.ttft(args.ttft_tokens, adapter) for _ in range(args.ttft_samples)]
        samples[name] = [
            server.sample(prompt, args.tokens, adapter) for prompt in prompts[: args.logprob_prompts]
        ]
        for load in ("alone", "busy"):
            for clients in args.clients:
                per_client = max(1, args.requests // clients) if clients > 1 else args.requests_single
                if load == "busy":
                    with BusyProcess():
                        result = run_clients(send, prompts, clients, per_client)
                else:
                    result = run_clients(send, prompts, clients, per_client)
                rows.append({
                    "engine": server.engine, "dtype": dtype, "adapter": name, "load": load, "clients": clients,
                    "tokens_per_s": result["tokens_per_s"], "tokens": result["tokens"],
                    "seconds": result["seconds"], "requests": clients * per_client,
                    "ttft_s": median(ttfts), "ttft_samples_s": ttfts, "start_s": start_s,
                })  # fmt: skip
                print(f"  {server.engine} {dtype} adapter={name} {load} clients={clients}: "
                      f"{result['tokens_per_s']:.1f} tokens/s in {result['seconds']:.1f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
    for row in rows:
        row["rss_gib"] = server.peak["rss"] / 2**20
        row["pss_gib"] = server.peak["pss"] / 2**20
    return rows, samples


# ---------------------------------------------------------------------------- adapter and reference


def make_adapter(model_dir: Path, folder: Path, seed: int = 0, b_std: float = 0.02) -> Path:
    """A rank-8 LoRA of the model on the trainer's target modules, with random B (peft's B is 0)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from training.config import LoraSpec
    from training.session.policy import peft_lora_config

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model = get_peft_model(base, peft_lora_config(LoraSpec(rank=8)))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, b_std)
    model.save_pretrained(str(folder))
    return folder


def reference_logprobs(model_dir: Path, adapter_dir: Path | None, samples: Sequence[Sample],
                       temperature: float = 1.0) -> list[list[float]]:  # fmt: skip
    """Teacher-forced logprobs of each sample's tokens from an fp32 transformers forward pass."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    model.eval()
    found = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample.prompt + sample.token_ids])
            logits = model(input_ids=ids).logits[0]
            start = len(sample.prompt) - 1
            found.append(tempered_logprobs(logits[start : start + len(sample.token_ids)], sample.token_ids,
                                           temperature))  # fmt: skip
    return found


# ---------------------------------------------------------------------------- artweb's launcher


def serve_artweb(args: argparse.Namespace) -> None:
    """artweb's CPU inference server as serve_inference's transformers path builds it, without the
    platform (no Django, registry or heartbeat). With the engine's stop token ids emptied, so a
    request generates exactly max_new_tokens tokens, as vLLM's ignore_eos does."""
    import torch

    torch.set_num_threads(args.threads)
    from training.base_models import load_base_model
    from training.engines.transformers_engine import TransformersEngine
    from training.serving.app import InferenceApp, ServerConfig
    from training.serving.protocol import Limits
    from training.serving.server import bind, serve

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model, tokenizer = load_base_model(str(args.model_dir), args.model_dir.parent, dtype=dtype)
    engine = TransformersEngine(model, tokenizer, device="cpu")
    engine.stop_token_ids = set()
    token = os.environ[TOKEN_VARIABLE]
    config = ServerConfig(
        model_name=MODEL_NAME, adapter_root=Path(args.adapter_root), token=token,
        limits=Limits(max_n=16, max_tokens=4096), max_batch_size=32, adapter_capacity=2,
        context_length=getattr(model.config, "max_position_embeddings", None),
    )  # fmt: skip
    sock = bind("127.0.0.1", args.port)
    print(f"artweb inference server on http://127.0.0.1:{args.port}", flush=True)
    serve(InferenceApp(engine, config), sock=sock, url=f"http://127.0.0.1:{args.port}", token=token)


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and requests (a check in ~3 min)")
    parser.add_argument("--threads", type=int, default=2, help="artweb's server torch threads")
    parser.add_argument(
        "--dtypes", nargs="+", choices=tuple(DTYPES), help="default: bf16 and fp32 (--quick: fp32 alone)"
    )
    parser.add_argument("--engines", nargs="+", choices=("artweb", "vllm"), default=["artweb", "vllm"])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrent measurement")
    parser.add_argument("--requests-single", type=int, default=6, help="requests of the 1-client measurement")
    parser.add_argument("--ttft-samples", type=int, default=7)
    parser.add_argument("--ttft-tokens", type=int, default=4)
    parser.add_argument("--logprob-prompts", type=int, default=4)
    parser.add_argument("--cache", type=Path, default=ROOT / "data" / "models", help="converted models")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument(
        "--vllm-omp-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND (default: vLLM's auto)"
    )
    parser.add_argument("--json", type=Path)
    # The child modes this module runs itself as:
    parser.add_argument("--serve-artweb", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--busy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=tuple(DTYPES), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--adapter-root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.requests, args.requests_single = 16, 16, 2
        args.ttft_samples, args.logprob_prompts = 3, 2
    if args.dtypes is None:
        args.dtypes = ["fp32"] if args.quick else list(DTYPES)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.busy:
        busy_loop()
    if args.serve_artweb:
        serve_artweb(args)
        return {}
    from training.base_models import BUNDLED_MODEL, base_model_dir, load_tokenizer

    args.model_dir = base_model_dir(BUNDLED_MODEL, args.cache)  # converted once, outside the timings
    tokenizer = load_tokenizer(BUNDLED_MODEL, args.cache)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]
    work = Path(tempfile.mkdtemp(prefix="engines-cpu-"))
    adapter_dir = make_adapter(args.model_dir, work / "adapters" / "lora-r8")
    rows: list[dict[str, Any]] = []
    samples: dict[tuple[str, str, str], list[Sample]] = {}
    starters = {"artweb": start_artweb, "vllm": start_vllm_server}
    for dtype in args.dtypes:
        for engine in args.engines:
            print(f"starting {engine} ({dtype})", file=sys.stderr, flush=True)
            server, start_s = starters[engine](args, dtype, adapter_dir, work)
            try:
                found, drawn = measure_server(server, args, dtype, prompts, start_s)
            finally:
                server.stop()
            rows += found
            for adapter, taken in drawn.items():
                samples[(engine, dtype, adapter)] = taken
    # The reference forward passes run after every server has stopped: they would compete for cores.
    references = {}
    for adapter, folder in (("none", None), ("lora", adapter_dir)):
        flat = [s for (_, _, name), taken in samples.items() if name == adapter for s in taken]
        references[adapter] = reference_logprobs(args.model_dir, folder, flat)
    diffs: dict[tuple[str, str, str], dict[str, float]] = {}
    for adapter in ("none", "lora"):
        position = 0
        for key, taken in samples.items():
            if key[2] != adapter:
                continue
            reported = [x for s in taken for x in s.logprobs]
            reference = [x for ref in references[adapter][position : position + len(taken)] for x in ref]
            position += len(taken)
            diffs[key] = logprob_difference(reported, reference)
    for row in rows:
        row["logprob_diff"] = diffs.get((row["engine"], row["dtype"], row["adapter"]))
    adapter_effect = adapter_shift(args.model_dir, adapter_dir, samples)
    ratios = ratio_rows(rows)
    print(results_table(rows))
    print()
    print(ratios_table(ratios))
    print(f"\nthe adapter moves the reference logprobs of the sampled tokens by {adapter_effect:.3f} "
          f"nats on average (not a no-op)")  # fmt: skip
    for line in vllm_thread_lines(work):
        print(f"vLLM's CPU binding: {line.split('] ', 1)[-1].strip()}")
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("serve_artweb", "busy", "dtype", "port", "adapter_root")},
        "cpus": os.cpu_count(), "rows": rows, "ratios": ratios, "adapter_effect_nats": adapter_effect,
        "vllm_threads": vllm_thread_lines(work),
    }  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return report


def adapter_shift(
    model_dir: Path, adapter_dir: Path, samples: dict[tuple[str, str, str], list[Sample]]
) -> float:
    """Mean absolute change the adapter makes to the fp32 reference logprobs of some sampled tokens."""
    taken = next(iter(samples.values()), [])
    if not taken:
        return 0.0
    base = reference_logprobs(model_dir, None, taken)
    adapted = reference_logprobs(model_dir, adapter_dir, taken)
    flat_base = [x for row in base for x in row]
    flat_adapted = [x for row in adapted for x in row]
    return logprob_difference(flat_adapted, flat_base)["mean"]


def vllm_thread_lines(work: Path) -> list[str]:
    """vLLM's own account of the cores its worker is bound to, from its logs."""
    return [line.strip() for log in sorted(work.glob("vllm-*.log")) for line in log.read_text().splitlines()
            if "core ids=" in line or "reserved_cpus=" in line]  # fmt: skip


if __name__ == "__main__":
    main()
