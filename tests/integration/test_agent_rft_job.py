"""An Agent RFT job end to end, as a team runs one with the real `openai` client: a supervised job
teaches the tiny model to call the team's `lookup` tool, an Agent RFT job continues that model with
the tool served by this test (`method.reinforcement.tools`, an Authorization header) and an
`endpoint` grader, the events are followed to success, and the fine-tuned model is called through
`/v1/chat/completions`. A real Celery worker trains both jobs (PostgreSQL, Redis, the tiny model),
the Agent RFT job in its http_tools environment with the tool's header decrypted in the worker; an
inference server process serves the result. The client reaches artweb in process (its httpx client
on Django's WSGI handler, as tests/projects/api/test_fine_tuning_api.py does), so the job's URLs are
checked by this process's loopback allow-list; the worker gets the same allow-list.

What it proves: the tool endpoint receives well-formed calls (the tool's name, the episode's
X-Rollout-Id, the call's X-Call-Id, the decrypted Authorization header), each counted in its
trajectory's and its step's `tool_endpoint_calls`; the model reads the tool's reply and the endpoint
grader scores whole transcripts; the job's method echoes the header masked; the fine-tuned model
calls the tool when served and answers from its result.

Why a supervised job first: the random-init tiny model almost never writes a well-formed
`<tool_call>` by itself. Forty full-batch steps on four rows whose assistant calls the tool (and then
answers from its result) teach it the format, as a team would before Agent RFT on a small model; the
Agent RFT job then continues the supervised job's `fine_tuned_model` (a job's `model` may name a
fine-tuned checkpoint, as OpenAI's API allows). The tiny model here has its output layer scaled
(`tiny_model_dir` below): jobs train a LoRA, and with the shared tiny model's output layer no LoRA
gets sure enough of each token for a 30-token call sampled at temperature 1 to come out whole. The
tool takes no arguments (the endpoint reads the sku from the task row's `item`, which every call
carries) so that the call, 30 tokens with its closing tag, fits a reinforcement job's 32-token
turn. The tool path's edge cases (retries, timeouts, the budget) are
tests/training/environments/test_env_http_tools.py's."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from django.core.handlers.wsgi import WSGIHandler
from openai import OpenAI

from projects import services
from projects.models import Run, StepMetrics
from tests.integration.test_fine_tuning_jobs import follow
from tests.projects.gateway.conftest import (  # noqa: F401  (fixtures)
    BASE_MODEL,
    SERVER_TOKEN,
    inference_server,
    register_base_model,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

SECRET = "Bearer tool-s3cret"
SKUS = "abcd"
LOOKUP = {"name": "lookup", "description": "Stock of the item asked about.",
          "parameters": {"type": "object", "properties": {}}}  # fmt: skip
TOOLS = [{"type": "function", "function": LOOKUP}]


def question(sku: str) -> dict:
    return {"role": "user", "content": f"How many {sku} are in stock?"}


def stock(sku: str) -> dict:
    return {"sku": sku, "stock": 3}  # what the tool endpoint answers


CALL = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
SUPERVISED_ROWS = [
    {"messages": [question(sku), {"role": "assistant", "content": None, "tool_calls": [CALL]},
                  {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(stock(sku))},
                  {"role": "assistant", "content": "There are 3 in stock."}],
     "tools": TOOLS, "parallel_tool_calls": False}
    for sku in SKUS
]  # fmt: skip
AGENT_ROWS = [{"messages": [question(sku)], "sku": sku} for sku in SKUS]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tests' tiny model with its output layer's weights multiplied by 8 (also the inference
    server's base model). A job trains a LoRA over frozen weights, and behind the shared tiny
    model's frozen RMS norm and small random output layer a LoRA's best next-token probability
    stays near one half (its supervised loss stayed above 0.7 a token at every rate tried): a
    30-token call sampled at temperature 1 never comes out whole. Scaled, the forty supervised
    steps get the loss under 0.001, and about nine sampled calls in ten are well formed (30 of 33
    rollouts when this was written)."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.base_models import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _close_gateway_connections():
    yield
    from projects.gateway.db import close_db_thread_connections

    close_db_thread_connections()  # the chat completions ran on the gateway's database threads


class Endpoints:
    """The team's two services on 127.0.0.1: `/tool` (the lookup tool) and `/grade` (the grader)."""

    def __init__(self) -> None:
        self.tool_calls: list[dict] = []
        self.gradings: list[dict] = []
        endpoints = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tool":
                    endpoints.tool_calls.append({"headers": dict(self.headers), "body": body})
                    answer = {"output": stock(body["item"].get("sku"))}
                else:
                    endpoints.gradings.append(body)
                    answer = {"reward": 1.0 if "3" in body["sample"]["output_text"] else 0.0}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            request_queue_size = 128
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def upload(client: OpenAI, rows: list[dict]) -> str:
    body = "\n".join(json.dumps(row) for row in rows).encode()
    return client.files.create(file=("rows.jsonl", io.BytesIO(body)), purpose="fine-tune").id


def test_an_agent_rft_job_calls_the_teams_tool_endpoint_and_serves_a_model_that_uses_it(
    serving,  # noqa: F811  (the fixtures imported above)
    inference_server,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
    settings,
):
    # One host: this process (the API, the gateway to the inference server), the worker and the
    # inference server share the checkpoints; a job that continues a checkpoint copies its files.
    settings.INFERENCE_SERVER_TOKEN = SERVER_TOKEN
    settings.CHECKPOINT_DIR = serving.checkpoint_dir
    endpoints = Endpoints()
    register_base_model(tiny_model_dir)
    # The worker decrypts the tool's header (this process's key) and writes the shared checkpoints.
    worker = start_worker(SECRET_KEY=settings.SECRET_KEY, ARTWEB_DATA_DIR=str(serving.data_dir))
    key = services.api_key_create(team=cast.alpha, name="ci").plaintext
    client = OpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0,
                    http_client=httpx.Client(transport=httpx.WSGITransport(app=WSGIHandler())))  # fmt: skip

    taught = client.fine_tuning.jobs.create(
        model=BASE_MODEL, training_file=upload(client, SUPERVISED_ROWS), seed=0,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 40, "batch_size": len(SUPERVISED_ROWS), "learning_rate_multiplier": 10}}},
    )  # fmt: skip
    taught, events = follow(client, taught.id, worker)
    assert taught.status == "succeeded" and taught.fine_tuned_model, (taught.error, events[-5:])

    tool = {**TOOLS[0], "server_url": f"{endpoints.url}/tool", "headers": {"Authorization": SECRET}}
    grader = {"type": "endpoint", "name": "stock", "url": f"{endpoints.url}/grade", "timeout_s": 10}
    job = client.fine_tuning.jobs.create(
        model=taught.fine_tuned_model, training_file=upload(client, AGENT_ROWS), seed=0,
        method={"type": "reinforcement", "reinforcement": {
            "grader": grader, "tools": [tool], "max_episode_steps": 3, "max_tool_calls": 500,
            "hyperparameters": {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.5}}},
    )  # fmt: skip
    assert "s3cret" not in json.dumps(job.to_dict(warnings=False))
    assert job.to_dict(warnings=False)["method"]["reinforcement"]["tools"][0]["headers"] == {
        "Authorization": "********"
    }
    job, events = follow(client, job.id, worker)
    assert job.status == "succeeded", (job.error, [e.message for e in events][-5:], worker.output()[-4000:])
    assert job.model == taught.fine_tuned_model
    assert [e.data["step"] for e in events if e.type == "metrics"] == [1, 2]

    run = Run.objects.select_related("environment").get(pk=job.run_id)
    assert run.environment.kind == "http_tools" and run.environment.max_turns == 3
    assert run.forked_from is not None and run.forked_from.model.name in taught.fine_tuned_model
    trajectories = list(run.trajectories.all())
    assert trajectories and len(endpoints.gradings) >= len(trajectories)  # the endpoint graded every rollout
    rollout_ids = {t.metrics["outcome"]["rollout_id"] for t in trajectories}
    assert len(rollout_ids) == len(trajectories)  # one per rollout
    # The model called the tool: each well-formed call it wrote reached the endpoint, tagged with
    # its rollout and call ids, with the header decrypted in the worker.
    sent = sum(int(t.metrics["tool_endpoint_calls"]) for t in trajectories)
    assert sent > 0 and len(endpoints.tool_calls) == sent
    for call in endpoints.tool_calls:
        headers, body = call["headers"], call["body"]
        assert body["name"] == "lookup" and body["arguments"] == {} and body["item"]["sku"] in SKUS
        assert headers["Authorization"] == SECRET
        assert headers["X-Rollout-Id"] == body["rollout_id"] and headers["X-Rollout-Id"] in rollout_ids
        assert headers["X-Call-Id"] == body["call_id"] and headers["X-Call-Id"].startswith("call_")
    requests = [r for t in trajectories for r in t.metrics["outcome"]["tool_requests"]]
    assert len(requests) == sent and all(r["status"] == "ok" for r in requests)
    steps = StepMetrics.objects.filter(run=run).order_by("step")
    assert [s.step for s in steps] == [1, 2]
    assert sum(s.metrics["tool_endpoint_calls"] for s in steps) == sent
    # The model read the tool's reply, and the grader saw it in the transcript.
    assert any(
        message["role"] == "tool" and json.loads(message["content"]) == stock(grading["item"]["sku"])
        for grading in endpoints.gradings
        for message in grading["sample"]["messages"]
    )

    # The fine-tuned model, served at once under the job's name: it calls the tool, then answers.
    asked = [question("b")]
    reply = client.chat.completions.create(
        model=job.fine_tuned_model, messages=asked, tools=TOOLS, temperature=0, max_tokens=32
    )
    assert reply.model == job.fine_tuned_model
    (call,) = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "lookup"
    answered = client.chat.completions.create(
        model=job.fine_tuned_model, tools=TOOLS, temperature=0, max_tokens=32,
        messages=[*asked, reply.choices[0].message.to_dict(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps(stock("b"))}],
    )  # fmt: skip
    assert "3" in (answered.choices[0].message.content or ""), answered
