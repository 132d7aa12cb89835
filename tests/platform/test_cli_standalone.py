"""The CLI is one file a CI job can fetch on its own (README "From CI"): it runs with nothing of
artweb importable, and its parser and exit codes hold without a server."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import pytest

from artweb import cli

CLI = Path(cli.__file__)


def test_the_cli_file_runs_alone_outside_the_repository(tmp_path):
    copy = tmp_path / "artweb_cli.py"
    shutil.copy(CLI, copy)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import runpy, sys\n"
        "sys.argv = ['artweb', 'runs', 'watch', '1']\n"
        "try:\n"
        f"    runpy.run_path({str(copy)!r}, run_name='__main__')\n"
        "except SystemExit as exit:\n"
        "    print('EXIT', exit.code, *(name in sys.modules for name in ('django', 'torch', 'artweb')))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no ARTWEB_* and no repository on the path
    result = subprocess.run(
        [sys.executable, "-I", str(probe)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.stdout.split() == ["EXIT", "3", "False", "False", "False"], result.stdout + result.stderr
    assert "no API key: set ARTWEB_API_KEY" in result.stderr


def test_unreachable_server_is_exit_3_and_a_missing_file_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARTWEB_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.setenv("ARTWEB_API_KEY", "aw_x")
    monkeypatch.setenv("ARTWEB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert cli.main(["runs", "get", "1"]) == 3
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
    assert cli.main(["runs", "create", "-f", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exit:
        cli.main(["runs", "watch", "not-a-number"])
    assert exit.value.code == 2


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def test_help_reads_as_plain_text_on_every_command():
    helps = {parser.prog: parser.format_help() for parser in _parsers(cli.build_parser())}
    assert {"artweb", "artweb login", "artweb runs watch", "artweb checkpoints download"} <= helps.keys()
    for prog, text in helps.items():
        assert "`" not in text, f"{prog} --help shows reST markup:\n{text}"
    # What a person reads, through a pipe: the examples keep their lines, exit codes are listed.
    shown = subprocess.run([sys.executable, str(CLI), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "`" not in shown.stdout
    assert "\n    artweb runs watch 42 " in shown.stdout and "141 standard output was closed" in shown.stdout


def test_login_help_says_the_key_can_come_from_a_pipe():
    (login,) = (parser for parser in _parsers(cli.build_parser()) if parser.prog == "artweb login")
    assert 'echo "$KEY" | artweb login' in " ".join(login.format_help().split())


def with_closed_stdout(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI writing into a pipe nobody reads any more (``| head`` that has exited): the read end
    is closed before the command starts, so its first write fails, every time."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, str(CLI), *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write)


def test_help_into_a_closed_pipe_is_quiet():
    # argparse itself drops a failed write of the help (and exits 0); kept so it stays that way.
    result = with_closed_stdout("--help")
    assert (result.returncode, result.stderr) == (0, "")


def test_an_error_keeps_its_exit_code_and_message_when_stdout_is_closed(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ARTWEB_API_KEY": "aw_x",
        "ARTWEB_BASE_URL": "http://127.0.0.1:9",
    }
    result = with_closed_stdout("runs", "get", "1", env=env)
    assert result.returncode == 3 and "cannot reach http://127.0.0.1:9" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_login_reads_the_key_from_a_pipe_and_refuses_an_empty_one(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KEY": "aw_from_the_pipe", "CLI": str(CLI)}
    script = f'echo "$KEY" | {sys.executable} "$CLI" login --url http://127.0.0.1:9'
    piped = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    # The key was read (it got as far as the server, which is not there), and never shown.
    assert piped.returncode == 3 and "cannot reach http://127.0.0.1:9" in piped.stderr, piped.stderr
    assert "aw_from_the_pipe" not in piped.stdout + piped.stderr
    empty = subprocess.run(
        ["bash", "-c", f'{sys.executable} "$CLI" login --url http://127.0.0.1:9 < /dev/null'],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert empty.returncode == 2 and "no API key: pipe it on standard input" in empty.stderr, empty.stderr


def _http_error(status: int, error: dict) -> urllib.error.HTTPError:
    body = io.BytesIO(json.dumps({"error": error}).encode())
    return urllib.error.HTTPError("http://artweb/api/v1/runs/", status, "Bad Request", Message(), body)


def test_an_api_error_names_its_field_once():
    # The API's message already names the field (projects/api/errors.py) ...
    located = _http_error(
        400, {"message": "config.group_size: must be at least 2", "param": "config.group_size"}
    )
    assert str(cli.api_error(located)) == "HTTP 400: config.group_size: must be at least 2"
    # ... a domain error's may not: then the CLI adds it.
    bare = _http_error(404, {"message": "no such task set", "param": "task_set"})
    assert str(cli.api_error(bare)) == "HTTP 404: task_set: no such task set"


def _metrics_row(step: int, at: str) -> dict:
    return {"step": step, "reward_mean": 0.5, "loss": 0.1, "created_at": at}


def test_speed_and_time_left_come_only_from_two_steps_seen_finishing():
    run = {"id": 7, "status": "running", "steps_done": 12, "total_steps": 20}
    rate = cli.StepRate()
    history = _metrics_row(12, "2026-01-01T10:00:00Z")  # 12 steps before the watch: not a speed
    assert cli.progress_text(run, history, rate) == "step=12, reward=0.5, loss=0.1"
    rate.add("2026-01-01T10:05:00.000000Z")  # one live step starts the clock
    assert "s/step" not in cli.progress_text(run, history, rate)
    rate.add("2026-01-01T10:05:30+00:00")  # the next, 30 s later by the server's clock
    run["steps_done"] = 14
    text = cli.progress_text(run, _metrics_row(14, "2026-01-01T10:05:30Z"), rate)
    assert text == "step=14, reward=0.5, loss=0.1, 30.0 s/step, 03:00 left"  # 6 steps at 30 s


def test_a_watch_summarises_history_instead_of_replaying_it():
    def event(id: int, message: str, level: str = "info", **data: object) -> dict:
        return {
            "id": id,
            "created_at": f"2026-01-01T10:00:{id:02d}Z",
            "level": level,
            "message": message,
            "data": data,
        }

    events = [
        event(1, "Run created"),
        event(2, "Step 1/3: rollouts", phase="rollouts"),
        event(3, "Evaluation at step 0: reward 0.250", evaluation=4, step=0),
        event(4, "Step 1/3: 2 groups had no learning signal", level="warn"),
        event(5, "Step 2/3: rollouts", phase="rollouts"),
        event(6, "Step 2/3: saving checkpoint", phase="saving"),
    ]
    run = {"id": 7, "status": "running", "steps_done": 2, "total_steps": 3}
    lines = cli.history_lines(run, events)
    assert lines == [
        "Run 7 running, 2/3 steps done before this watch; its warnings, evaluations and latest phase"
        " (3 other events: GET /api/v1/runs/7/events/):",
        "10:00:03 INFO  Evaluation at step 0: reward 0.250",
        "10:00:04 WARN  Step 1/3: 2 groups had no learning signal",
        "10:00:06 INFO  Step 2/3: saving checkpoint",
    ]


def test_the_readme_calls_every_option_by_the_name_its_help_shows():
    """README's `artweb …` lines parse, and each long option is the one --help lists first (the
    README said `login --url` where --help says --base-url)."""
    import re
    import shlex

    readme = (CLI.parent.parent / "README.md").read_text()
    lines = re.findall(r"\bartweb ((?:login|runs|evaluations|checkpoints)\b[^#`\n]*)", readme)
    assert any(line.startswith("login --") for line in lines), lines
    parser = cli.build_parser()
    for line in lines:
        words = shlex.split(line)
        parser.parse_args(words)  # a bad line exits 2
        chain = [p for p in _parsers(parser) if p.prog == "artweb " + " ".join(words[:2])] or [
            p for p in _parsers(parser) if p.prog == "artweb " + words[0]
        ]
        options = {s: a.option_strings for a in chain[0]._actions for s in a.option_strings}
        for word in words:
            if word.startswith("--"):
                long_names = [s for s in options[word] if s.startswith("--")]
                assert word == long_names[0], (
                    f"README: artweb {line.strip()}: --help names it {long_names[0]}"
                )
