"""``{% load text %}{{ project.description|code_spans }}``: user text escaped first, then each
`backtick span` wrapped in <code> (a description read `make up` with its backticks shown)."""

from __future__ import annotations

import re

from django import template
from django.utils.html import conditional_escape
from django.utils.safestring import SafeString, mark_safe

register = template.Library()

CODE_SPAN = re.compile(r"`([^`\n]+)`")


@register.filter(name="code_spans", is_safe=True)
def code_spans(value: object) -> SafeString:
    escaped = str(conditional_escape(value))  # every character of the user's text escaped before any tag
    return mark_safe(CODE_SPAN.sub(r"<code>\1</code>", escaped))  # noqa: S308 (escaped above)
