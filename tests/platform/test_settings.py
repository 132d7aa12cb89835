"""Settings come from the environment; production values pass `check --deploy`; bad values fail loudly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "DATABASE_URL", "SECRET_KEY"}}
    base.update({"ARTWEB_DATA_DIR": str(tmp_path / "data")})
    base.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=base, capture_output=True, text=True, timeout=120
    )


PRODUCTION = {
    "DEBUG": "0",
    "SECRET_KEY": "x9!Qz" * 12,
    "ALLOWED_HOSTS": "artweb.example.org",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/artweb",
    "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
}


def test_production_settings_pass_check_deploy(tmp_path):
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_secret_key_from_file(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("from-a-file-" + "k" * 50)
    env = {**PRODUCTION, "SECRET_KEY": "", "SECRET_KEY_FILE": str(secret)}
    result = manage(
        "shell",
        "-v",
        "0",
        "-c",
        "from django.conf import settings; print(settings.SECRET_KEY)",
        env=env,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == secret.read_text()


def test_generated_secret_key_is_kept_in_the_data_dir(tmp_path):
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    first = manage("shell", "-v", "0", "-c", code, env={"SECRET_KEY": ""}, tmp_path=tmp_path)
    second = manage("shell", "-v", "0", "-c", code, env={"SECRET_KEY": ""}, tmp_path=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and len(first.stdout.strip()) >= 50
    assert oct((tmp_path / "data" / "secret_key").stat().st_mode)[-3:] == "600"


def test_bad_values_fail_at_start(tmp_path):
    result = manage("check", env={"DEBUG": "maybe"}, tmp_path=tmp_path)
    assert result.returncode != 0 and "DEBUG='maybe' is not a boolean" in result.stderr
    result = manage("check", env={"RUN_HEARTBEAT_TIMEOUT_S": "soon"}, tmp_path=tmp_path)
    assert result.returncode != 0 and "RUN_HEARTBEAT_TIMEOUT_S" in result.stderr
    result = manage("check", env={"DATABASE_URL": "nosuchdb://x"}, tmp_path=tmp_path)
    assert result.returncode != 0 and "DATABASE_URL" in result.stderr


def test_engine_and_unsloth_choices_come_from_the_environment(tmp_path):
    code = "from django.conf import settings as s; print(s.TRAINING_ENGINE, s.TRAINING_UNSLOTH)"
    env = {"DEBUG": "1", "ARTWEB_ENGINE": " Transformers ", "ARTWEB_UNSLOTH": "off"}
    result = manage("shell", "-v", "0", "-c", code, env=env, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["transformers", "off"]
    result = manage("check", env={"ARTWEB_ENGINE": "tensorrt"}, tmp_path=tmp_path)
    assert result.returncode != 0 and "ARTWEB_ENGINE='tensorrt' must be one of" in result.stderr


def test_embedded_defaults_use_sqlite_and_the_filesystem_broker(tmp_path):
    code = (
        "from django.conf import settings as s; "
        "print(s.DATABASES['default']['ENGINE'], s.CELERY_BROKER_URL, s.CELERY_BROKER_TRANSPORT_OPTIONS['data_folder_in'])"
    )
    env = {"DEBUG": "1", "CELERY_BROKER_URL": "", "DATABASE_URL": ""}
    result = manage("shell", "-v", "0", "-c", code, env=env, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    engine, broker, folder = result.stdout.split()
    assert (
        engine.endswith("sqlite3") and broker.startswith("filesystem://") and folder.startswith(str(tmp_path))
    )


def test_mcp_stdio_programs_come_from_a_comma_separated_list(tmp_path):
    code = "from django.conf import settings; print(repr(settings.MCP_STDIO_PROGRAMS))"
    unset = manage("shell", "-v", "0", "-c", code, env={"DEBUG": "1"}, tmp_path=tmp_path)
    assert unset.returncode == 0, unset.stderr
    assert unset.stdout.strip() == "()"  # only the shipped demo server
    env = {"DEBUG": "1", "MCP_STDIO_PROGRAMS": "/opt/mcp/bin/warehouse, node,"}
    listed = manage("shell", "-v", "0", "-c", code, env=env, tmp_path=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == "('/opt/mcp/bin/warehouse', 'node')"


def test_outbound_allow_comes_from_a_comma_separated_list_and_bad_entries_fail(tmp_path):
    code = "from django.conf import settings; print(repr(settings.OUTBOUND_ALLOW))"
    env = {"DEBUG": "1", "OUTBOUND_ALLOW": "judge.corp.example, 10.20.0.0/16,[::1]:8000,"}
    listed = manage("shell", "-v", "0", "-c", code, env=env, tmp_path=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip() == "('judge.corp.example', '10.20.0.0/16', '[::1]:8000')"
    bad = manage("check", env={"DEBUG": "1", "OUTBOUND_ALLOW": "10.0.0.0/33"}, tmp_path=tmp_path)
    assert bad.returncode != 0 and "OUTBOUND_ALLOW" in bad.stderr and "10.0.0.0/33" in bad.stderr


def test_up_allows_only_its_own_gateway_besides_the_operators_entries(monkeypatch):
    from artweb.management.commands.up import own_gateway_allowed
    from training.safety.outbound import OutboundPolicy, OutboundRefused

    monkeypatch.delenv("OUTBOUND_ALLOW", raising=False)
    policy = OutboundPolicy(allow=tuple(own_gateway_allowed("127.0.0.1", 8000).split(",")))
    assert policy.check_url("http://127.0.0.1:8000/v1") and policy.check_url("http://localhost:8000/v1")
    for elsewhere in ("http://127.0.0.1:6379/", "http://localhost:5432/", "http://169.254.169.254/"):
        with pytest.raises(OutboundRefused):
            policy.check_url(elsewhere)
    monkeypatch.setenv("OUTBOUND_ALLOW", "judge.corp.example")
    assert own_gateway_allowed("0.0.0.0", 9000).split(",")[:2] == ["judge.corp.example", "127.0.0.1:9000"]
