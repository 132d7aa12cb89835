"""What runs used and cost: device-seconds and tokens summed over their steps' metrics, priced.

Every step's metrics carry what it used (``training.cost``: ``device_kind``, ``device_seconds``,
``completion_tokens`` sampled, ``trainable_tokens`` trained, ``judge_prompt_tokens``,
``judge_completion_tokens``); the sums are one SQL aggregate over ``StepMetrics.metrics``, so the
query count does not grow with the steps. Prices come from settings (``PRICE_PER_*``); an unset
price is "not priced" (``None``), never a cost of 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from typing import Any

from django.conf import settings
from django.db.models import Count, F, FloatField, Q, QuerySet, Sum, Value
from django.db.models.fields.json import KeyTextTransform, KeyTransform
from django.db.models.functions import Cast, Coalesce, Concat, TruncDate

from projects.models import Evaluation, Run, StepMetrics

# Groups the costs endpoint takes → the columns they group by (and how a row names them).
GROUPS = ("day", "model", "run")
USAGE_KEYS = (
    "steps",
    "evaluations",
    "gpu_seconds",
    "cpu_seconds",
    "sampled_tokens",
    "trained_tokens",
    "judge_prompt_tokens",
    "judge_completion_tokens",
)


@dataclass(frozen=True)
class Prices:
    """The operator's prices (0 = not priced) in ``currency``."""

    gpu_hour: float = 0.0
    cpu_hour: float = 0.0
    per_1k_tokens: float = 0.0  # tokens sampled + trained
    per_1k_judge_tokens: float = 0.0
    currency: str = "USD"

    @classmethod
    def from_settings(cls) -> Prices:
        return cls(
            gpu_hour=settings.PRICE_PER_GPU_HOUR,
            cpu_hour=settings.PRICE_PER_CPU_HOUR,
            per_1k_tokens=settings.PRICE_PER_1K_TOKENS,
            per_1k_judge_tokens=settings.PRICE_PER_1K_JUDGE_TOKENS,
            currency=settings.COST_CURRENCY,
        )

    @property
    def any(self) -> bool:
        return any(
            price > 0
            for price in (self.gpu_hour, self.cpu_hour, self.per_1k_tokens, self.per_1k_judge_tokens)
        )


def priced(usage: dict[str, Any], prices: Prices) -> dict[str, Any] | None:
    """The cost of ``usage`` (a row of ``USAGE_KEYS``), by part and in total; ``None`` when the
    operator set no price at all. A part used but not priced is ``None`` and named in
    ``not_priced``; ``total`` sums the priced parts only (``not_priced`` says what it leaves out)."""
    if not prices.any:
        return None
    amounts = {
        "gpu": (usage["gpu_seconds"] / 3600, prices.gpu_hour),
        "cpu": (usage["cpu_seconds"] / 3600, prices.cpu_hour),
        "tokens": ((usage["sampled_tokens"] + usage["trained_tokens"]) / 1000, prices.per_1k_tokens),
        "judge_tokens": (
            (usage["judge_prompt_tokens"] + usage["judge_completion_tokens"]) / 1000,
            prices.per_1k_judge_tokens,
        ),
    }
    parts: dict[str, float | None] = {}
    not_priced = []
    for part, (quantity, price) in amounts.items():
        if price > 0 or quantity == 0:
            parts[part] = round(quantity * price, 6)
        else:
            parts[part] = None
            not_priced.append(part)
    total = round(sum(value for value in parts.values() if value is not None), 6)
    return {"currency": prices.currency, **parts, "total": total, "not_priced": not_priced}


def cost_row(usage: dict[str, Any], prices: Prices) -> dict[str, Any]:
    """A usage row with its derived fields: device-hours, judge_tokens, total_tokens and ``cost``."""
    row = {**usage}
    row["gpu_hours"] = usage["gpu_seconds"] / 3600
    row["cpu_hours"] = usage["cpu_seconds"] / 3600
    row["device_hours"] = row["gpu_hours"] + row["cpu_hours"]
    row["judge_tokens"] = usage["judge_prompt_tokens"] + usage["judge_completion_tokens"]
    row["total_tokens"] = usage["sampled_tokens"] + usage["trained_tokens"]
    row["cost"] = priced(usage, prices)
    return row


@dataclass(frozen=True)
class _Source:
    """Where one kind of work keeps its usage: a JSON field and the columns it is grouped by."""

    field: str  # "metrics" of a step, "results" of an evaluation
    count: str  # the USAGE_KEYS entry counting its rows
    day: Any  # when it was done (UTC day)
    model: str  # path to its TrainableModel
    nested: tuple[str, ...] = ()  # JSON objects inside ``field`` with the same keys (a reference side)


STEPS = _Source("metrics", "steps", TruncDate("created_at"), "run__model")
# An evaluation's reference side (results.reference) used the worker or the judge too; tokens a
# remote reference sampled (no device_kind: someone else's endpoint) are not ours and not counted.
EVALUATIONS = _Source(
    "results",
    "evaluations",
    TruncDate(Coalesce("finished_at", "created_at")),
    "checkpoint__model",
    ("reference",),
)


def _sums(source: _Source) -> dict[str, Any]:
    def number(key: str, where: str | None) -> Any:
        field = source.field if where is None else KeyTransform(where, source.field)
        return Cast(KeyTextTransform(key, field), FloatField())

    def kind(where: str | None, value: str) -> Q:
        path = source.field if where is None else f"{source.field}__{where}"
        return Q(**{f"{path}__device_kind": value})

    sums: dict[str, Any] = {}
    for where in (None, *source.nested):
        seconds = number("device_seconds", where)
        local = Q() if where is None else Q(**{f"{source.field}__{where}__has_key": "device_kind"})
        parts = {
            "gpu_seconds": Sum(seconds, filter=kind(where, "gpu")),
            "cpu_seconds": Sum(seconds, filter=kind(where, "cpu")),
            "sampled_tokens": Sum(number("completion_tokens", where), filter=local),
            "trained_tokens": Sum(number("trainable_tokens", where)),
            "judge_prompt_tokens": Sum(number("judge_prompt_tokens", where)),
            "judge_completion_tokens": Sum(number("judge_completion_tokens", where)),
        }
        for key, total in parts.items():
            part = Coalesce(total, 0.0)
            sums[key] = part if key not in sums else sums[key] + part
    return {source.count: Count("id"), **sums}


def _grouped(
    source: _Source, rows: QuerySet, group_by: list[str], start: date | None, end: date | None
) -> list[dict]:
    """``rows`` summed per group: dicts with the group keys (day, model_id, model_name, run) and the usage."""
    rows = rows.annotate(cost_day=source.day)
    if start is not None:
        rows = rows.filter(cost_day__gte=start)
    if end is not None:
        rows = rows.filter(cost_day__lte=end)
    names = []
    if "day" in group_by:
        names.append("cost_day")
    if "model" in group_by:
        rows = rows.annotate(
            cost_model_id=F(f"{source.model}_id"),
            cost_model=Concat(f"{source.model}__project__name", Value("/"), f"{source.model}__name"),
        )
        names += ["cost_model_id", "cost_model"]
    if "run" in group_by:
        names.append("run_id")
    sums = _sums(source)
    found = [rows.aggregate(**sums)] if not names else list(rows.values(*names).annotate(**sums))
    data = []
    for row in found:
        usage = {key: row.get(key, 0) for key in USAGE_KEYS}
        keys: dict[str, Any] = {}
        if "day" in group_by:
            keys["day"] = row["cost_day"]
        if "model" in group_by:
            keys["model"] = row["cost_model"] if row["cost_model_id"] is not None else None
            keys["model_id"] = row["cost_model_id"]
        if "run" in group_by:
            keys["run"] = row["run_id"]
        data.append({"keys": keys, "usage": usage})
    return data


def _whole(usage: dict[str, Any]) -> dict[str, Any]:
    """Token counts are whole numbers, seconds are not."""
    return {key: value if key.endswith("_seconds") else int(round(value)) for key, value in usage.items()}


def cost_rows(
    steps: QuerySet[StepMetrics],
    evaluations: QuerySet[Evaluation] | None = None,
    *,
    group_by: list[str],
    start: date | None = None,
    end: date | None = None,
    prices: Prices | None = None,
) -> list[dict[str, Any]]:
    """One row per group (``GROUPS``: day = the UTC day the work was done, model, run) over
    ``steps`` and ``evaluations`` (both already scoped to the caller's team), ordered by the
    groups (an evaluation of a base model has no model, a standalone one no run: those sort
    last); no group = one row of totals. Two queries, however many rows."""
    prices = prices or Prices.from_settings()
    merged: dict[tuple, dict[str, Any]] = {}
    found = _grouped(STEPS, steps, group_by, start, end)
    if evaluations is not None:
        found += _grouped(EVALUATIONS, evaluations, group_by, start, end)
    for entry in found:
        key = tuple(entry["keys"].items())
        if key not in merged:
            merged[key] = {"keys": entry["keys"], "usage": dict.fromkeys(USAGE_KEYS, 0)}
        for name, value in entry["usage"].items():
            merged[key]["usage"][name] += value
    ordered = sorted(merged.values(), key=lambda entry: [(v is None, v or 0) for v in entry["keys"].values()])
    if not group_by and not ordered:
        ordered = [{"keys": {}, "usage": dict.fromkeys(USAGE_KEYS, 0)}]
    return [{**entry["keys"], **cost_row(_whole(entry["usage"]), prices)} for entry in ordered]


def rows_total(rows: list[dict[str, Any]], prices: Prices | None = None) -> dict[str, Any]:
    """The totals of grouped rows (their usage summed, priced again)."""
    usage = {key: sum(row[key] for row in rows) for key in USAGE_KEYS}
    return cost_row(usage, prices or Prices.from_settings())


def run_cost(*, run: Run, prices: Prices | None = None) -> dict[str, Any]:
    """One run's totals over all its steps and in-run evaluations (two queries)."""
    steps, evaluations = StepMetrics.objects.filter(run=run), Evaluation.objects.filter(run=run)
    (row,) = cost_rows(steps, evaluations, group_by=[], prices=prices)
    return {"object": "run.cost", "run": run.pk, **row}
