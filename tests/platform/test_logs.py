"""Structured logs (artweb.logs): one JSON object per line with the ids of what the line is about;
the request id in the header, in error bodies and on the request's log lines."""

from __future__ import annotations

import io
import json
import logging
import threading
from unittest import mock

import pytest

from artweb.logs import ContextFilter, JsonFormatter, TextFormatter, logging_config
from projects.logs import log_context


def _capture(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"test.logs.{id(stream)}")
    logger.handlers, logger.propagate, logger.level = [handler], False, logging.DEBUG
    return logger, stream


def test_json_lines_carry_the_bound_ids_and_tracebacks():
    logger, stream = _capture(JsonFormatter())
    logger.info("outside")
    with log_context(run_id=3):
        logger.warning("step %d slow", 7)
        with log_context(request_id="req_abc", evaluation_id=None):  # None binds nothing
            try:
                raise ValueError("bad grader")
            except ValueError:
                logger.exception("grading failed")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["outside", "step 7 slow", "grading failed"]
    assert "run_id" not in lines[0]
    assert lines[1]["run_id"] == 3 and lines[1]["level"] == "warning" and lines[1]["ts"].endswith("+00:00")
    assert lines[2]["run_id"] == 3 and lines[2]["request_id"] == "req_abc" and "evaluation_id" not in lines[2]
    assert "ValueError: bad grader" in lines[2]["exc_info"]


def test_threads_do_not_see_each_others_ids():
    logger, stream = _capture(JsonFormatter())
    barrier = threading.Barrier(2)

    def work(run_id: int) -> None:
        with log_context(run_id=run_id):
            barrier.wait()  # both bound at once
            logger.info("working")

    threads = [threading.Thread(target=work, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(json.loads(line)["run_id"] for line in stream.getvalue().splitlines()) == [1, 2]


def test_text_lines_append_the_ids_and_keep_the_traceback_below():
    logger, stream = _capture(TextFormatter())
    with log_context(run_id=5, training_job_id=9):
        try:
            raise RuntimeError("x")
        except RuntimeError:
            logger.exception("failed")
    first, *rest = stream.getvalue().splitlines()
    assert first.endswith("failed [run_id=5 training_job_id=9]")
    assert any("RuntimeError: x" in line for line in rest)


def test_an_unknown_log_format_is_refused_at_start():
    with pytest.raises(ValueError, match="LOG_FORMAT must be text or json"):
        logging_config(log_format="xml", level="INFO")


@pytest.mark.django_db
def test_a_failing_request_logs_with_its_id_and_the_error_body_names_it(cast, alpha_setup):
    from rest_framework.test import APIClient

    from projects.api import views

    logger, stream = _capture(JsonFormatter())
    errors = logging.getLogger("artweb.errors")
    client = APIClient()
    client.force_login(cast.alice)
    with (
        mock.patch.object(errors, "handlers", logger.handlers),
        mock.patch.object(errors, "propagate", False),
        mock.patch.object(
            views.RunViewSet, "filter_by_project", side_effect=RuntimeError("database on fire")
        ),
    ):
        client.raise_request_exception = False
        response = client.get("/api/v1/runs/")
    assert response.status_code == 500
    request_id = response["X-Request-Id"]
    assert response.json()["error"]["request_id"] == request_id
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert line["request_id"] == request_id and "database on fire" in line["exc_info"]
    # A plain 4xx error object names the id too, and its Content-Length is the new body's (a
    # stale one makes servers cut the connection: clients then read nothing at all).
    missing = client.get("/api/v1/runs/999999/")
    assert missing.status_code == 404 and missing.json()["error"]["request_id"] == missing["X-Request-Id"]
    assert int(missing["Content-Length"]) == len(missing.content)
    refused = APIClient().get("/api/v1/projects/", HTTP_AUTHORIZATION="Bearer aw_wrong")
    assert refused.status_code == 401 and int(refused["Content-Length"]) == len(refused.content)
