"""artweb trains a client job with ART's objective: on random packed sequences and settings, ART
0.5.23's own loss_fn and artweb's (training.recipes.art_loss.art_policy_loss and the session's
``art`` loss) give the same loss, gradient and metrics (tests/integration/art_loss_check.py),
including cases where the upper clip ``epsilon_high`` binds."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.integration.conftest import ROOT

pytestmark = pytest.mark.integration


def test_random_sequences_give_arts_own_loss_with_both_clips_binding():
    if not (ROOT / ".venv-art23").exists():
        pytest.fail(".venv-art23 is missing: `make install` creates the ART client's virtualenv")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests/integration/art_loss_check.py"), "7", "300"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0 and "300/300 agree" in done.stdout, output
    upper = re.search(
        r"upper clip: (\d+) tokens with ratio > 1 \+ epsilon_high and A > 0 in (\d+) cases", done.stdout
    )
    lower = re.search(r"lower clip: (\d+) tokens", done.stdout)
    moved = re.search(r"epsilon_high changes ART's loss in (\d+) cases", done.stdout)
    assert upper and lower and moved, output
    assert int(upper.group(1)) > 0 and int(upper.group(2)) > 0, output  # the upper clip is reached
    assert int(lower.group(1)) > 0, output
    assert int(moved.group(1)) > 0, output  # and it changes the loss compared
