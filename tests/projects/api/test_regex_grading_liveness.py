"""A catastrophic regex graded through the web API stalls nothing (issue 51, finding 8): a real
uvicorn process grades `^(a|a)+$` on 40 a's and a b (exponential in Python's `re`, which holds the
GIL: the process, /healthz included, froze) while this test polls /healthz from another thread."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from tests.processes import start_web

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.integration]

TIMEOUT_S = 2.0  # GRADER_REGEX_TIMEOUT_S of the server: the window in which /healthz is polled
CATASTROPHIC = {"type": "regex", "pattern": "^(a|a)+$"}  # exponential in `re` and in `regex` alike


@pytest.fixture
def server(tmp_path):
    process = start_web(tmp_path, GRADER_REGEX_TIMEOUT_S=str(TIMEOUT_S))
    yield process
    process.kill()  # a stalled grading request must not hold the teardown


def grade(url: str, key: str, grader: dict, sample: str) -> dict:
    request = urllib.request.Request(
        f"{url}/api/v1/graders/run",
        data=json.dumps({"grader": grader, "model_sample": sample}).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def healthz_seconds(url: str) -> float:
    """Seconds /healthz took to answer (at most 5: a frozen process counts as that slow)."""
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as response:
            assert response.status == 200
    except TimeoutError:
        pass
    return time.perf_counter() - started


def test_healthz_keeps_answering_while_a_catastrophic_pattern_is_graded(server, alpha_key):
    # Warm up: the first grading request imports the graders; the first /healthz sets up Django.
    assert grade(server.url, alpha_key, {"type": "regex", "pattern": "b$"}, "ab")["reward"] == 1.0
    healthz_seconds(server.url)

    answer: dict = {}

    def catastrophic() -> None:
        started = time.perf_counter()
        answer["body"] = grade(server.url, alpha_key, CATASTROPHIC, "a" * 40 + "b")
        answer["seconds"] = time.perf_counter() - started

    grading = threading.Thread(target=catastrophic, daemon=True)
    grading.start()
    time.sleep(0.2)  # the request is in the view, matching
    latencies = []
    deadline = time.monotonic() + TIMEOUT_S + 3
    while grading.is_alive() and time.monotonic() < deadline:
        latencies.append(healthz_seconds(server.url))
        time.sleep(0.02)
    grading.join(timeout=10)

    # With `re` the match never ends and holds the GIL: every poll waits its whole 5 s (a match that
    # held the GIL until the timeout would hold a poll about TIMEOUT_S). Answering, a poll takes tens
    # of ms; on a machine busy with other tests one took 198 ms (CI, 2026-12-07), so the bound on the
    # slowest poll is half the timeout, and the typical poll must stay fast.
    slowest, typical = max(latencies), sorted(latencies)[len(latencies) // 2]
    assert slowest < TIMEOUT_S / 2 and typical < 0.1, (
        f"/healthz took {slowest * 1000:.0f} ms at most, {typical * 1000:.0f} ms typically: {sorted(latencies)[-5:]}"
    )
    assert len(latencies) >= 10, f"grading ended too soon to observe: {answer}"
    body = answer["body"]
    assert body["reward"] == 0.0
    assert [error["code"] for error in body["metadata"]["error_details"]] == ["regex_timeout"]
    assert body["metadata"]["errors"]["unresponsive_reward_error"] is True
    # The timeout counts the server's CPU seconds: its wall time stretches on a crowded machine.
    assert answer["seconds"] < 3 * TIMEOUT_S + 2
