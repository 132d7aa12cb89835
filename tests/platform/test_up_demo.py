"""``manage.py up`` starts the demo run on the first start only (``--demo``, ``make up DEMO=1``,
starts another), and a start that fails leaves no demo run queued to train ahead of the next
start's work. The stack is a stand-in: nothing is started."""

from __future__ import annotations

import io
import os
import signal

import pytest
from django.core.management import call_command

from artweb.demo import REWARD_SPEC
from artweb.demo.setup import demo_start
from artweb.management.commands import up
from projects.models import RewardDefinition, Run, RunStatus


class FailingStack:
    """Every process starts; the trainer exits once the demo run was created (the race of issue 54)."""

    def __init__(self, log_dir) -> None:
        self.log_dir = log_dir

    def start(self, name, command, *, sock=None):
        if sock is not None:
            sock.close()

    def check_alive(self):
        if Run.objects.filter(model__project__name="demo").exists():
            raise RuntimeError("trainer exited with code 1")

    def stop(self):
        pass


@pytest.fixture
def stand_in_stack(monkeypatch):
    """No processes, an answering web server, and ``up``'s signal handlers and children's
    environment undone afterwards."""
    environ, handlers = (
        dict(os.environ),
        {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)},
    )
    monkeypatch.setattr(up, "Stack", FailingStack)
    monkeypatch.setattr(up, "wait_for_web", lambda url, *, stack: None)
    yield
    os.environ.clear()
    os.environ.update(environ)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def start_up(*args: str) -> str:
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="trainer exited"):
        call_command(
            "up", "--port", "0", "--no-inference", "--trainer-port", "0", "--demo-steps", "2", *args, stdout=out
        )  # fmt: skip
    return out.getvalue()


@pytest.mark.django_db
def test_a_failed_start_leaves_its_demo_run_cancelled_not_queued(stand_in_stack):
    output = start_up()
    run = Run.objects.get(model__project__name="demo")
    assert run.status == RunStatus.CANCELLED  # was: queued, first in line for the next start's worker
    assert f"Demo run {run.pk} had not started: cancelled" in output
    # The cancelled demo does not count as run: the next start runs the demo again.
    start_up()
    assert Run.objects.filter(model__project__name="demo").count() == 2


@pytest.mark.django_db
def test_the_demo_runs_on_the_first_start_only_unless_asked(stand_in_stack):
    earlier = demo_start(steps=2).run  # an earlier start's demo (still queued here: any but cancelled)
    output = start_up()
    assert list(Run.objects.filter(model__project__name="demo")) == [earlier]
    assert f"The demo ran on an earlier start (run {earlier.pk}, queued)" in output
    assert "`make up DEMO=1` (manage.py up --demo) starts another." in output
    start_up("--demo")
    assert Run.objects.filter(model__project__name="demo").count() == 2


@pytest.mark.django_db
def test_a_data_dir_from_an_earlier_release_grades_the_next_demo_with_this_releases_reward():
    first = demo_start(steps=2).run
    assert first.reward.version == 1 and first.reward.spec["graders"]["said"]["score_on_miss"] == -1.0
    assert demo_start(steps=2).run.reward == first.reward  # unchanged: the same version
    older = {**REWARD_SPEC, "graders": {k: v for k, v in REWARD_SPEC["graders"].items() if k != "said"}}
    RewardDefinition.objects.filter(pk=first.reward.pk).update(
        spec={**older, "calculate_output": "correct * (0.5 + 0.5 * exact)"}
    )
    third = demo_start(steps=2).run
    assert third.reward.version == 2 and "said" in third.reward.spec["graders"]
    assert RewardDefinition.objects.get(pk=first.reward.pk).spec["calculate_output"].endswith("exact)")
