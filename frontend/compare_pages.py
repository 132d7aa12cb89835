"""Compare 2 to 5 runs of the team: reward, loss, KL and validation reward overlaid on shared axes
(one chart per metric, one line per run, step on x) and a table of their configurations with the
rows that differ marked. The series are the run page's (run_pages.run_chart_data), so what a run
did not measure is missing here too, with the run page's note."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from frontend.access import TeamHttpRequest, team_view
from frontend.run_pages import run_chart_data
from projects import selectors
from projects.models import Run

MIN_RUNS, MAX_RUNS = 2, 5

# (key, caption): "reward" and "validation" are chart_data's reward_mean and validation series,
# the others its per-step ``series``.
COMPARED_CHARTS = [
    ("reward", "Mean reward"),
    ("loss", "Loss"),
    ("kl", "KL to the base model"),
    ("validation", "Validation reward (per evaluation)"),
]

MISSING = "—"


def requested_ids(request: TeamHttpRequest) -> tuple[list[int], str]:
    """The run ids of ``?ids=1,2,3`` (or repeated ``ids``, as the runs list's checkboxes send
    them), in order, without repeats; and what is wrong with them ("" when nothing)."""
    ids: list[int] = []
    for value in request.GET.getlist("ids"):
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            if not part.isdecimal():
                return [], f"“{part}” is not a run id."
            if int(part) not in ids:
                ids.append(int(part))
    if not MIN_RUNS <= len(ids) <= MAX_RUNS:
        chosen = f"{len(ids)} run{'s' if len(ids) != 1 else ''} chosen"
        return ids, f"Pick {MIN_RUNS} to {MAX_RUNS} runs to compare ({chosen})."
    return ids, ""


def run_label(run: Run) -> str:
    return f"#{run.pk} {run.model.name}"


def evaluated_on(run: Run, data: dict[str, Any]) -> list[str]:
    """What each of a run's charted evaluations ran on, in words ("24 validation rows of
    one-word-answers"), without repeats: the row count (else the sample count), split and task set."""
    described: list[str] = []
    for evaluated in data["validation"].get("evaluated", []):
        split = evaluated["split"]
        if evaluated["rows"] is not None:
            size = f"{evaluated['rows']} {split} rows"
        elif evaluated["n"] is not None:
            size = f"{evaluated['n']} {split} samples"
        else:
            size = f"{split} rows"
        task_set = f"task set #{evaluated['task_set']}"
        if run.task_set is not None and run.task_set.pk == evaluated["task_set"]:
            task_set = run.task_set.name
        text = f"{size} of {task_set}"
        if text not in described:
            described.append(text)
    return described


def validation_comparability(runs: list[Run], charts: dict[int, dict[str, Any]]) -> str:
    """Why the runs' validation rewards cannot be read against each other ("" when they can):
    a mean over 24 rows and one over 8 (or over another task set or split) are different measures."""
    measured_on = {
        (
            evaluated["task_set"],
            evaluated["split"],
            evaluated["rows"] if evaluated["rows"] is not None else evaluated["n"],
        )
        for run in runs
        for evaluated in charts[run.pk]["validation"].get("evaluated", [])
    }
    if len(measured_on) <= 1:
        return ""
    described = {run.pk: evaluated_on(run, charts[run.pk]) for run in runs}
    return (
        "Not comparable: these evaluations ran on different rows ("
        + "; ".join(f"{run_label(run)}: {', '.join(described[run.pk])}" for run in runs if described[run.pk])
        + "). Each series is labelled with what it measured."
    )


def compare_series(runs: list[Run], charts: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per COMPARED_CHARTS chart: per run its ``points`` ({x: step, y: value}; an
    unmeasured step is y null, drawn as a gap) and the run page's note for that series. A
    chart no run measured is ``not_measured``. The validation chart says when its runs evaluated
    on different rows (``not_comparable``, the reason) and then labels each series with them."""
    out = []
    not_comparable = validation_comparability(runs, charts)
    for key, caption in COMPARED_CHARTS:
        datasets = []
        for run in runs:
            data = charts[run.pk]
            label = run_label(run)
            if key == "reward":
                steps, values, note = data["steps"], data["reward_mean"], ""
            elif key == "validation":
                steps, values = data["validation"]["steps"], data["validation"]["reward_mean"]
                note = "" if steps else "No evaluation yet."
                if not_comparable and steps:
                    label += f" ({', '.join(evaluated_on(run, data))})"
            elif key in data["series"]:
                series = data["series"][key]
                steps, values, note = data["steps"], series["values"], series["note"]
            else:  # a series its kind does not measure (presentation.chart_series)
                steps, values, note = [], [], f"A {run.kind} run does not measure this."
            datasets.append(
                {
                    "run": run.pk,
                    "label": label,
                    "points": [{"x": step, "y": value} for step, value in zip(steps, values, strict=True)],
                    "measured": any(value is not None for value in values),
                    "note": note,
                }
            )
        out.append(
            {
                "key": key,
                "caption": caption,
                "datasets": datasets,
                "not_measured": not any(dataset["measured"] for dataset in datasets),
                "notes": [(dataset["label"], dataset["note"]) for dataset in datasets if dataset["note"]],
                "not_comparable": not_comparable if key == "validation" else "",
            }
        )
    return out


def config_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """The inputs each run trained with, one row per key: base model, task set, environment and
    reward version first, then every hyperparameter in any run's config. ``differs`` is true when
    the runs do not all have the same value (a key one run lacks differs)."""

    def shown(value: Any) -> str:
        return MISSING if value is None else str(value)

    fixed: list[tuple[str, list[str]]] = [
        ("base model", [run.model.base_model.name for run in runs]),
        ("task set", [shown(run.task_set.name if run.task_set else None) for run in runs]),
        (
            "environment",
            [
                shown(f"{run.environment.name} ({run.environment.kind})" if run.environment else None)
                for run in runs
            ],
        ),
        (
            "reward",
            [shown(f"{run.reward.name} v{run.reward.version}" if run.reward else None) for run in runs],
        ),
    ]
    keys = sorted({key for run in runs for key in (run.config or {})})
    hyperparameters = [(key, [shown((run.config or {}).get(key)) for run in runs]) for key in keys]
    return [
        {"key": key, "values": values, "differs": len(set(values)) > 1, "hyperparameter": index >= len(fixed)}
        for index, (key, values) in enumerate(fixed + hyperparameters)
    ]


@require_GET
@team_view()
def runs_compare(request: TeamHttpRequest) -> HttpResponse:
    ids, problem = requested_ids(request)
    if problem:
        # Opening the page with nothing chosen is not a bad request; choosing 1 or 6 runs is.
        status = 200 if not ids and "ids" not in request.GET else 400
        return render(request, "frontend/runs_compare.html", {"problem": problem}, status=status)
    found = {
        run.pk: run
        for run in selectors.scoped(Run, request.team)
        .filter(pk__in=ids)
        .select_related("model__base_model", "task_set", "environment", "reward")
    }
    missing = [pk for pk in ids if pk not in found]
    if missing:  # another team's run reads as no run at all
        raise Http404(f"no such run: {missing[0]}")
    runs = [found[pk] for pk in ids]
    charts = {run.pk: run_chart_data(run) for run in runs}
    rows = config_rows(runs)
    return render(
        request,
        "frontend/runs_compare.html",
        {
            "runs": runs,
            "series": compare_series(runs, charts),
            "rows": rows,
            "differing": sum(row["differs"] for row in rows),
        },
    )
