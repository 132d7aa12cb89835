"""Property-based fuzz of every REST API operation from the OpenAPI schema (schemathesis 4).

Each operation gets schemathesis' coverage phase (boundary values, wrong types, missing and extra
fields, unexpected methods and media types, in valid and invalid variants) and Hypothesis-generated
valid and invalid requests from ``/api/v1/schema/``, sent in-process through the WSGI app on the
test database (PostgreSQL in ``make test``), as a team API key, then as a signed-in session (with
its CSRF token and ``X-Team``). Every response must not be a server error and must conform to the
schema: a documented status, its content type, headers and body schema (errors are OpenAI error
objects, documented for every operation by projects.api.schema). Path ids are drawn partly from
rows that exist, so detail endpoints are exercised, not only their 404s.

Failures are collected, not raised inside Hypothesis (no shrinking), so one run lists every
failing operation with a curl line to reproduce it; each operation prints its totals (``-s``).
``FUZZ_EXAMPLES=50`` for a deeper run (the default keeps the whole fuzz near a minute).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date
from typing import Any

import hypothesis
import pytest
import schemathesis
from django.core import signals
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections, transaction
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from projects import services
from projects.models import (
    EvaluationSample,
    Export,
    JudgeEndpoint,
    Membership,
    StepMetrics,
    TrainingJob,
    Trajectory,
    UsageRecord,
    WebhookEndpoint,
)

pytestmark = pytest.mark.django_db

# Hypothesis examples per operation: 4x this as the key, 1x as the session (the coverage phase
# comes on top, a fixed set per operation).
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "5"))
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]

# In-process, like Django's test client: the app shares the test's connection and transaction.
SCHEMA = schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", WSGIHandler())
OPERATIONS = {result.ok().label: result.ok() for result in SCHEMA.get_all_operations()}


@pytest.fixture(autouse=True)
def _keep_the_test_connection():
    """Django closes a connection found inside a transaction when a request ends; the requests run
    inside the test's, so (as Django's test client does) that receiver is off meanwhile."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@dataclass
class Tally:
    cases: int = 0
    server_errors: int = 0
    failures: list[str] = field(default_factory=list)


@pytest.fixture
def world(alpha_setup, cast) -> dict[str, Any]:
    """Rows of every kind in team alpha, by the path prefix whose ``{id}`` names them."""
    judge = JudgeEndpoint.objects.create(team=cast.alpha, name="judge", base_url="http://127.0.0.1:9/v1")
    run = services.run_create(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    services.run_event_add(run=run, message="started")
    checkpoint = services.checkpoint_record(model=alpha_setup.model, run=run, step=0, path="/nowhere/0")
    evaluation = services.evaluation_create(
        checkpoint=checkpoint,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    # Rows the lists return, so their response schemas are checked against real data.
    StepMetrics.objects.create(
        run=run, step=1, reward_mean=0.5, reward_std=0.1, loss=None, metrics={"kl": 0.0}
    )
    messages = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "0"}]
    Trajectory.objects.create(
        run=run, step=1, group_index=0, sample_index=0, task_row_index=0, messages=messages, reward=1.0
    )
    EvaluationSample.objects.create(evaluation=evaluation, task_row_index=0, messages=messages, reward=1.0)
    key = services.api_key_create(team=cast.alpha, name="fuzz")
    UsageRecord.objects.create(
        team=cast.alpha, api_key=key.api_key, model="math/agent:0", day=date(2026, 1, 2), requests=1
    )
    member = Membership.objects.get(team=cast.alpha, user=cast.bob)
    # ART's preview protocol: a client model (with its step 0) and a job with an event to page.
    client_model, client_run = services.client_model_register(
        team=cast.alpha, entity=None, project="games", name="client", base_model=alpha_setup.base.name
    )
    job = TrainingJob.objects.create(model=client_model, run=client_run)
    services.training_job_started(job=job, num_sequences=1)
    return {
        "/api/v1/projects/": alpha_setup.project.pk,
        "/api/v1/base-models/": alpha_setup.base.pk,
        "/api/v1/models/": alpha_setup.model.pk,
        "/api/v1/reward-definitions/": alpha_setup.reward.pk,
        "/api/v1/task-sets/": alpha_setup.task_set.pk,
        "/api/v1/environments/": alpha_setup.environment.pk,
        "/api/v1/runs/": run.pk,
        "/api/v1/api-keys/": key.api_key.pk,
        "/api/v1/members/": member.pk,
        "/api/v1/judge-endpoints/": judge.pk,
        "/api/v1/evaluations/": evaluation.pk,
        "/api/v1/checkpoints/": checkpoint.pk,
        "/api/v1/exports/": Export.objects.create(checkpoint=checkpoint).pk,
        "/api/v1/webhooks/": WebhookEndpoint.objects.create(
            team=cast.alpha, name="hook", url="http://127.0.0.1:9/hook", events=["*"], secret_encrypted="x"
        ).pk,
        "/v1/preview/models/": client_model.pk,
        "/v1/preview/training-jobs/": job.pk,
        "/api/v1/aliases/": services.alias_set(model=alpha_setup.model, name="prod", step=0).pk,
        "/api/v1/feedback/": services.feedback_add(
            team=cast.alpha,
            value=1.0,
            conversation_id="",
            completion=services.stored_completion_create(
                team_id=cast.alpha.pk,
                completion_id="chatcmpl-fuzz-fb",
                api_key_id=None,
                model="m",
                served_by="m",
                checkpoint_id=None,
                stream=False,
                metadata={},
                conversation_id="",
                request={"messages": []},
                response={"choices": []},
                prompt_token_ids=None,
                token_ids=None,
                logprobs=None,
                latency_ms=1,
            ),
        ).pk,
        "/v1/chat/completions/": services.stored_completion_create(
            team_id=cast.alpha.pk,
            completion_id="chatcmpl-fuzz",
            api_key_id=key.api_key.pk,
            model="math/agent:0",
            served_by="math/agent:0",
            checkpoint_id=checkpoint.pk,
            stream=False,
            metadata={"k": "v"},
            conversation_id="",
            request={"messages": messages},
            response={
                "choices": [{"index": 0, "message": messages[1], "finish_reason": "stop", "logprobs": None}]
            },
            prompt_token_ids=[1],
            token_ids=[[2]],
            logprobs=[[-0.5]],
            latency_ms=3,
        ).completion_id,  # type: ignore[union-attr]
        "/api/v1/completion-gradings/": services.completion_grading_create(
            team=cast.alpha, reward=alpha_setup.reward
        ).pk,
    }


def _existing_ids(path: str, world: dict[str, Any]) -> dict[str, Any] | None:
    for prefix, pk in world.items():
        if path.startswith(prefix) and "{" in path:
            name = path[len(prefix) :].split("}")[0].lstrip("{")
            return {name: pk}
    return None


def _coverage_cases(operation: Any, world: dict[str, Any]) -> Iterator[Any]:
    """Schemathesis' coverage phase (boundary values, wrong types, missing and extra fields, in
    valid and invalid variants), and again on an existing row for the detail endpoints."""
    generation = SCHEMA.config.generation_for(operation=operation, phase="coverage")
    modes = list(schemathesis.GenerationMode)
    yield from SCHEMA.iter_coverage_cases(operation, generation_modes=modes, generation_config=generation)
    existing = _existing_ids(operation.path, world)
    if existing:
        sent: set[str] = set()
        for case in SCHEMA.iter_coverage_cases(
            operation, generation_modes=modes, generation_config=generation
        ):
            case.path_parameters = {**(case.path_parameters or {}), **existing}
            key = repr((case.query, case.body, case.headers, case.path_parameters))
            if key not in sent:
                sent.add(key)
                yield case


def _fuzz_strategy(operation: Any, world: dict[str, Any]) -> st.SearchStrategy:
    modes = list(schemathesis.GenerationMode)
    strategies = [operation.as_strategy(generation_mode=mode) for mode in modes]
    existing = _existing_ids(operation.path, world)
    if existing:
        strategies += [
            operation.as_strategy(generation_mode=mode, path_parameters=existing) for mode in modes
        ]
    return st.one_of(strategies)


def _first_line(failure: BaseException) -> str:
    lines = [line.strip() for line in str(failure).splitlines() if line.strip()]
    return " | ".join(lines[:3])[:300]


class Caller:
    """Sends cases as one caller and tallies what comes back."""

    def __init__(self, label: str, headers: dict[str, str], cookies: dict[str, str] | None = None) -> None:
        self.label, self.headers, self.cookies = label, headers, cookies or {}
        self.tally = Tally()
        self._seen: set[str] = set()

    def send(self, case: Any) -> None:
        self.tally.cases += 1
        # Every case in a savepoint rolled back afterwards: a DELETE does not starve later cases.
        with transaction.atomic():
            try:
                response = case.call(headers=self.headers, cookies=self.cookies)
                if response.status_code >= 500:
                    self.tally.server_errors += 1
                try:
                    case.validate_response(response, checks=CHECKS, headers=self.headers)
                except (AssertionError, BaseExceptionGroup) as exc:
                    self._record(case, exc)
            finally:
                transaction.set_rollback(True)

    def _record(self, case: Any, exc: BaseException) -> None:
        failures = exc.exceptions if isinstance(exc, BaseExceptionGroup) else [exc]
        for failure in failures:
            kind = f"{case.operation.label} ({self.label}) {type(failure).__name__}: {_first_line(failure)}"
            if kind not in self._seen:
                self._seen.add(kind)
                curl = case.as_curl_command(headers=self.headers)
                self.tally.failures.append(f"{kind}\n    {curl[:600]}")

    def fuzz(self, strategy: st.SearchStrategy, examples: int) -> None:
        @hypothesis.settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.generate],  # no shrinking: failures are collected, not raised
        )
        @hypothesis.given(case=strategy)
        def run(case: Any) -> None:
            self.send(case)

        run()


def _session_cookies(user: Any) -> tuple[dict[str, str], dict[str, str]]:
    """A signed-in session for ``user`` and a CSRF token, as a browser would send them."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.sessions.backends.db import SessionStore

    session = SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.save()
    csrf = "f" * 32
    cookies = {"sessionid": session.session_key or "", "csrftoken": csrf}
    return cookies, {"X-CSRFToken": csrf, "X-Team": "alpha"}


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_operation_never_fails_and_conforms_to_the_schema(label: str, world, cast) -> None:
    operation = OPERATIONS[label]
    key = services.api_key_create(team=cast.alpha, name="fuzz-key").plaintext
    as_key = Caller("api key", {"Authorization": f"Bearer {key}"})
    for case in _coverage_cases(operation, world):
        as_key.send(case)
    as_key.fuzz(_fuzz_strategy(operation, world), EXAMPLES * 4)
    cookies, headers = _session_cookies(cast.alice)
    as_session = Caller("session", headers, cookies)
    as_session.fuzz(_fuzz_strategy(operation, world), EXAMPLES)
    tallies = [as_key.tally, as_session.tally]
    cases, errors = sum(t.cases for t in tallies), sum(t.server_errors for t in tallies)
    failures = [failure for t in tallies for failure in t.failures]
    print(f"\nfuzz {label}: {cases} cases, {errors} server errors, {len(failures)} distinct failures")
    assert not failures, "\n".join(failures)


HOSTILE_BODIES = {
    "nested 100k deep": "[" * 100_000 + "]" * 100_000,
    "NaN": '{"name": NaN}',
    "1e400": '{"name": 1e400}',
    "4301 digits": '{"name": ' + "1" * 4301 + "}",
    "lone surrogate": '{"name": "\\ud800"}',
    "NUL": '{"name": "\\u0000"}',
}


@pytest.mark.parametrize("label", sorted(label for label, op in OPERATIONS.items() if op.body))
def test_hostile_json_is_a_400_naming_the_position_on_every_operation_with_a_body(
    label: str, world, client, cast
) -> None:
    """The crashes the security review found on every POST/PUT/PATCH, sent to each one (on a row
    that exists), as the owner signed in: each answered by the strict JSON reader before any view
    logic, as a 400 ``invalid_json`` error object. ART's preview protocol (``/v1/preview/``) takes
    NUL by design (a model can sample it; projects.api.preview.PreviewJSONParser): there it reaches
    the view, and must not be a server error."""
    operation = OPERATIONS[label]
    path = operation.path
    for name, pk in (_existing_ids(operation.path, world) or {}).items():
        path = path.replace("{" + name + "}", str(pk))
    client.force_login(cast.alice)
    for kind, text in HOSTILE_BODIES.items():
        response = client.generic(operation.method.upper(), path, text.encode(), content_type="application/json",
                                  HTTP_X_TEAM="alpha")  # fmt: skip
        if kind == "NUL" and path.startswith("/v1/preview/"):
            assert response.status_code < 500, (kind, response.status_code, response.content[:200])
            continue
        assert response.status_code == 400, (kind, response.status_code, response.content[:200])
        error = response.json()["error"]
        assert error["code"] == "invalid_json" and " at line 1 column " in error["message"], (kind, error)
