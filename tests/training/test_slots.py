"""Sandbox slots (training/safety/slots.py): per team and per host, shared by processes, never leaked."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from training.rewards import SandboxConfig
from training.rewards.sandbox import PythonSandbox
from training.safety.slots import SlotPolicy, SlotsBusy, sandbox_slot


def test_a_team_gets_at_most_its_share_and_other_teams_still_start(tmp_path):
    policy = SlotPolicy(directory=str(tmp_path), total=3, per_team=2)
    with sandbox_slot(policy, "alpha"), sandbox_slot(policy, "alpha"):
        with pytest.raises(SlotsBusy) as caught, sandbox_slot(policy, "alpha"):
            pass
        assert caught.value.scope == "team" and caught.value.limit == 2
        with sandbox_slot(policy, "beta"):  # the third host slot
            with pytest.raises(SlotsBusy) as caught, sandbox_slot(policy, "gamma"):
                pass
            assert caught.value.scope == "total" and caught.value.limit == 3
    with sandbox_slot(policy, "alpha"), sandbox_slot(policy, "alpha"):  # all released on exit
        pass


def test_a_waiting_caller_gets_the_slot_freed_within_its_wait(tmp_path):
    policy = SlotPolicy(directory=str(tmp_path), total=1, per_team=1, wait_seconds=10)
    released = threading.Event()

    def hold():
        with sandbox_slot(policy, "alpha"):
            released.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.2)
    threading.Timer(0.3, released.set).start()
    started = time.monotonic()
    with sandbox_slot(policy, "beta"):
        waited = time.monotonic() - started
    holder.join()
    assert 0.05 < waited < 5


def test_a_full_host_answers_after_the_wait_not_before(tmp_path):
    policy = SlotPolicy(directory=str(tmp_path), total=1, per_team=1, wait_seconds=0.3)
    with sandbox_slot(policy, "alpha"):
        started = time.monotonic()
        with pytest.raises(SlotsBusy), sandbox_slot(policy, "beta"):
            pass
        assert 0.3 <= time.monotonic() - started < 3


def test_a_holder_that_dies_frees_its_slot(tmp_path):
    policy = SlotPolicy(directory=str(tmp_path), total=1, per_team=1)
    code = (
        "import sys, time; from training.safety.slots import SlotPolicy, sandbox_slot\n"
        f"with sandbox_slot(SlotPolicy(directory={str(tmp_path)!r}, total=1, per_team=1), 'alpha'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        with pytest.raises(SlotsBusy), sandbox_slot(policy, "beta"):  # another process holds it
            pass
    finally:
        child.kill()
        child.wait()
    with sandbox_slot(policy, "beta"):  # the kernel dropped the dead holder's lock
        pass


def test_python_graders_hold_a_slot_while_their_child_lives(tmp_path):
    policy = SlotPolicy(directory=str(tmp_path), total=4, per_team=1)
    config = SandboxConfig(slots=policy, team="alpha")
    source = "def grade(sample, item):\n    return 1.0\n"
    with PythonSandbox(source, config) as first:
        assert first.grade({"output_text": "x"}, {}) == 1.0
        second = PythonSandbox(source, config)
        with pytest.raises(SlotsBusy):
            second.grade({"output_text": "x"}, {})
        assert second.starts == 0  # refused before any child started
        other_team = PythonSandbox(source, SandboxConfig(slots=policy, team="beta"))
        with other_team:
            assert other_team.grade({"output_text": "x"}, {}) == 1.0
    with PythonSandbox(source, config) as again:  # closed: the slot is free
        assert again.grade({"output_text": "x"}, {}) == 1.0
