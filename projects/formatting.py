"""Numbers for people: formatted by magnitude, so a loss of 1e-9 reads "1e-9" (not "-0.0000"), a
token count reads "347" (not "347.0000"), and a reward reads "0.625". Used by event messages, the
dashboard's ``number`` template filter, and mirrored by ``formatNumber`` in frontend/static/app.js.
"""

from __future__ import annotations

import math
from typing import Any

# How a step is named ("Step 3/20", "Step 23 (3 of 3 in this run)"): the worker's phase events,
# the step events and the run page share this one wording.
from training.runs.progress import step_label

__all__ = ["NOT_A_NUMBER", "format_number", "step_label"]

NOT_A_NUMBER = "–"


def format_number(value: Any, digits: int = 4) -> str:
    """``value`` with ``digits`` significant digits and no trailing zeros; integers stay whole,
    |value| < 0.001 and ≥ 1e6 in short scientific notation ("1.3e-6", "2.5e+7"); 0 and -0.0 are
    "0"; anything that is not a number is "–"."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return NOT_A_NUMBER
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = abs(value)
    if isinstance(value, int) or (float(value).is_integer() and magnitude < 1e6):
        return str(int(value)) if magnitude < 1e6 else _scientific(value, digits)
    if magnitude < 1e-3 or magnitude >= 1e6:
        return _scientific(value, digits)
    text = f"{value:.{digits}g}"
    if "e" in text:  # e.g. 99999.5 with 4 digits: .4g falls back to an exponent
        return f"{value:.0f}"
    return text


def _scientific(value: float, digits: int) -> str:
    mantissa, exponent = f"{value:.{max(digits - 1, 0)}e}".split("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    sign = "-" if exponent.startswith("-") else "+"
    return f"{mantissa}e{sign}{int(exponent[1:])}"
