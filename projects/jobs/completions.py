"""Grading stored completions in the background (projects.models.CompletionGrading): the job's
reward definition over the completions its filters select, newest first, up to its limit.
Completions that share a prompt are one group (``grade_group``), so RULER and any grader that
compares a group rank them against each other; each graded completion gets a CompletionFeedback
``grader:<reward name> v<version>``, which becomes its reward. A sample the grader fails on is
counted in ``errors`` and gets no feedback. Progress is saved after every group."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from typing import Any

from django.utils import timezone

from projects import selectors, services
from projects.errors import ValidationFailed
from projects.grader_secrets import grader_for_build
from projects.models import CompletionGrading, GradingStatus, StoredCompletion
from projects.outbound import outbound_policy
from projects.services import judges
from training.rewards import GraderSetupError, Sample, build_grader, grade_group

log = logging.getLogger(__name__)


def _sample(row: StoredCompletion) -> tuple[str, Sample]:
    """The prompt's key (its messages as JSON) and the completion as a grader sees it."""
    messages = row.sent_messages
    choices = row.response.get("choices") or [{}]
    reply = (choices[0].get("message") or {}) if isinstance(choices[0], dict) else {}
    content = reply.get("content")
    text = content if isinstance(content, str) else ""
    return json.dumps(messages, sort_keys=True), Sample(output_text=text, messages=[*messages, reply])


def grade(grading_id: int) -> str:
    # Claimed by one conditional update, so a message delivered twice grades once.
    if not CompletionGrading.objects.filter(pk=grading_id, status=GradingStatus.QUEUED).update(
        status=GradingStatus.RUNNING
    ):
        return "skipped"
    grading = CompletionGrading.objects.select_related("team", "reward").get(pk=grading_id)
    team, reward = grading.team, grading.reward
    try:
        grader = build_grader(
            grader_for_build(reward.spec),
            judge=judges.judge_client(team=team, name=grading.judge_endpoint or None),
            sandbox=judges.sandbox_config(team_id=team.pk),
            outbound=outbound_policy(),
        )
    except (GraderSetupError, ValidationFailed) as exc:
        return _fail(grading, f"the grader cannot be built: {exc}")
    filters = grading.filters
    rows = list(
        selectors.stored_completions(team=team, model=filters.get("model"), metadata=filters.get("metadata") or {},
                                     rated=filters.get("rated"), descending=True)[: grading.limit]
    )  # fmt: skip
    groups: dict[str, list[tuple[StoredCompletion, Sample]]] = defaultdict(list)
    for row in rows:
        key, sample = _sample(row)
        groups[key].append((row, sample))
    rewards: list[float] = []
    source = f"grader:{reward.name} v{reward.version}"[:100]
    for members in groups.values():
        items: list[dict[str, Any]] = [dict(row.metadata) for row, _ in members]  # the grader's item
        try:
            results = grade_group(grader, [sample for _, sample in members], items)
        except Exception as exc:  # noqa: BLE001 (a grader's failure is the job's, reported)
            log.warning("grading %s: a group failed: %s", grading.pk, exc)
            grading.errors += len(members)
            grading.save(update_fields=["errors"])
            continue
        for (row, _), result in zip(members, results, strict=True):
            if result.errors:
                grading.errors += 1
                continue
            services.feedback_add(team=team, value=float(result.reward), completion=row, source=source,
                                  label="grader", comment="")  # fmt: skip
            rewards.append(float(result.reward))
        grading.graded = len(rewards)
        grading.save(update_fields=["graded", "errors"])
    grading.mean_reward = sum(rewards) / len(rewards) if rewards else None
    grading.status = GradingStatus.SUCCEEDED
    grading.finished_at = timezone.now()
    grading.save(update_fields=["mean_reward", "status", "finished_at", "graded", "errors"])
    return "succeeded"


def _fail(grading: CompletionGrading, message: str) -> str:
    grading.status, grading.error, grading.finished_at = GradingStatus.FAILED, message[:2000], timezone.now()
    grading.save(update_fields=["status", "error", "finished_at"])
    return "failed"
