"""Reads of a team's OpenAI-compatible endpoints."""

from __future__ import annotations

from django.db.models import QuerySet

from projects.models import JudgeEndpoint, Team


def judge_endpoints(*, team: Team) -> QuerySet[JudgeEndpoint]:
    """The team's OpenAI-compatible endpoints (judges, scenario writers, evaluation references)."""
    return JudgeEndpoint.objects.filter(team=team).order_by("name")
