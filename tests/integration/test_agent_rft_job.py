"""An Agent RFT job end to end: the real `openai` client creates a reinforcement job whose method
names a tool endpoint (`method.reinforcement.tools`, an Authorization header) and an `endpoint`
grader, both served by this test on loopback; a real Celery worker trains it (PostgreSQL, Redis,
the tiny model) in the job's http_tools environment, with the tool's header decrypted in the worker,
and the endpoint grader scores every rollout. The client reaches artweb in process (its httpx client
on Django's WSGI handler, as tests/projects/api/test_fine_tuning_api.py does), so the job's URLs are
checked by this process's loopback allow-list; the worker gets the same allow-list.

What it cannot show: the tiny random-init model almost never writes a well-formed `<tool_call>`, so
the tool endpoint may see no call here. The tool path (a POST per call, rollout and call ids,
retries, timeouts, the budget) is tests/training/environments/test_env_http_tools.py's, over real
HTTP; this test shows the job's wiring: environment kind, tools shown to the model, decrypted
headers reaching the worker, endpoint grading, per-step tool metrics, the masked echo."""

from __future__ import annotations

import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler
from openai import OpenAI

from projects import services
from projects.models import Run, StepMetrics

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

SECRET = "Bearer tool-s3cret"
ROWS = [{"messages": [{"role": "user", "content": f"How many {w} are in stock?"}], "sku": w} for w in "abcd"]


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
                    answer = {"output": {"sku": body["item"].get("sku"), "stock": 3}}
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


def test_an_agent_rft_job_trains_with_the_teams_tool_endpoint_and_endpoint_grader(
    start_worker, tiny_model_dir, cast
):
    endpoints = Endpoints()
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    worker = start_worker(SECRET_KEY=settings.SECRET_KEY)  # the worker decrypts the tool's header
    key = services.api_key_create(team=cast.alpha, name="ci").plaintext
    client = OpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0,
                    http_client=httpx.Client(transport=httpx.WSGITransport(app=WSGIHandler())))  # fmt: skip
    body = "\n".join(json.dumps(row) for row in ROWS).encode()
    training_file = client.files.create(file=("rows.jsonl", io.BytesIO(body)), purpose="fine-tune").id
    tool = {
        "type": "function",
        "function": {"name": "lookup", "description": "Stock of an item by its sku.",
                     "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}}},
        "server_url": f"{endpoints.url}/tool",
        "headers": {"Authorization": SECRET},
    }  # fmt: skip
    grader = {"type": "endpoint", "name": "stock", "url": f"{endpoints.url}/grade", "timeout_s": 10}
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=training_file,
        method={"type": "reinforcement", "reinforcement": {
            "grader": grader, "tools": [tool], "max_episode_steps": 3, "max_tool_calls": 500,
            "hyperparameters": {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.5}}},
    )  # fmt: skip
    assert "s3cret" not in json.dumps(job.to_dict(warnings=False))
    assert job.to_dict(warnings=False)["method"]["reinforcement"]["tools"][0]["headers"] == {
        "Authorization": "********"
    }
    deadline = time.monotonic() + 600
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        if time.monotonic() > deadline:
            pytest.fail(f"job still {job.status}:\n{worker.output()[-4000:]}")
        time.sleep(1)
    assert job.status == "succeeded", (job.error, worker.output()[-4000:])
    run = Run.objects.select_related("environment").get(pk=job.run_id)
    assert run.environment.kind == "http_tools" and run.environment.max_turns == 3
    trajectories = list(run.trajectories.all())
    assert trajectories and len(endpoints.gradings) >= len(trajectories)  # the endpoint graded every rollout
    # Every rollout ran in the http_tools environment: its own rollout id, its calls' records.
    rollout_ids = {t.metrics["outcome"]["rollout_id"] for t in trajectories}
    assert len(rollout_ids) == len(trajectories)
    assert all("tool_endpoint_calls" in t.metrics for t in trajectories)
    # The tool was shown to the model (the tiny model's template has no tool support: in its prompt).
    assert any("lookup" in json.dumps(grading["sample"]["messages"]) for grading in endpoints.gradings)
    steps = StepMetrics.objects.filter(run=run).order_by("step")
    assert [s.step for s in steps] == [1, 2] and all("tool_endpoint_calls" in s.metrics for s in steps)
    sent = sum(int(t.metrics["tool_endpoint_calls"]) for t in trajectories)
    assert len(endpoints.tool_calls) == sent  # whatever the model called reached the endpoint
    for call in endpoints.tool_calls:  # decrypted in the worker, tagged with the rollout and call ids
        assert call["headers"]["Authorization"] == SECRET
        assert call["headers"]["X-Rollout-Id"] in rollout_ids and call["headers"]["X-Call-Id"].startswith(
            "call_"
        )
