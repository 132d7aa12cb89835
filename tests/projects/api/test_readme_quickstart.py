"""The README's "Quickstart with curl", run as written: its bash block under bash, with the real
curl and jq, against a live server. Only the key and the server's address are this test's; every
curl of the block must succeed (``--fail-with-body``: a 4xx or 5xx is a failure, its body shown)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from projects import services
from projects.models import Run, RunStatus, Team

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"

pytestmark = pytest.mark.django_db(transaction=True)

# Every call goes through this wrapper: it counts the calls and writes down the ones that failed.
WRAPPER = r"""
set -u -o pipefail
curl() {
    echo call >> "$CALLS"
    command curl --fail-with-body --max-time 30 "$@" || echo "exit $?: curl $*" >> "$FAILURES"
}
"""


def quickstart_block() -> str:
    text = README.read_text()
    found = re.search(r"^## Quickstart with curl\n\n```bash\n(.*?)^```", text, re.S | re.M)
    assert found, "README.md has no bash block under '## Quickstart with curl'"
    return found.group(1)


def test_every_curl_of_the_readme_quickstart_succeeds_as_written(live_server, tmp_path):
    team = Team.objects.create(name="acme")
    key = services.api_key_create(team=team, name="quickstart").plaintext
    services.base_model_register(name="smollm2-135m-instruct", source="bundled:smollm2-135m-instruct")
    block = quickstart_block()
    script, keys = re.subn(r"^export KEY=\S+", f"export KEY={key}", block, flags=re.M)
    script, addresses = re.subn(r"http://127\.0\.0\.1:8000", live_server.url, script)
    assert (keys, addresses) == (1, 1), "the quickstart no longer sets KEY and API the way this test expects"
    calls, failures = tmp_path / "calls", tmp_path / "failures"
    result = subprocess.run(
        ["bash", "-c", WRAPPER + script],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "CALLS": str(calls), "FAILURES": str(failures), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    failed = failures.read_text() if failures.exists() else ""
    assert not failed, f"{failed}\n--- stdout:\n{result.stdout}"
    made = calls.read_text().splitlines()
    assert len(made) == len(re.findall(r"\bcurl ", block)), made  # none skipped
    # What the block prints: the run's events (`<id> [<level>] <message>`); the run is left to
    # train (no worker here: it stays queued), not cancelled by the block itself.
    assert re.search(r"^\d+ \[info\] ", result.stdout, re.M), result.stdout
    run = Run.objects.get()
    assert (run.config["steps"], run.config["group_size"]) == (5, 6)
    assert run.status == RunStatus.QUEUED
