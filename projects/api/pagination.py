"""Every list the API returns has OpenAI's shape, with keyset (cursor) pagination.

``{"object": "list", "data": [...], "has_more": bool, "first_id": id | null, "last_id": id | null}``;
``?limit=`` (1 to ``MAX_LIMIT``, default ``DEFAULT_LIMIT``) and ``?after=<id>``: the page starts
after that item in the list's own order (by step, by name, newest first …), found by comparing the
ordering columns rather than an offset, so a page stays right while rows are added behind it.

``after=0`` (or any number below 1) is the start of every list: no row has such an id (ids start
at 1), so it names no row, only "before the first"; a poller's first call is ``?after=0``, the next
``?after=<last id seen>``. Any other id that is not in the list is a 400, because the list never
handed it out: in an order by name, step or newest first it has no place at all, and in an order
by id it is most likely another list's id (another run's event), which would silently skip rows.
The one exception skips nothing: in a list ordered by id alone, oldest first (events), an id below
the list's first one comes before every row, so the whole list follows it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import Q, QuerySet
from rest_framework import serializers
from rest_framework.pagination import BasePagination
from rest_framework.request import Request
from rest_framework.response import Response

from projects.errors import ValidationFailed

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # PostgreSQL's bigint: every id and count fits


def int_query_param(request: Request, name: str, default: int | None) -> int | None:
    """``?name=`` as an integer (ids, ``limit``, ``step`` …): a 400 naming it unless it is plain
    ASCII digits within 64-bit signed, so no query reaches the database with a value it refuses."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    digits = raw[1:] if raw[:1] in "+-" else raw
    if not (digits.isascii() and digits.isdigit()) or len(digits) > len(str(INT_MAX)):
        raise ValidationFailed("must be an integer", field=name)
    value = int(raw)
    if not INT_MIN <= value <= INT_MAX:
        raise ValidationFailed("must be a 64-bit integer", field=name)
    return value


def group_by_fields(value: str, groups: Iterable[str]) -> list[str]:
    """``?group_by=day,model`` as its names, each one of ``groups``; for a query serializer's
    ``validate_group_by`` (the usage and cost reports share it)."""
    allowed = list(groups)
    fields = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [field for field in fields if field not in allowed]
    if unknown:
        raise serializers.ValidationError(f"unknown group {unknown[0]!r} (use {', '.join(allowed)})")
    return fields


def list_body(items: list[Any], *, has_more: bool = False, **extra: Any) -> dict[str, Any]:
    """OpenAI's list object around already-serialised ``items`` (each with an ``id`` if any)."""
    ids = [item.get("id") for item in items if isinstance(item, dict)]
    return {
        "object": "list",
        "data": items,
        "has_more": has_more,
        "first_id": ids[0] if ids else None,
        "last_id": ids[-1] if ids else None,
        **extra,
    }


def _ordering(queryset: QuerySet) -> list[str]:
    fields = [str(field) for field in (queryset.query.order_by or queryset.model._meta.ordering or [])]
    if not any(field.lstrip("-") in {"id", "pk"} for field in fields):
        fields.append("-id" if fields and fields[-1].startswith("-") else "id")
    return fields


def rows_after(queryset: QuerySet, after: int, *, field: str = "after") -> QuerySet:
    """The rows of ``queryset`` that come after the row ``after`` in its ordering (keyset); a
    cursor before the whole list (the module docstring says which) gives every row."""
    fields = _ordering(queryset)
    if after < 1:
        return queryset.order_by(*fields)
    names = [name.lstrip("-") for name in fields]
    anchor = queryset.filter(pk=after).values(*names).first()
    if anchor is None:
        if fields in (["id"], ["pk"]) and not queryset.filter(pk__lte=after).exists():
            return queryset.order_by(*fields)  # below the first id of an id-ordered list
        raise ValidationFailed(f"no item with id {after} in this list", field=field)
    # A null ordering value has no "beyond" here (lists order by non-null columns, ending in id).
    condition = Q()
    ties: dict[str, Any] = {}
    for name in fields:
        column = name.lstrip("-")
        if anchor[column] is not None:
            condition |= Q(**ties, **{f"{column}__{'lt' if name.startswith('-') else 'gt'}": anchor[column]})
            ties[column] = anchor[column]
        else:
            ties[f"{column}__isnull"] = True
    return queryset.filter(condition).order_by(*fields)


def page_of(queryset: QuerySet, request: Request) -> tuple[list[Any], bool]:
    """One page of ``queryset`` for ``?after=&limit=``, and whether more rows follow."""
    limit = int_query_param(request, "limit", DEFAULT_LIMIT)
    if limit is None or not 1 <= limit <= MAX_LIMIT:
        raise ValidationFailed(f"must be between 1 and {MAX_LIMIT}", field="limit")
    after = int_query_param(request, "after", None)
    ordered = queryset.order_by(*_ordering(queryset))
    if after is not None:
        ordered = rows_after(ordered, after)
    rows = list(ordered[: limit + 1])
    return rows[:limit], len(rows) > limit


class OpenAIListPagination(BasePagination):
    """DRF's hook for the shape above (the settings' ``DEFAULT_PAGINATION_CLASS``)."""

    def paginate_queryset(self, queryset: Any, request: Request, view: Any = None) -> list[Any]:
        page, self.has_more = page_of(queryset, request)
        return page

    def get_paginated_response(self, data: Any) -> Response:
        return Response(list_body(list(data), has_more=self.has_more))

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["object", "data", "has_more"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": schema,
                "has_more": {"type": "boolean"},
                "first_id": {"type": "integer", "nullable": True},
                "last_id": {"type": "integer", "nullable": True},
            },
        }

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        return [
            {
                "name": "after",
                "required": False,
                "in": "query",
                "description": "id of the last item of the previous page (0: from the start)",
                "schema": {"type": "integer"},
            },
            {
                "name": "limit",
                "required": False,
                "in": "query",
                "description": f"items per page, 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT})",
                "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
            },
        ]
