"""The standard `openai` client against the gateway (uvicorn + Django ASGI) and real inference
server processes on the tiny model, on PostgreSQL. Nothing is restarted between a checkpoint
being recorded and it being served."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import warnings
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from projects import services
from projects.models import BaseModel, InferenceServer
from tests.projects.gateway.conftest import (
    BASE_MODEL,
    SERVER_TOKEN,
    Process,
    http,
    register_base_model,
    server_stats,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def server_is_live(server: Process) -> bool:
    return InferenceServer.objects.filter(url=server.url).exists()


@pytest.fixture
def live(tiny_model_dir, inference_server, gateway) -> Process:
    """The module's server, registered again in this test's (freshly flushed) database."""
    register_base_model(tiny_model_dir)
    wait_for(lambda: server_is_live(inference_server), timeout=10, what="the inference server's heartbeat")
    return gateway


def client(gateway: Process, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def async_client(gateway: Process, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def trainable_model(team, project_name: str, model_name: str):
    base = BaseModel.objects.get(name=BASE_MODEL)
    project = services.project_create(team=team, name=project_name)
    return services.trainable_model_create(project=project, name=model_name, base_model=base)


def save_checkpoint(serving, tiny_model_dir: Path, model, step: int):
    """What a run does at the end of a step: write the adapter files, then record the row."""
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.session.policy import Policy

    base, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    trainer = Policy(base, tokenizer, TrainConfig(), LoraSpec())
    path = serving.checkpoint_dir / f"model-{model.pk}" / f"step-{step}"
    trainer.save_checkpoint(path, step=step, metrics={})
    return services.checkpoint_record(model=model, run=None, step=step, path=str(path))


def test_the_openai_client_sync_async_streaming_n_and_logprobs(live, alpha_key):
    api = client(live, alpha_key)
    assert BASE_MODEL in [model.id for model in api.models.list()]

    reply = api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=6, temperature=0)
    assert reply.object == "chat.completion" and reply.model == BASE_MODEL
    assert reply.choices[0].message.role == "assistant"
    assert 1 <= reply.usage.completion_tokens <= 6 and reply.usage.prompt_tokens > 5

    many = api.chat.completions.create(
        model=BASE_MODEL, messages=HELLO, max_tokens=5, n=3, logprobs=True, top_logprobs=2, seed=1,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert [c.index for c in many.choices] == [0, 1, 2]
    for choice in many.choices:
        token_ids = choice.model_extra["token_ids"]
        assert len(choice.logprobs.content) == len(token_ids) >= 1
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)
        for entry in choice.logprobs.content:  # real alternatives, most likely first
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
    assert many.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in many.choices)
    assert len(many.model_extra["prompt_token_ids"]) == many.usage.prompt_tokens

    whole = api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=8, seed=7)
    stream = api.chat.completions.create(
        model=BASE_MODEL,
        messages=HELLO,
        max_tokens=8,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # same seed, same tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    async def together():
        api = async_client(live, alpha_key)
        return await asyncio.gather(
            *(api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=3) for _ in range(3))
        )

    assert all(r.choices[0].message.role == "assistant" for r in asyncio.run(together()))


def test_tokens_are_streamed_as_they_are_sampled_and_join_to_the_unstreamed_text(live, alpha_key):
    api = client(live, alpha_key)
    params = {"model": BASE_MODEL, "messages": HELLO, "max_tokens": 48, "seed": 11, "logprobs": True,
              "top_logprobs": 3}  # fmt: skip
    whole = api.chat.completions.create(**params)
    assert whole.choices[0].finish_reason == "length"  # this seed samples all 48 tokens

    arrivals: list[tuple[float, str]] = []  # (seconds since the request, content delta)
    streamed_logprobs = []
    finish = None
    # The arrival times show the server's and the gateway's behaviour only if this process does
    # not stall: with garbage collection on, this large (torch is loaded), CPU-starved test
    # process sometimes paused for 1-3 s and then read every chunk at once (about half the runs
    # on a loaded machine; none of 5 with collection paused, while the gateway's own log showed
    # the chunks relayed as they came).
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        for chunk in api.chat.completions.create(**params, stream=True):
            now = time.perf_counter() - started
            for choice in chunk.choices:
                if choice.delta.content:
                    arrivals.append((now, choice.delta.content))
                if choice.logprobs:
                    streamed_logprobs += choice.logprobs.content
                finish = choice.finish_reason or finish
        completed = time.perf_counter() - started
    finally:
        gc.enable()

    assert "".join(text for _, text in arrivals) == whole.choices[0].message.content  # same seed
    assert finish == "length"
    assert [e.model_dump() for e in streamed_logprobs] == [
        e.model_dump() for e in whole.choices[0].logprobs.content
    ]
    times = [at for at, _ in arrivals]
    assert len(times) >= 10 and times == sorted(times)
    # Token by token, not all at the end: the content chunks spread over the generation (48
    # tokens of the tiny model take ~10-20 ms with the decode core) instead of arriving together
    # in one read, as they would if anything buffered the stream; the first comes before the
    # response completes. (Measured between content chunks: on a loaded machine the request may
    # wait before sampling starts.)
    first, last = times[0], times[-1]
    assert first < completed and last - first > 0.005, (times, completed)
    assert len({round(at, 3) for at in times}) >= 5, times


def test_a_stream_is_relayed_as_it_is_written_not_buffered(live, alpha_key):
    # The server sends each choice's role chunk as soon as it accepts the request, long before
    # 16 completions of 200 tokens are sampled; the gateway must pass it on at once.
    api = client(live, alpha_key)
    started = time.perf_counter()
    stream = api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=200, n=16, stream=True)
    first_chunk_at = None
    for _ in stream:
        if first_chunk_at is None:
            first_chunk_at = time.perf_counter() - started
    total = time.perf_counter() - started
    assert first_chunk_at < total / 3, (first_chunk_at, total)

    # On the wire: OpenAI's events and the end marker, without the server's usage comment.
    import http.client

    host, port = live.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": BASE_MODEL, "messages": HELLO, "max_tokens": 3, "stream": True}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                       headers={"Authorization": f"Bearer {alpha_key}", "Content-Type": "application/json"})  # fmt: skip
    response = connection.getresponse()
    raw = response.read().decode()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    assert raw.endswith("data: [DONE]\n\n") and ": usage" not in raw


def test_a_checkpoint_saved_by_a_run_is_callable_as_latest_at_once(live, serving, inference_server,
                                                                    tiny_model_dir, cast, alpha_key):  # fmt: skip
    model = trainable_model(cast.alpha, "math", "agent")
    api = client(live, alpha_key)
    with pytest.raises(openai.NotFoundError):  # no checkpoint yet
        api.chat.completions.create(model="math/agent:latest", messages=HELLO, max_tokens=2)
    first = save_checkpoint(serving, tiny_model_dir, model, step=1)
    reply = api.chat.completions.create(model="math/agent:latest", messages=HELLO, max_tokens=2)
    assert reply.model == "math/agent:1"
    save_checkpoint(serving, tiny_model_dir, model, step=2)
    # The gateway remembers a route for GATEWAY_LOOKUP_CACHE_S (1 s): the new step is served
    # as :latest within that, without restarting anything.
    wait_for(
        lambda: api.chat.completions.create(model="math/agent:latest", messages=HELLO, max_tokens=2).model
        == "math/agent:2",
        timeout=5, what="step 2 to become :latest",
    )  # fmt: skip
    assert (
        api.chat.completions.create(model="math/agent:1", messages=HELLO, max_tokens=2).model
        == "math/agent:1"
    )
    ids = {m.id for m in api.models.list()}
    assert {"math/agent:1", "math/agent:2", "math/agent:latest"} <= ids
    assert api.models.retrieve("math/agent:latest").id == "math/agent:2"
    loaded = server_stats(inference_server)["adapters"]["loaded"]
    assert str(Path(first.path).resolve()) in loaded


@pytest.fixture(scope="module")
def tool_adapter(serving, tiny_model_dir) -> Path:
    """A LoRA checkpoint that makes the tiny model answer WEATHER_QUESTION with WEATHER_CALL:
    memorised in a few hundred steps, so the server's tool-call parsing meets real model output."""
    import torch
    from peft import LoraConfig, get_peft_model

    from training.base_models import load_base_model
    from training.rollouts.agent import template_supports_tools
    from training.serving.prompts import render_prompt
    from training.serving.protocol import Limits, parse_chat_request

    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    request = parse_chat_request({"model": "m", "messages": WEATHER_QUESTION, "tools": [WEATHER]}, Limits())
    prompt = render_prompt(tokenizer, request, native_tools=template_supports_tools(tokenizer))
    target = list(tokenizer(WEATHER_CALL, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: more threads only contend (20 ms a step vs 400)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            with warnings.catch_warnings():  # peft reads a deprecated transformers attribute
                warnings.filterwarnings(
                    "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
                )
                peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=modules))
            optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=3e-3)
            margin = 30  # steps trained on after the first exact match, so KV-cached decoding agrees
            for _ in range(600):
                output = peft_model(input_ids=ids, labels=labels)
                # Memorised once every target token is the most likely one: greedy decoding
                # (temperature 0) then writes exactly WEATHER_CALL.
                predicted = output.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
                if predicted == target:
                    margin -= 1
                    if margin == 0:
                        break
                output.loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    assert predicted == target, "the tool call was not memorised in 600 steps"
    path = serving.checkpoint_dir / "memorised-tool-call" / "step-1"
    peft_model.save_pretrained(str(path))
    return path


def test_tool_calls_come_back_as_openai_tool_calls_and_tool_results_go_in(live, tool_adapter, tiny_model_dir, cast,
                                                                           alpha_key):  # fmt: skip
    model = trainable_model(cast.alpha, "tools", "agent")
    services.checkpoint_record(model=model, run=None, step=1, path=str(tool_adapter))
    api = client(live, alpha_key)
    reply = api.chat.completions.create(
        model="tools/agent:latest", messages=WEATHER_QUESTION, tools=[WEATHER], temperature=0, max_tokens=40
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # The tool result goes back in `messages` and is rendered with the chat template.
    follow_up = api.chat.completions.create(
        model="tools/agent:latest", tools=[WEATHER], temperature=0, max_tokens=5,
        messages=[*WEATHER_QUESTION, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}],
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert follow_up.usage.prompt_tokens > reply.usage.prompt_tokens
    from training.base_models import load_base_model

    _, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    prompt_text = tokenizer.decode(follow_up.model_extra["prompt_token_ids"])
    assert '{"temperature_c": 21}' in prompt_text and "<tool_call>" in prompt_text

    stream = api.chat.completions.create(
        model="tools/agent:latest", messages=WEATHER_QUESTION, tools=[WEATHER], temperature=0, max_tokens=40,
        stream=True,
    )  # fmt: skip
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed_calls = [call for d in deltas for call in (d.delta.tool_calls or [])]
    assert [c.function.name for c in streamed_calls] == ["get_weather"]
    assert deltas[-1].finish_reason == "tool_calls"


def test_another_teams_key_gets_404_and_errors_are_openai_error_objects(live, serving, tiny_model_dir, cast,
                                                                         alpha_key):  # fmt: skip
    model = trainable_model(cast.alpha, "math", "agent")
    save_checkpoint(serving, tiny_model_dir, model, step=1)
    beta_key = services.api_key_create(team=cast.beta, name="beta").plaintext
    url = f"{live.url}/v1/chat/completions"
    body = {"model": "math/agent:latest", "messages": HELLO, "max_tokens": 2}

    status, _, error = http("POST", url, key=beta_key, body=body)
    assert status == 404
    assert set(error["error"]) == {"message", "type", "param", "code", "request_id"}
    assert error["error"]["code"] == "model_not_found"
    assert "math/agent:latest" not in {
        m["id"] for m in http("GET", f"{live.url}/v1/models", key=beta_key)[2]["data"]
    }
    assert http("POST", url, key=alpha_key, body=body)[0] == 200  # the owner's key works

    status, _, error = http("POST", url, key=alpha_key, body={**body, "model": "math/nothing:3"})
    assert (status, error["error"]["code"]) == (404, "model_not_found")
    status, _, error = http("POST", url, key=alpha_key, body={**body, "temperature": 3})
    assert (status, error["error"]["param"], error["error"]["type"]) == (
        400,
        "temperature",
        "invalid_request_error",
    )
    status, _, error = http("POST", url, key="aw_nope_nope", body=body)
    assert (status, error["error"]["code"]) == (401, "invalid_api_key")
    with pytest.raises(openai.BadRequestError):
        client(live, alpha_key).chat.completions.create(model=BASE_MODEL, messages=HELLO, n=0)


def test_concurrent_requests_are_batched_by_the_server(live, inference_server, alpha_key):
    before = server_stats(inference_server)

    async def burst():
        api = async_client(live, alpha_key)
        return await asyncio.gather(
            *(api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=16) for _ in range(8))
        )

    assert len(asyncio.run(burst())) == 8
    after = server_stats(inference_server)
    assert after["requests"] - before["requests"] == 8
    batches = after["batches"] - before["batches"]
    new = after["recent_batches"][-batches:]
    assert batches < 8 and max(batch["requests"] for batch in new) >= 2, new


def test_usage_is_metered_per_key_and_model(live, alpha_key, cast):
    api = client(live, alpha_key)
    replies = [api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=n) for n in (2, 3)]
    stream = api.chat.completions.create(
        model=BASE_MODEL, messages=HELLO, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    streamed = [chunk for chunk in stream][-1].usage
    prompt = sum(r.usage.prompt_tokens for r in replies) + streamed.prompt_tokens
    completion = sum(r.usage.completion_tokens for r in replies) + streamed.completion_tokens

    def totals():
        body = http("GET", f"{live.url}/api/v1/usage?group_by=model", key=alpha_key)[2]
        return body if body["totals"]["requests"] == 3 else None

    body = wait_for(totals, timeout=10, what="usage records")  # written just after each response
    assert body["data"] == [{"model": BASE_MODEL, "requests": 3, "prompt_tokens": prompt,
                             "completion_tokens": completion, "total_tokens": prompt + completion}]  # fmt: skip
    beta_key = services.api_key_create(team=cast.beta, name="beta").plaintext
    assert http("GET", f"{live.url}/api/v1/usage", key=beta_key)[2]["totals"]["requests"] == 0


def test_a_key_over_its_rate_limit_gets_429_with_retry_after(live, serving, alpha_key):
    limited = serving.start_gateway(GATEWAY_RATE_LIMIT_PER_MINUTE="3")
    try:
        if time.time() % 60 > 50:  # keep the four requests inside one fixed window
            time.sleep(61 - time.time() % 60)
        body = {"model": BASE_MODEL, "messages": HELLO, "max_tokens": 1}
        url = f"{limited.url}/v1/chat/completions"
        assert [http("POST", url, key=alpha_key, body=body)[0] for _ in range(3)] == [200, 200, 200]
        status, headers, error = http("POST", url, key=alpha_key, body=body)
        assert (status, error["error"]["code"]) == (429, "rate_limit_exceeded")
        assert 1 <= int(headers["Retry-After"]) <= 60
    finally:
        limited.stop()


def test_a_killed_server_stops_being_routed_to_and_a_new_one_is_picked_up(
    live, serving, tiny_model_dir, alpha_key
):
    other = "gateway-tiny-b"  # a base model only these servers serve
    register_base_model(tiny_model_dir, name=other)
    body = {"model": other, "messages": HELLO, "max_tokens": 2}
    url = f"{live.url}/v1/chat/completions"
    first = serving.start_inference_server(other)
    wait_for(lambda: server_is_live(first), timeout=10, what="the first server's registration")
    assert http("POST", url, key=alpha_key, body=body)[0] == 200

    first.kill()
    status, headers, error = http("POST", url, key=alpha_key, body=body)
    assert (status, error["error"]["code"], headers["Retry-After"]) == (503, "no_server_available", "2")

    second = serving.start_inference_server(other)
    wait_for(lambda: http("POST", url, key=alpha_key, body=body)[0] == 200, timeout=30, what="recovery")
    assert InferenceServer.objects.filter(url=second.url).exists()
    second.stop()  # a clean stop deregisters at once
    wait_for(
        lambda: not InferenceServer.objects.filter(url=second.url).exists(), timeout=10, what="deregistration"
    )
    assert http("POST", url, key=alpha_key, body=body)[0] == 503


def test_two_servers_of_one_base_model_share_the_load_and_a_dead_one_is_routed_around(
    live, serving, tiny_model_dir, alpha_key
):
    """Least outstanding requests first (projects.gateway.balance): a burst reaches both servers;
    a server killed while its heartbeat is still fresh costs no request."""
    shared = "gateway-tiny-c"  # a base model only these servers serve
    register_base_model(tiny_model_dir, name=shared)
    first, second = serving.start_inference_server(shared), serving.start_inference_server(shared)
    for server in (first, second):
        wait_for(lambda server=server: server_is_live(server), timeout=10, what="registration")
    time.sleep(1.5)  # a route remembered without the second server expires (GATEWAY_LOOKUP_CACHE_S)
    before = {server.url: server_stats(server)["requests"] for server in (first, second)}

    async def burst():
        api = async_client(live, alpha_key)
        return await asyncio.gather(
            *(api.chat.completions.create(model=shared, messages=HELLO, max_tokens=8) for _ in range(12))
        )

    assert len(asyncio.run(burst())) == 12
    served = {server.url: server_stats(server)["requests"] - before[server.url] for server in (first, second)}
    assert sum(served.values()) == 12 and min(served.values()) >= 2, served

    first.kill()  # its row stays fresh for INFERENCE_HEARTBEAT_TIMEOUT_S: the gateway must skip it
    body = {"model": shared, "messages": HELLO, "max_tokens": 2}
    statuses = [
        http("POST", f"{live.url}/v1/chat/completions", key=alpha_key, body=body)[0] for _ in range(4)
    ]
    assert statuses == [200] * 4
    second.stop()


def test_a_stream_whose_client_leaves_is_cancelled_at_once(live, inference_server):
    """Continuous batching: a stream whose client goes away is dropped before it is admitted, or
    its rows leave the decode batch before the next token; the long request goes on unharmed."""
    import http.client
    import threading

    host, port = inference_server.url.removeprefix("http://").split(":")
    headers = {"Authorization": f"Bearer {SERVER_TOKEN}", "Content-Type": "application/json"}
    long_status: list[int] = []

    def long_batch():  # keeps the engine decoding for a while
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        body = {"model": BASE_MODEL, "messages": HELLO, "max_tokens": 500, "n": 16, "temperature": 1.0}
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        long_status.append(connection.getresponse().status)

    before = server_stats(inference_server)
    busy = threading.Thread(target=long_batch)
    busy.start()
    wait_for(lambda: server_stats(inference_server)["running_requests"] == 1, timeout=10,
             what="the long batch to start")  # fmt: skip
    leaving = http.client.HTTPConnection(host, int(port), timeout=60)
    # 16 rows of up to 500 tokens: far from done when its client leaves a moment later.
    body = {
        "model": BASE_MODEL,
        "messages": HELLO,
        "max_tokens": 500,
        "n": 16,
        "temperature": 1.0,
        "stream": True,
    }
    leaving.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    response = leaving.getresponse()
    assert response.status == 200 and response.read1(100).startswith(b"data: ")  # the role chunk
    leaving.close()  # the client goes away while its rows decode
    busy.join(timeout=120)

    def idle() -> bool:
        stats = server_stats(inference_server)
        return stats["running_requests"] == stats["queued_requests"] == 0

    wait_for(idle, timeout=20, what="the server to be idle")
    after = server_stats(inference_server)
    assert long_status == [200]
    # Dropped before it was admitted, or admitted and its rows cancelled mid-decode: never sampled
    # to the end. Which of the two depends on whether a decode step ended (admitting it) before
    # its client left; on a loaded machine it often does: the test once asserted the first case
    # only and failed under load (issue 53: `requests` 38 -> 40 is admitted, not finished).
    admitted = after["requests"] - before["requests"] - 1  # the long batch is the other one
    cancelled = after["cancelled"] - before["cancelled"]
    assert (admitted, cancelled) in {(0, 0), (1, 1)}, (admitted, cancelled)


# ---------------------------------------------------------------- stored completions (store: true)


def stored(api: OpenAI, **filters) -> list:
    """Every stored completion the filters match, through the client's own paging."""
    return list(api.chat.completions.list(**filters))


def test_stored_completions_through_the_openai_client(live, alpha_key, cast):
    api = client(live, alpha_key)
    with pytest.raises(openai.BadRequestError) as refused:  # storage is off until an owner turns it on
        api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=4, store=True)
    assert refused.value.body["param"] == "store" and refused.value.body["code"] == "store_not_enabled"
    services.completion_storage_set(team=cast.alpha, storage="requested")

    def create(**kwargs):  # the gateway remembers the key's team for GATEWAY_LOOKUP_CACHE_S
        def attempt():
            try:
                return api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=6, **kwargs)
            except openai.BadRequestError as exc:
                assert exc.body["code"] == "store_not_enabled", exc.body
                return None

        return wait_for(attempt, timeout=15, what="the team's storage setting")

    conversation = {"conversation_id": "c-1", "topic": "greeting"}
    whole = create(temperature=0, store=True, metadata=conversation)
    with pytest.raises(openai.BadRequestError) as bad:  # a stored completion's metadata is OpenAI's shape
        api.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=4, store=True,
                                    metadata={"k": "v" * 513})  # fmt: skip
    assert bad.value.body["param"] == "metadata"
    # The client is answered as it asked: no logprobs or ids, though the server was asked for both.
    assert whole.choices[0].logprobs is None and "token_ids" not in (whole.choices[0].model_extra or {})
    assert "prompt_token_ids" not in (whole.model_extra or {})
    stream = api.chat.completions.create(
        model=BASE_MODEL, messages=HELLO, max_tokens=6, seed=3, stream=True, store=True,
        stream_options={"include_usage": True}, metadata={"conversation_id": "c-1"},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert not any("token_ids" in (c.choices[0].model_extra or {}) for c in chunks if c.choices)
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage)
    create(store=False)  # not stored (requested: only store=True is)
    create()

    rows = wait_for(lambda: len(stored(api)) == 2 and stored(api), timeout=15, what="two stored completions")
    first, second = rows  # oldest first
    assert first.id == whole.id and second.id == chunks[0].id
    assert first.choices[0].message.content == whole.choices[0].message.content
    assert first.metadata == conversation and first.model_extra["served_by"] == BASE_MODEL
    # What training reads: the exact prompt and sampled ids and the sampler's logprobs.
    assert len(first.model_extra["prompt_token_ids"]) == whole.usage.prompt_tokens
    ids, logprobs = (
        first.choices[0].model_extra["token_ids"],
        first.choices[0].model_extra["sampled_logprobs"],
    )
    assert len(ids) == len(logprobs) == whole.usage.completion_tokens and all(lp <= 0 for lp in logprobs)
    assert second.choices[0].message.content == streamed_text
    assert len(second.choices[0].model_extra["token_ids"]) == usage.completion_tokens
    assert len(second.model_extra["prompt_token_ids"]) == usage.prompt_tokens

    # The client's list filters and pages (limit 1: one page per completion), retrieve, messages.
    assert [r.id for r in stored(api, limit=1)] == [first.id, second.id]
    assert [r.id for r in stored(api, order="desc")] == [second.id, first.id]
    assert [r.id for r in stored(api, metadata={"topic": "greeting"})] == [first.id]
    assert [r.id for r in stored(api, model="nope")] == []
    assert api.chat.completions.retrieve(second.id).metadata == {"conversation_id": "c-1"}
    messages = list(api.chat.completions.messages.list(first.id))
    assert [(m.id, m.role, m.content) for m in messages] == [(f"{first.id}-0", "user", HELLO[0]["content"])]

    updated = api.chat.completions.update(second.id, metadata={"conversation_id": "c-2"})
    assert updated.metadata == {"conversation_id": "c-2"}
    assert [r.id for r in stored(api, metadata={"conversation_id": "c-1"})] == [first.id]

    # Another team's key sees none of it; a read-only key reads but cannot delete.
    beta = client(live, services.api_key_create(team=cast.beta, name="b").plaintext)
    assert stored(beta) == []
    with pytest.raises(openai.NotFoundError):
        beta.chat.completions.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        beta.chat.completions.delete(first.id)
    read_only = client(live, services.api_key_create(team=cast.alpha, name="ro", read_only=True).plaintext)
    assert read_only.chat.completions.retrieve(first.id).id == first.id
    with pytest.raises(openai.PermissionDeniedError):
        read_only.chat.completions.delete(first.id)
    deleted = api.chat.completions.delete(first.id)
    assert deleted.deleted and deleted.id == first.id
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.retrieve(first.id)
    assert [r.id for r in stored(api)] == [second.id]


def test_an_alias_canary_splits_conversations_through_the_gateway(
    live, serving, tiny_model_dir, alpha_key, cast
):
    from projects import selectors
    from projects.selectors.serving import resolve_model

    model = trainable_model(cast.alpha, "sup", "agent")
    for step in (1, 2):
        save_checkpoint(serving, tiny_model_dir, model, step)
    alias = services.alias_set(model=model, name="prod", step=1)
    alias = services.alias_canary(alias=alias, step=2, share=0.5)
    services.completion_storage_set(team=cast.alpha, storage="all")
    api = client(live, alpha_key)

    def ask(conversation: str) -> str:
        reply = api.chat.completions.create(model="sup/agent:prod", messages=HELLO, max_tokens=2, temperature=0,
                                            metadata={"conversation_id": conversation})  # fmt: skip
        return reply.model

    served = {f"c-{i}": ask(f"c-{i}") for i in range(24)}
    assert set(served.values()) == {"sup/agent:1", "sup/agent:2"}
    # The gateway splits by the conversation as the selector does, and a conversation stays put.
    assert served == {
        key: resolve_model(team=cast.alpha, model_id="sup/agent:prod", split_key=key).model_id
        for key in served
    }
    assert {ask("c-0") for _ in range(4)} == {served["c-0"]}
    wait_for(lambda: sum(arm["completions"] for arm in selectors.alias_arms(alias=alias)) == 28,
             timeout=15, what="the stored completions of both arms")  # fmt: skip
    arms = {arm["step"]: arm["completions"] for arm in selectors.alias_arms(alias=alias)}
    assert arms == {1: list(served.values()).count("sup/agent:1") + 4 * (served["c-0"] == "sup/agent:1"),
                    2: list(served.values()).count("sup/agent:2") + 4 * (served["c-0"] == "sup/agent:2")}  # fmt: skip
    services.alias_promote(alias=alias)
    assert {ask(f"c-{i}") for i in range(6)} == {"sup/agent:2"}  # aliases are never remembered


def test_a_keys_own_storage_and_a_conversation_joined_through_the_gateway(live, alpha_key, cast):
    """A key set to store everything stores without ``store`` while its team stores nothing; two
    turns of one conversation, the second sending the first's reply back as the openai client
    does, are one conversation whose token view places each turn's sampled ids exactly."""
    from tests.conftest import _client

    created = services.api_key_create(team=cast.alpha, name="prod")
    services.api_key_storage_set(api_key=created.api_key, storage="all")
    prod, other = client(live, created.plaintext), client(live, alpha_key)
    other.chat.completions.create(model=BASE_MODEL, messages=HELLO, max_tokens=2)  # the team's: off
    meta = {"conversation_id": "live-conv"}
    first = prod.chat.completions.create(
        model=BASE_MODEL, messages=HELLO, max_tokens=4, temperature=0, metadata=meta
    )
    follow = [
        *HELLO,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "And?"},
    ]
    second = prod.chat.completions.create(model=BASE_MODEL, messages=follow, max_tokens=4, temperature=0,
                                          metadata=meta)  # fmt: skip
    rows = wait_for(lambda: len(stored(prod)) == 2 and stored(prod), timeout=15, what="the prod key's two")
    assert [r.id for r in rows] == [first.id, second.id]  # the other key's completion is not stored

    view = _client(key=created.plaintext).get("/api/v1/conversations/live-conv").json()
    turns = view["turns"]
    assert [t["id"] for t in turns] == [first.id, second.id]
    ids = [r.choices[0].model_extra["token_ids"] for r in rows]
    prompts = [r.model_extra["prompt_token_ids"] for r in rows]
    # Each turn's sampled ids lie where the view says, right after the prompt it was sampled on.
    assert turns[0] == {
        **turns[0],
        "sample": 0,
        "start": len(prompts[0]),
        "end": len(prompts[0]) + len(ids[0]),
    }
    continues = prompts[1][: len(prompts[0]) + len(ids[0])] == prompts[0] + ids[0]
    expected_start = len(prompts[1])
    assert (turns[1]["sample"], turns[1]["start"], turns[1]["end"]) == (
        0 if continues else 1,
        expected_start,
        expected_start + len(ids[1]),
    )
    assert sum(sample["trained_tokens"] for sample in view["samples"]) == len(ids[0]) + len(ids[1])
