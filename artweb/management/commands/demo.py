"""``manage.py demo --steps N``: start the demo run, show its progress, exit 0 only if it succeeded."""

from __future__ import annotations

import time
from datetime import datetime

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from tqdm import tqdm

from artweb.demo.setup import demo_start
from artweb.stack import Stack, worker_command
from projects import selectors
from projects.formatting import format_number
from projects.models import Run, RunEvent, RunStatus, StepMetrics
from training.model_files import BUNDLED_MODEL

TERMINAL = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}


def event_line(event: RunEvent) -> str:
    """One terminal line per run event: local time, level, message; a no-signal warning stands out."""
    stamp = timezone.localtime(event.created_at).strftime("%H:%M:%S")
    if event.level == "warn" and (event.data or {}).get("signal"):
        return f"{stamp} !!! WARNING: {event.message}"
    return f"{stamp} [{event.level}] {event.message}"


def eta_text(step_seconds: list[float], remaining: int) -> str:
    """Time left from the steps done so far (``selectors.seconds_left``, the run page's rule);
    nothing before the first step (model load and the step-0 evaluation say nothing about a step's
    length, so an ETA from them would mislead)."""
    seconds = selectors.seconds_left(step_seconds, remaining)
    if seconds is None:
        return "eta after the first step"
    left = round(seconds)
    return f"eta {left // 60}:{left % 60:02d}"


def clock(seconds: float) -> str:
    """0:07, 1:43, 1:02:05: a phase's running time on the terminal."""
    whole = max(0, int(seconds))
    if whole < 3600:
        return f"{whole // 60}:{whole % 60:02d}"
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def now_text(run: Run, phase: RunEvent | None, now: datetime) -> str:
    """What the run is doing now and for how long, redrawn every half second by ``watch_run``: a
    clock that moves while a long phase (opening a session, loading a model) runs, where the bar
    once sat frozen for 103 s. A queued run says it waits for a worker."""
    if run.status == RunStatus.QUEUED:
        return f"queued, waiting for a worker {clock((now - run.created_at).total_seconds())}"
    if run.status != RunStatus.RUNNING or phase is None:
        return ""
    # A phase's own "…" goes (the clock follows it); a message cut to fit the bar keeps the "…"
    # that says so ("Opening the run's session on the trainer service (bundled:s 0:34" did not).
    message = phase.message.rstrip("…. ")
    if len(message) > 60:
        message = message[:59].rstrip() + "…"
    return f"{message} {clock((now - phase.created_at).total_seconds())}"


def watch_run(run: Run, *, stack: Stack | None, stdout, timeout_s: float) -> Run:
    """Print the run's events as timestamped lines (its phases among them) and draw a bar per step
    (mean reward, loss, ETA from the recorded steps' durations) with the current phase and its
    running clock (``now_text``) until the run ends."""
    bar = tqdm(
        total=run.total_steps,
        desc=f"run {run.pk}",
        unit="step",
        dynamic_ncols=True,
        # tqdm's own ETA counts the model load and the step-0 evaluation as step time.
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
    )
    step_text = eta_text([], run.total_steps)
    phase: RunEvent | None = None
    seen_step = 0
    last_event = 0
    durations: list[float] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            run.refresh_from_db()
            for event in RunEvent.objects.filter(run=run, id__gt=last_event, type="message").order_by("id"):
                last_event = event.id
                bar.write(event_line(event))
                if (event.data or {}).get("phase"):
                    phase = event
            for metrics in StepMetrics.objects.filter(run=run, step__gt=seen_step).order_by("step"):
                seen_step = metrics.step
                if (metrics.metrics or {}).get("step_seconds"):
                    durations.append(float(metrics.metrics["step_seconds"]))
                bar.update(1)
                step_text = (
                    f"reward {format_number(metrics.reward_mean, 3)}, loss {format_number(metrics.loss, 3)}, "
                    + eta_text(durations, run.total_steps - bar.n)
                )
            now = now_text(run, phase, timezone.now())
            bar.set_postfix_str(f"{step_text}; {now}" if now else step_text)  # redraws: the clock moves
            if run.status in TERMINAL:
                return run
            if stack is not None:
                stack.check_alive()
            if time.monotonic() > deadline:
                raise CommandError(
                    f"run {run.pk} did not finish within {timeout_s:.0f}s (status {run.status})"
                )
            time.sleep(0.5)
    finally:
        bar.close()


class Command(BaseCommand):
    help = "Start the demo run (bundled CPU model), show its progress and exit 0 only if it succeeded."

    def add_arguments(self, parser):
        parser.add_argument("--steps", type=int, default=10)
        parser.add_argument(
            "--base-model", default=BUNDLED_MODEL, help="bundled model or a local model directory"
        )
        parser.add_argument("--no-worker", action="store_true", help="use an already running worker")
        parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before giving up")
        parser.add_argument("--group-size", type=int, default=None)
        parser.add_argument("--groups-per-step", type=int, default=None)
        parser.add_argument("--max-new-tokens", type=int, default=None)

    def handle(self, *args, steps: int, base_model: str, no_worker: bool, timeout: float, **options):
        call_command("migrate", interactive=False, verbosity=0)
        overrides = {
            key: options[key]
            for key in ("group_size", "groups_per_step", "max_new_tokens")
            if options.get(key) is not None
        }
        stack = None if no_worker else Stack(settings.DATA_DIR / "logs")
        try:
            if stack is not None:
                stack.start("worker", worker_command())
            setup = demo_start(steps=steps, base_model_source=base_model, config=overrides)
            print_credentials(self.stdout, setup)
            run = watch_run(setup.run, stack=stack, stdout=self.stdout, timeout_s=timeout)
        finally:
            if stack is not None:
                stack.stop()
        if run.status != RunStatus.SUCCEEDED:
            raise CommandError(f"run {run.pk} {run.status}: {run.error}")
        self.stdout.write(self.style.SUCCESS(f"run {run.pk} succeeded: {run.total_steps} steps"))


def print_credentials(stdout, setup) -> None:
    if setup.password:
        stdout.write(f"Created user 'demo' with password: {setup.password}   (shown once)")
    if setup.api_key:
        stdout.write(f"Created API key for team 'demo': {setup.api_key}   (shown once)")
    stdout.write(f"Started run {setup.run.pk}: GET /api/v1/runs/{setup.run.pk}/events/")
