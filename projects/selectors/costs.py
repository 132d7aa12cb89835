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
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, Concat, TruncDate

from projects.models import Run, StepMetrics

# Groups the costs endpoint takes → the columns they group by (and how a row names them).
GROUPS = ("day", "model", "run")
USAGE_KEYS = (
    "steps",
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


def _number(key: str) -> Any:
    return Cast(KeyTextTransform(key, "metrics"), FloatField())


def _sums() -> dict[str, Any]:
    seconds = _number("device_seconds")
    return {
        "steps": Count("id"),
        "gpu_seconds": Coalesce(Sum(seconds, filter=Q(metrics__device_kind="gpu")), 0.0),
        "cpu_seconds": Coalesce(Sum(seconds, filter=Q(metrics__device_kind="cpu")), 0.0),
        "sampled_tokens": Coalesce(Sum(_number("completion_tokens")), 0.0),
        "trained_tokens": Coalesce(Sum(_number("trainable_tokens")), 0.0),
        "judge_prompt_tokens": Coalesce(Sum(_number("judge_prompt_tokens")), 0.0),
        "judge_completion_tokens": Coalesce(Sum(_number("judge_completion_tokens")), 0.0),
    }


def _usage(row: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = {key: row[key] for key in USAGE_KEYS}
    for key in USAGE_KEYS:  # token counts are whole numbers, seconds are not
        if key != "steps" and not key.endswith("_seconds"):
            usage[key] = int(round(usage[key]))
    return usage


def cost_rows(
    steps: QuerySet[StepMetrics],
    *,
    group_by: list[str],
    start: date | None = None,
    end: date | None = None,
    prices: Prices | None = None,
) -> list[dict[str, Any]]:
    """One row per group (``GROUPS``: day = the step's UTC day, model, run) over ``steps`` (already
    scoped to the caller's team), ordered by the groups; no group = one row of totals."""
    prices = prices or Prices.from_settings()
    if start is not None:
        steps = steps.filter(created_at__date__gte=start)
    if end is not None:
        steps = steps.filter(created_at__date__lte=end)
    if "day" in group_by:
        steps = steps.annotate(day=TruncDate("created_at"))
    columns = {
        "day": ["day"],
        "model": ["model_id", "model_name"],
        "run": ["run_id"],
    }
    names = [column for group in group_by for column in columns[group]]
    if "model" in group_by:
        steps = steps.annotate(
            model_id=F("run__model_id"),
            model_name=Concat("run__model__project__name", Value("/"), "run__model__name"),
        )
    if not names:
        return [cost_row(_usage(steps.aggregate(**_sums())), prices)]
    rows = steps.values(*names).annotate(**_sums()).order_by(*names)
    data = []
    for row in rows:
        item: dict[str, Any] = {}
        if "day" in group_by:
            item["day"] = row["day"]
        if "model" in group_by:
            item["model"] = row["model_name"]
            item["model_id"] = row["model_id"]
        if "run" in group_by:
            item["run"] = row["run_id"]
        item.update(cost_row(_usage(row), prices))
        data.append(item)
    return data


def rows_total(rows: list[dict[str, Any]], prices: Prices | None = None) -> dict[str, Any]:
    """The totals of grouped rows (their usage summed, priced again)."""
    usage = {key: sum(row[key] for row in rows) for key in USAGE_KEYS}
    return cost_row(usage, prices or Prices.from_settings())


def run_cost(*, run: Run, prices: Prices | None = None) -> dict[str, Any]:
    """One run's totals over all its steps (one query)."""
    (row,) = cost_rows(StepMetrics.objects.filter(run=run), group_by=[], prices=prices)
    return {"object": "run.cost", "run": run.pk, **row}
