"""Reads of runs: one run, the team's runs, a run's events; and the worker's own check on its run."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Max, Min, Q, QuerySet

from projects import catalog
from projects.errors import NotFound
from projects.models import Project, RewardDefinition, Run, RunEvent, RunStatus, StepMetrics, Team, Trajectory
from projects.selectors._scoping import scoped


def run_get(*, team: Team, run_id: int) -> Run:
    run = scoped(Run, team).filter(pk=run_id).first()
    if run is None:
        raise NotFound("run not found")
    return run


def run_recent_events(*, run: Run, limit: int = 50) -> list[RunEvent]:
    """The newest ``limit`` events, newest first (the run page's log)."""
    return list(RunEvent.objects.filter(run=run).order_by("-id")[:limit])


# How many of the latest steps the time left is taken from: a run's steps change length as it
# learns (the demo's replies shorten from 16 tokens to 2, its steps from 18 s to 5 s on 2 cores), so
# the mean over every step overstated the time left (4:48 shown at step 11 of 40 with 2 minutes
# left); the latest few say what the next ones cost.
RECENT_STEPS = 5


def seconds_left(step_seconds: list[float], steps_left: int) -> float | None:
    """Time left from recorded step durations (oldest first): the mean of the latest
    ``RECENT_STEPS`` times the steps left; None before the first step. The one ETA rule: the run
    page, a fine-tuning job's ``estimated_finish`` and the terminal's bar all use it."""
    if not step_seconds:
        return None
    recent = step_seconds[-RECENT_STEPS:]
    return sum(recent) / len(recent) * max(0, steps_left)


def run_seconds_left(*, run: Run) -> float | None:
    """A running run's time left (``seconds_left``) from its recorded steps' own durations
    (``step_seconds``, from a step's start to its record). The time before the first step
    (opening the session, loading the model, the step-0 evaluation) is no step's: spread over the
    steps done, as ``elapsed / done`` did, it made an ETA of 1:08:42 at step 1 of a run with 6.4
    minutes left. None when the run is not running, or before its first recorded step."""
    if run.status != RunStatus.RUNNING or not run.started_at:
        return None
    left = run.total_steps - run.steps_done
    if left <= 0:
        return None
    latest = StepMetrics.objects.filter(run=run, step__gt=run.start_step).order_by("-step")
    durations = [
        float(metrics["step_seconds"])
        for metrics in latest.values_list("metrics", flat=True)[:RECENT_STEPS]
        if isinstance(metrics, dict) and isinstance(metrics.get("step_seconds"), int | float)
    ]  # the rule reads the latest steps only: the live run page polls this
    return seconds_left(durations[::-1], left)


def run_phase(*, run: Run) -> RunEvent | None:
    """The run's latest phase event (``data.phase``: loading, evaluating, rollouts, grading,
    updating, saving; training.runs.loop), or None before the worker has said anything."""
    return RunEvent.objects.filter(run=run, data__has_key="phase").order_by("-id").first()


def run_signal_warnings(*, run: Run) -> list[RunEvent]:
    """The run's "no learning signal" warnings (``data.signal``; training.runs.learning_signal), the
    latest of each kind (signal and grader), oldest first: the run page shows them as banners. A
    resumed run's watcher starts afresh and says the same again; one banner each."""
    latest: dict[tuple[str, str], RunEvent] = {}
    for event in RunEvent.objects.filter(run=run, level="warn", data__has_key="signal").order_by("id"):
        key = (str(event.data.get("signal")), str(event.data.get("grader", "")))
        latest.pop(key, None)  # re-inserted: ordered by its latest occurrence
        latest[key] = event
    return list(latest.values())


def run_seconds_paused(*, run: Run, until: datetime) -> float:
    """Seconds ``run`` spent paused up to ``until``: from each transition to paused to the next
    to running (a resumed run waits in the queue too), or to ``until`` while it is still paused.
    The run page leaves them out of its elapsed time."""
    paused = 0.0
    since: datetime | None = None
    for data, at in (
        RunEvent.objects.filter(run=run, data__has_key="to").order_by("id").values_list("data", "created_at")
    ):
        if data.get("to") == RunStatus.PAUSED and since is None:
            since = at
        elif data.get("to") == RunStatus.RUNNING and since is not None:
            paused += (at - since).total_seconds()
            since = None
    if since is not None:
        paused += max((until - since).total_seconds(), 0.0)
    return paused


def run_reward_range(*, run: Run) -> tuple[tuple[float, float], str] | None:
    """The range the run's rewards can take, and where it comes from: the grader's declared range
    ("declared"), else the lowest and highest reward of the run's trajectories ("observed"); None
    before any trajectory. Charts keep a mean ± std band inside it (a 0/1 reward never reads -0.2)."""
    declared = catalog.reward_range(run.reward.spec) if run.reward is not None else None
    if declared is not None:
        return (float(declared[0]), float(declared[1])), "declared"
    bounds = Trajectory.objects.filter(run=run).aggregate(low=Min("reward"), high=Max("reward"))
    if bounds["low"] is None or bounds["high"] is None:
        return None
    return (float(bounds["low"]), float(bounds["high"])), "observed"


def runs_search(
    *,
    team: Team,
    project_id: int | None = None,
    model_id: int | None = None,
    status: str | None = None,
    text: str = "",
) -> QuerySet[Run]:
    """The team's runs, newest first; ``text`` matches the model, project or creator name."""
    runs = scoped(Run, team).select_related("project", "model", "created_by")
    if project_id is not None:
        runs = runs.filter(project_id=project_id)
    if model_id is not None:
        runs = runs.filter(model_id=model_id)
    if status:
        runs = runs.filter(status=status)
    if text:
        runs = runs.filter(
            Q(model__name__icontains=text)
            | Q(project__name__icontains=text)
            | Q(created_by__username__icontains=text)
        )
    return runs.order_by("-id")


# --- the worker's reads (projects.jobs): by id, for the system rather than a caller's team ----------


def run_stop_reason(*, run_id: int, worker: str) -> str | None:
    """Why a run's worker must stop before its next step: "lost" (the run is gone, no longer
    running, or another worker's), "cancelled" or "paused" (a user asked; cancelling wins), or
    None to go on."""
    state = (
        Run.objects.filter(pk=run_id)
        .values("cancel_requested", "pause_requested", "status", "worker")
        .first()
    )
    if state is None or state["status"] != RunStatus.RUNNING or state["worker"] != worker:
        return "lost"
    if state["cancel_requested"]:
        return "cancelled"
    return "paused" if state["pause_requested"] else None


def project_last_run_inputs(*, project: Project) -> dict[str, int]:
    """The task set, environment and reward of the project's most recent platform run (SFT and DPO
    included), for the new-run form to preselect; the reward as its name's newest version, the one
    the form lists. Empty when the project has no such run."""
    run = (
        Run.objects.filter(
            project=project, task_set__isnull=False, environment__isnull=False, reward__isnull=False
        )
        .select_related("reward")
        .order_by("-created_at", "-id")
        .first()
    )
    if run is None or run.reward is None:
        return {}
    newest = (
        RewardDefinition.objects.filter(project=project, name=run.reward.name).order_by("-version").first()
    )
    used = {
        "task_set": run.task_set_id,
        "environment": run.environment_id,
        "reward": (newest or run.reward).pk,
    }
    return {name: pk for name, pk in used.items() if pk is not None}
