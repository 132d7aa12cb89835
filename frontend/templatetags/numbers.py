"""``{% load numbers %}{{ value|number }}``: a number formatted by magnitude (projects.formatting)."""

from __future__ import annotations

from typing import Any

from django import template

from projects.formatting import format_number

register = template.Library()


@register.filter(name="number")
def number(value: Any, digits: int = 4) -> str:
    return format_number(value, int(digits))
