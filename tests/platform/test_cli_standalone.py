"""The CLI is one file a CI job can fetch on its own (README "From CI"): it runs with nothing of
artweb importable, and its parser and exit codes hold without a server."""

from __future__ import annotations

import shutil
import subprocess
import sys
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
