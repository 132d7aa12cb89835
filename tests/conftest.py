"""Shared fixtures. The cast (healthchecks style): alice owns team alpha, bob is a viewer in alpha,
charlie owns team beta (an outsider to alpha)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Fixtures that reach the database (pytest-django's, and the module-scoped servers built on them).
_DATABASE_FIXTURES = frozenset({"db", "transactional_db", "django_db_setup", "live_server"})


def pytest_collection_modifyitems(config, items):
    """``ARTWEB_TESTS_ORM_ONLY=1`` (make test's SQLite pass): only the tests that touch the database
    run; a test that never opens a connection runs the same code on either database, and the
    PostgreSQL pass ran it already."""
    if os.environ.get("ARTWEB_TESTS_ORM_ONLY") != "1":
        return
    keep, drop = [], []
    for item in items:
        touches = item.get_closest_marker("django_db") is not None or bool(
            _DATABASE_FIXTURES & set(getattr(item, "fixturenames", ()))
        )
        (keep if touches else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """On SQLite (make test's second pass: the embedded default) the test database is a file beside
    DATABASE_URL's, ``test_<name>``, opened with the embedded default's settings (WAL, IMMEDIATE
    writes, a busy timeout), instead of Django's shared in-memory one: that one locks whole tables
    against the gateway's database threads ("database table is locked", which a file in WAL mode
    never does) and child processes cannot open it (tests.processes.test_database_url)."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    test = database.setdefault("TEST", {})
    if database["ENGINE"] == "django.db.backends.sqlite3" and not test.get("NAME"):
        name = Path(database["NAME"])
        if database["NAME"] != ":memory:" and not database["NAME"].startswith("file:"):
            test["NAME"] = str(name.with_name(f"test_{name.name}"))
            # Django deletes an old test database's file but not its WAL beside it (left when a
            # gateway database thread still held a connection), which SQLite would replay into
            # the new one.
            for leftover in ("-wal", "-shm"):
                Path(test["NAME"] + leftover).unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-init causal LM with a local tokenizer (seconds to build, a few MB)."""
    from training.base_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0)


@pytest.fixture
def cast(db):
    from tests.factories import MembershipFactory, TeamFactory, UserFactory

    alice = UserFactory(username="alice", password="pw-alice-123")
    bob = UserFactory(username="bob", password="pw-bob-123")
    charlie = UserFactory(username="charlie", password="pw-charlie-123")
    alpha = TeamFactory(name="alpha", owner=alice)
    MembershipFactory(team=alpha, user=bob, role="viewer")
    beta = TeamFactory(name="beta", owner=charlie)
    return type("Cast", (), {"alice": alice, "bob": bob, "charlie": charlie, "alpha": alpha, "beta": beta})


def error_of(response) -> dict:
    """The OpenAI error object of a response (asserting it is one)."""
    body = response.json()
    assert "error" in body, body
    return body["error"]


def _client(user=None, key: str | None = None):
    from rest_framework.test import APIClient

    client = APIClient()
    if user is not None:
        client.force_login(user)
    if key is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


@pytest.fixture
def alice_client(cast):
    return _client(cast.alice)


@pytest.fixture
def bob_client(cast):
    return _client(cast.bob)


@pytest.fixture
def charlie_client(cast):
    return _client(cast.charlie)


@pytest.fixture
def alpha_key(cast) -> str:
    from projects import services

    return services.api_key_create(team=cast.alpha, name="ci").plaintext


@pytest.fixture
def key_client(alpha_key):
    return _client(key=alpha_key)


@pytest.fixture
def read_only_client(cast):
    from projects import services

    return _client(key=services.api_key_create(team=cast.alpha, name="ro", read_only=True).plaintext)


@pytest.fixture
def anonymous_client():
    return _client()


REWARD_SPEC = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "ilike",
}


@pytest.fixture
def alpha_setup(cast):
    """A complete set of inputs for a run in team alpha (not started)."""
    from tests import factories

    base = factories.BaseModelFactory(name="tiny")
    project = factories.ProjectFactory(team=cast.alpha, name="math")
    model = factories.TrainableModelFactory(project=project, name="agent", base_model=base)
    task_set = factories.TaskSetFactory(project=project, name="qa")
    environment = factories.EnvironmentFactory(project=project, name="chat")
    reward = factories.RewardDefinitionFactory(project=project, name="exact")
    return type(
        "Setup",
        (),
        {
            "base": base,
            "project": project,
            "model": model,
            "task_set": task_set,
            "environment": environment,
            "reward": reward,
        },
    )


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # Password hashing is deliberately slow in production; tests create many users.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _loopback_test_servers_allowed(settings):
    # Judge, OpenAI and MCP test servers listen on 127.0.0.1; the SSRF tests empty this again.
    from tests.openai_stub import LOOPBACK_ALLOWED

    settings.OUTBOUND_ALLOW = LOOPBACK_ALLOWED


@pytest.fixture(autouse=True)
def _plain_http_test_client(settings):
    # Production defaults redirect HTTP to HTTPS; the test client speaks plain HTTP.
    settings.SECURE_SSL_REDIRECT = False


@pytest.fixture(autouse=True)
def _no_data_parallel_ranks_left():
    """A test that fails with a data-parallel session open would leave its follower processes and
    this process's process group to the tests after it (a later update then waits in a collective
    for a peer that never comes): stop them after every test."""
    yield
    import sys

    followers = sys.modules.get("training.hosting.followers")
    if followers is None:
        return
    for running in list(followers._active):
        running.close()
    if followers.dist.is_initialized():
        followers.dist.destroy_process_group()


@contextlib.contextmanager
def trainer_service(root: Path, cache: Path, token: str = "secret-token", port: int = 0, device: str = "cpu"):
    """A trainer service process (training.hosting.service) rooted at ``root``; its client (with
    ``process``: the Popen, for tests that kill it). ``port`` 0: any free port."""
    import subprocess
    import sys
    import time

    from training.hosting.client import TrainerServiceClient

    env = {**os.environ, "TRAINER_SERVICE_TOKEN": token, "HF_HUB_OFFLINE": "1", "TORCH_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "training.hosting.service", "--root", str(root), "--port", str(port),
         "--model-cache-dir", str(cache), "--device", device],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("trainer service on "), line + process.stdout.read()
        deadline = time.monotonic() + 30
        client = TrainerServiceClient(line.split()[-1], token=token)
        while True:
            try:
                client.stats()
                break
            except OSError:
                if process.poll() is not None:
                    raise AssertionError(f"the trainer service exited: {process.stdout.read()}") from None
                assert time.monotonic() < deadline, "the trainer service did not answer"
                time.sleep(0.1)
        client.process = process  # type: ignore[attr-defined]
        yield client
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture
def live_service(tiny_model_dir, tmp_path):
    """A trainer service rooted at ``tmp_path``, its client."""
    with trainer_service(tmp_path, tiny_model_dir.parent) as client:
        yield client
