"""artweb packs a client job's trajectories as ART does, so a train() call makes as many optimizer
steps here as on ART's own packed backends: the counts of ART 0.5.23's code and of
training.session.packing.plan_sequences agree on random groups (tests/integration/art_packing_check.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration


def test_the_same_groups_give_the_same_number_of_steps_as_arts_packing():
    if not (ROOT / ".venv-art23").exists():
        pytest.fail(".venv-art23 is missing: `make install` creates the ART client's virtualenv")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/integration/art_packing_check.py"), "7", "300"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0 and "300/300 agree" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
