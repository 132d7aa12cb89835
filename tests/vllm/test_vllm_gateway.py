"""`serve_inference --engine vllm` and the gateway's vLLM path against the real vLLM (its CPU build):
the launch (the platform's flags, the token in the environment, a loopback bind, every route but
/health behind the token), each checkpoint loaded through vLLM's runtime LoRA API on first use and
the least recently used unloaded beyond the server's capacity, and the OpenAI surface through the
gateway with OpenAI's client: chat, streams, `n`, logprobs, exact token ids, structured outputs and
forced tool calls; then a run whose rollouts sample on that vLLM, its sampler check passing on
vLLM's processed logprobs. One vLLM and one gateway for the module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from projects import services
from projects.models import BaseModel, InferenceServer, UsageRecord
from tests.projects.gateway.conftest import (
    SERVER_TOKEN,
    Process,
    Serving,
    http,
    wait_for,
)
from tests.vllm.conftest import VLLM_MODEL

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "Hello there"}]


def client(gateway: Process, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def checkpoints(serving: Serving, model_dir: Path, team, steps: list[int], project: str = "vl"):
    """A trainable model on the vLLM base model with LoRA checkpoints at `steps`, each with random
    (non-zero) B matrices: a checkpoint that samples differently from the base model."""
    import torch

    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.session.policy import Policy

    base_model = BaseModel.objects.get(name=VLLM_MODEL)
    model = services.trainable_model_create(
        project=services.project_create(team=team, name=project), name="agent", base_model=base_model
    )
    base, tokenizer = load_base_model(str(model_dir), model_dir.parent)
    trainer = Policy(base, tokenizer, TrainConfig(), LoraSpec(rank=8, alpha=16))
    for step in steps:
        with torch.no_grad():
            for name, parameter in trainer.model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(step))
        path = serving.checkpoint_dir / f"vllm-model-{model.pk}" / f"step-{step}"
        trainer.save_checkpoint(path, step=step, metrics={})
        services.checkpoint_record(model=model, run=None, step=step, path=str(path))
    return model, tokenizer


def served(server: Process) -> set[str]:
    return {m["id"] for m in http("GET", f"{server.url}/v1/models", key=SERVER_TOKEN)[2]["data"]}


def adapter(model, step: int) -> str:
    from projects.gateway.vllm import adapter_name

    return adapter_name(model.checkpoints.get(step=step))


def test_serve_inference_launches_vllm_with_the_platforms_flags_behind_the_token(live, vllm_server):
    row = InferenceServer.objects.get(url=vllm_server.url)
    assert row.engine == "vllm" and vllm_server.url.startswith("http://127.0.0.1:")
    cmdline = Path(f"/proc/{row.pid}/cmdline").read_bytes().decode().split("\0")
    assert cmdline[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-lora", "--logprobs-mode", "--middleware", "--tool-call-parser"):
        assert flag in cmdline
    assert cmdline[cmdline.index("--host") + 1] == "127.0.0.1"
    assert SERVER_TOKEN not in " ".join(cmdline) and "--api-key" not in cmdline
    environ = Path(f"/proc/{row.pid}/environ").read_bytes().split(b"\0")
    assert f"VLLM_API_KEY={SERVER_TOKEN}".encode() in environ
    assert http("GET", f"{vllm_server.url}/health")[0] == 200
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/tokenize"),
                         ("POST", "/v1/load_lora_adapter"), ("GET", "/version")):  # fmt: skip
        request = urllib.request.Request(
            f"{vllm_server.url}{path}", method=method, data=b"{}" if method == "POST" else None
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401, path
    assert served(vllm_server) == {VLLM_MODEL}


def test_checkpoints_load_on_first_use_and_the_least_recently_used_is_unloaded(live, serving, vllm_server,
                                                                             vllm_model_dir, cast, alpha_key):  # fmt: skip
    model, _ = checkpoints(serving, vllm_model_dir, cast.alpha, [1, 2, 3])
    api = client(live, alpha_key)
    for step in (1, 2, 1, 3):  # capacity 2: step 3 pushes out step 2, the least recently used
        reply = api.chat.completions.create(model=f"vl/agent:{step}", messages=HELLO, max_tokens=4)
        assert reply.model == f"vl/agent:{step}" and reply.usage.completion_tokens >= 1
    assert served(vllm_server) == {VLLM_MODEL, adapter(model, 1), adapter(model, 3)}
    # A checkpoint samples its own weights, not the base model's: greedy answers differ.
    greedy = {name: api.chat.completions.create(model=name, messages=HELLO, max_tokens=12, temperature=0)
              .choices[0].message.content for name in (VLLM_MODEL, "vl/agent:3")}  # fmt: skip
    assert greedy[VLLM_MODEL] != greedy["vl/agent:3"]
    wait_for(lambda: sum(r.requests for r in UsageRecord.objects.filter(model__startswith="vl/agent:")) == 5,
             timeout=10, what="the 5 checkpoint requests metered")  # fmt: skip


def test_chat_streams_n_logprobs_and_exact_token_ids_through_the_gateway(
    live, serving, vllm_model_dir, cast, alpha_key
):
    from training.engines.vllm_engine import render_prompt

    _, tokenizer = checkpoints(serving, vllm_model_dir, cast.alpha, [1], project="chat")
    api = client(live, alpha_key)
    chunks = list(api.chat.completions.create(model="chat/agent:latest", messages=HELLO, max_tokens=8, stream=True,
                                              stream_options={"include_usage": True}))  # fmt: skip
    assert {c.model for c in chunks} == {"chat/agent:1"}
    assert [c for c in chunks if c.choices and c.choices[0].finish_reason] and chunks[
        -1
    ].usage.completion_tokens >= 1
    several = api.chat.completions.create(model="chat/agent:1", messages=HELLO, max_tokens=6, n=3, seed=5)
    assert sorted(choice.index for choice in several.choices) == [0, 1, 2]
    reply = api.chat.completions.create(model="chat/agent:1", messages=HELLO, max_tokens=6, logprobs=True,
                                        top_logprobs=2, temperature=1.0, seed=3)  # fmt: skip
    choice = reply.choices[0]
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    # Exact tokens for client-driven training (projects.gateway.token_ids): the ids vLLM sampled and
    # the prompt ids it was given, which are the trainer's rendering of the messages.
    extra = choice.model_dump()
    assert extra["prompt_token_ids"] == render_prompt(tokenizer, HELLO)
    assert len(extra["token_ids"]) == reply.usage.completion_tokens == len(choice.logprobs.content)
    assert extra["artweb_model"] == "chat/agent:1"

    # Stored completions behind vLLM (projects.gateway.capture): the client sees what it asked for,
    # the row keeps vLLM's exact prompt and sampled ids and its logprobs, streamed or not.
    services.completion_storage_set(team=cast.alpha, storage="requested")
    whole = wait_for(lambda: _stored_reply(api, stream=False), timeout=15, what="storage on")
    assert whole.choices[0].logprobs is None and "token_ids" not in (whole.choices[0].model_extra or {})
    streamed = _stored_reply(api, stream=True)
    rows = wait_for(lambda: len(list(api.chat.completions.list())) == 2 and list(api.chat.completions.list()),
                    timeout=15, what="two stored completions")  # fmt: skip
    assert [row.id for row in rows] == [whole.id, streamed]
    for row in rows:
        assert row.model_extra["served_by"] == "chat/agent:1"
        assert row.model_extra["prompt_token_ids"] == render_prompt(tokenizer, HELLO)
        ids, logprobs = (
            row.choices[0].model_extra["token_ids"],
            row.choices[0].model_extra["sampled_logprobs"],
        )
        assert len(ids) == len(logprobs) >= 1 and all(lp <= 0 for lp in logprobs)
    assert rows[0].choices[0].message.content == whole.choices[0].message.content


def _stored_reply(api: OpenAI, *, stream: bool):
    """A ``store: true`` completion (None while the team's setting is not yet seen); streamed:
    its id, after the client has read the stream whole."""
    import openai

    try:
        reply = api.chat.completions.create(model="chat/agent:1", messages=HELLO, max_tokens=6, store=True,
                                            temperature=1.0, seed=7, stream=stream)  # fmt: skip
    except openai.BadRequestError as exc:
        assert exc.body["code"] == "store_not_enabled", exc.body
        return None
    if not stream:
        return reply
    chunks = list(reply)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    return chunks[0].id


def test_structured_outputs_and_forced_tool_calls_are_vllms_own(
    live, serving, vllm_model_dir, cast, alpha_key
):
    checkpoints(serving, vllm_model_dir, cast.alpha, [1], project="struct")
    api = client(live, alpha_key)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    reply = api.chat.completions.create(
        model="struct/agent:1", messages=HELLO, max_tokens=200, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )  # fmt: skip
    verdict = json.loads(reply.choices[0].message.content)  # a random model, constrained by vLLM
    assert verdict["answer"] in ("yes", "no")
    # A forced tool call: vLLM names the function; with the hermes parser (the platform's flag) it
    # does not constrain the arguments to the schema (vLLM 0.32: hermes does not support "required"
    # or named choices), so a random model's arguments need not parse.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}  # fmt: skip
    called = api.chat.completions.create(
        model="struct/agent:1", messages=HELLO, max_tokens=200, temperature=1.0, seed=2, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    assert [call.function.name for call in called.choices[0].message.tool_calls] == ["get_weather"]


def test_a_runs_rollouts_sample_on_the_real_vllm_and_pass_the_sampler_check(
    live, vllm_server, vllm_model_dir, tmp_path
):
    """``rollouts_on: inference_servers`` in vLLM's dialect (training.engines.remote_engine): token-id
    completions, the run's own adapter names loaded and unloaded, and every checkpoint vLLM samples
    passes the sampler check on vLLM's processed logprobs, at float32's tolerance (1e-4)."""
    from tests.training.test_cost_loop import MeteredHooks
    from tests.vllm.test_vllm_runs import vllm_run_spec
    from training.engines.remote_engine import RolloutServer
    from training.runs.loop import run_training

    spec = dataclasses.replace(
        vllm_run_spec(tmp_path / "run", vllm_model_dir, steps=3, max_off_policy_steps=1,
                      rollouts_on="inference_servers", engine="transformers"),
        rollout_server=RolloutServer(url=vllm_server.url, token=SERVER_TOKEN, engine="vllm",
                                     served_model=VLLM_MODEL, adapter_prefix="run-real-"),
    )  # fmt: skip
    hooks = MeteredHooks()
    assert run_training(spec, hooks) == "succeeded", hooks.events
    assert [m["off_policy_steps"] for m in hooks.metrics] == [0.0, 1.0, 1.0]
    gaps = [m["sampler_logprob_gap"] for m in hooks.metrics]
    print("sampler logprob gaps (rollouts on vLLM):", gaps)
    assert all(gap <= 1e-4 for gap in gaps)
    assert not {
        name for name in served(vllm_server) if name.startswith("run-real-")
    }  # the run let go of them


def test_a_tinker_sampling_client_is_served_by_vllm_at_the_checkpoints_logprobs(live, serving, vllm_server,
                                                                                vllm_model_dir, cast, settings):  # fmt: skip
    """TINKER_SAMPLER=auto: a sampling client of a checkpoint samples on the live vLLM of its base
    model, the checkpoint loaded as an adapter for the call and unloaded after it; each sampled
    token's logprob is the checkpoint's own (a teacher-forced float32 forward pass)."""
    import numpy as np
    import torch
    from peft import PeftModel
    from tinker.proto import tinker_public_pb2 as pb

    from projects.jobs.tinker import sample
    from projects.models import TinkerFutureStatus
    from training.base_models import load_base_model

    settings.INFERENCE_SERVER_TOKEN = SERVER_TOKEN  # the worker's, as the deployment's servers have
    model, _ = checkpoints(serving, vllm_model_dir, cast.alpha, [1], project="tinker")
    checkpoint = model.checkpoints.get(step=1)
    session = services.tinker_session_create(team=cast.alpha, project=None, tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    sampler = services.tinker_sampler_create(session=session, sampler_id=None, base_model=checkpoint.model.base_model,
                                             checkpoint=checkpoint)  # fmt: skip
    prompt = [5, 6, 7, 8, 9]
    future = services.tinker_future_submit(team=cast.alpha, kind="sample", payload={
        "sampler": sampler.pk, "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "num_samples": 3, "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 11}})  # fmt: skip
    before = len(vllm_server.output())
    sample(future.pk)
    future.refresh_from_db()
    assert future.status == TinkerFutureStatus.DONE, future.error
    log = vllm_server.output()[before:]
    assert (
        "POST /v1/load_lora_adapter" in log
        and "POST /v1/completions" in log
        and "POST /v1/unload_lora_adapter" in log
    )
    assert not {name for name in served(vllm_server) if name.startswith("tinker-")}
    reply = pb.SampleResponse()
    reply.ParseFromString(bytes(future.blob))
    assert len(reply.sequences) == 3 and future.result["completion_tokens"] >= 3
    base, _ = load_base_model(str(vllm_model_dir), vllm_model_dir.parent)
    policy = PeftModel.from_pretrained(base, checkpoint.path).eval()
    gaps = []
    for sequence in reply.sequences:
        tokens = np.frombuffer(sequence.tokens, dtype=np.int32).tolist()
        logprobs = np.frombuffer(sequence.logprobs, dtype=np.float32)
        with torch.no_grad():
            logits = policy(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        gaps.append(float((expected - torch.from_numpy(logprobs)).abs().max()))
    print("Tinker sampling on vLLM, logprob gaps against the checkpoint:", gaps)
    assert max(gaps) <= 1e-4
    assert len({tuple(np.frombuffer(q.tokens, dtype=np.int32)) for q in reply.sequences}) > 1  # seeded apart


def test_sigterm_stops_vllm_and_deregisters(live, vllm_server):
    row = InferenceServer.objects.get(url=vllm_server.url)
    os.kill(vllm_server.process.pid, signal.SIGTERM)
    assert vllm_server.process.wait(timeout=120) == 0
    assert not InferenceServer.objects.filter(url=vllm_server.url).exists()
    assert (
        not Path(f"/proc/{row.pid}").exists() or "\nState:\tZ" in Path(f"/proc/{row.pid}/status").read_text()
    )
