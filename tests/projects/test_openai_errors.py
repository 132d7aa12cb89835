"""One table of OpenAI error types (training.wire.openai_errors) for the REST API, the gateway and the
inference server: every status any of them emits has its row, and all three build the same object."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from rest_framework import exceptions as drf_exceptions

from projects.api.errors import error_response
from projects.errors import Conflict, DomainError, Forbidden, NotFound
from projects.gateway.errors import GatewayError
from projects.gateway.vllm import openai_error
from training.serving.protocol import RequestError
from training.wire.openai_errors import ERROR_KINDS, OTHER_ERROR, error_kind, error_object

ROOT = Path(__file__).resolve().parents[2]
ERROR_BUILDERS = {"GatewayError", "RequestError", "error_response", "error_object"}


def _literal_statuses(folder: Path) -> set[int]:
    """Statuses written as literals where errors are raised or built: ``GatewayError(503, ...)``,
    ``RequestError(..., status=413)``, ``error_response(400, ...)``, and ``status_code = 409`` in
    the domain error classes."""
    found: set[int] = set()
    for path in folder.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            candidates: list[ast.expr] = []
            if isinstance(node, ast.Call) and _name(node.func) in ERROR_BUILDERS:
                candidates = node.args[:1] + [
                    kw.value for kw in node.keywords if kw.arg in ("status", "status_code")
                ]
            elif isinstance(node, ast.Assign) and [_name(target) for target in node.targets] == [
                "status_code"
            ]:
                candidates = [node.value]
            found |= {c.value for c in candidates if isinstance(c, ast.Constant) and isinstance(c.value, int)}
    return found


def _name(node: ast.expr) -> str | None:
    return getattr(node, "id", None) or getattr(node, "attr", None)


def _subclasses(cls: type) -> list[type]:
    return [cls] + [sub for direct in cls.__subclasses__() for sub in _subclasses(direct)]


def emitted_statuses() -> set[int]:
    import projects.gateway.routing  # noqa: F401  (defines ModelNotFound, a DomainError)

    statuses = _literal_statuses(ROOT / "projects") | _literal_statuses(ROOT / "training" / "serving")
    statuses |= {cls.status_code for cls in _subclasses(DomainError)}
    statuses |= {cls.status_code for cls in _subclasses(drf_exceptions.APIException)}  # what DRF raises
    statuses.add(400)  # RequestError's default status
    return statuses


def test_every_status_the_api_gateway_and_server_emit_has_a_row_in_the_one_table():
    statuses = emitted_statuses()
    assert {400, 401, 403, 404, 405, 409, 413, 415, 429, 500, 502, 503, 504} <= statuses  # the scan sees them
    assert sorted(statuses - set(ERROR_KINDS)) == []


@pytest.mark.parametrize("status", sorted(ERROR_KINDS) + [418, 507])
def test_api_gateway_and_inference_server_build_the_same_error_object(status):
    expected = {"message": "Nope.", "type": error_kind(status).type, "param": "model", "code": "some_code"}
    api = error_response(status, "Nope.", code="some_code", param="model").data["error"]
    gateway = json.loads(GatewayError(status, "Nope.", code="some_code", param="model").response().content)
    server = RequestError("Nope.", code="some_code", param="model", status=status).body()
    vllm = openai_error(
        status, json.dumps({"error": {"message": "Nope.", "code": "some_code", "param": "model"}}).encode()
    )
    assert api == gateway["error"] == server["error"] == vllm["error"] == expected


def test_the_statuses_that_drifted_apart_read_the_same_everywhere():
    # The gateway's and the server's copy of the table once lacked 409 and 415.
    assert error_object(409, "Busy.")["error"] == {
        "message": "Busy.", "type": "conflict_error", "param": None, "code": "conflict",
    }  # fmt: skip
    assert json.loads(GatewayError(415, "No.", code="unsupported_media_type").response().content)["error"][
        "type"
    ] == ("invalid_request_error")
    assert error_kind(599) == OTHER_ERROR and OTHER_ERROR.type == "api_error"


def test_domain_errors_take_their_default_code_from_the_table():
    for cls in (DomainError, Forbidden, NotFound, Conflict):
        assert cls.code == error_kind(cls.status_code).code
