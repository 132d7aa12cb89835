"""RULER over stored completions (projects.jobs.completions): completions that share a prompt are
one group the judge ranks in one call, the shared prompt sent once; each score becomes the
completion's feedback and reward. The judge is the scripted OpenAI-compatible server of the grader
tests, a real HTTP server on loopback, reached through the team's judge endpoint."""

from __future__ import annotations

import json
import re

import pytest

from projects import services
from projects.jobs import completions as completion_jobs
from projects.models import CompletionFeedback, StoredCompletion
from tests.factories import RewardDefinitionFactory
from tests.training.rewards.conftest import _judge_http_server, completion, judge_server  # noqa: F401

pytestmark = pytest.mark.django_db

RULER = {"type": "ruler", "name": "ruler", "model": "judge-model", "rubric": "Prefer the right capital.",
         "sampling_params": {"temperature": 0}}  # fmt: skip


def ask(team, completion_id: str, question: str, answer: str) -> None:
    services.stored_completion_create(
        team_id=team.pk, completion_id=completion_id, api_key_id=None, model="math/agent:1",
        served_by="math/agent:1", checkpoint_id=None, stream=False, metadata={"channel": "web"},
        conversation_id="", request={"messages": [{"role": "user", "content": question}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                               "finish_reason": "stop", "logprobs": None}]},
        prompt_token_ids=[1], token_ids=[[2]], logprobs=[[-0.1]], latency_ms=1,
    )  # fmt: skip


def scores(body: dict) -> dict:
    """The judge: each trajectory of the request scored 1.0 when it names a capital it should."""
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    entries = []
    for number, messages in re.findall(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', user, re.S):
        text = json.dumps(json.loads(messages))
        right = "Paris" in text or "Rome" in text
        entries.append({"trajectory_id": number, "explanation": "named" if right else "wrong", "score":
                        1.0 if right else 0.1})  # fmt: skip
    return completion(json.dumps({"scores": entries}), prompt_tokens=100, completion_tokens=20)


def test_ruler_ranks_each_prompts_stored_completions_as_one_group(cast, alpha_setup, judge_server):  # noqa: F811
    services.judge_endpoint_create(team=cast.alpha, name="default", base_url=judge_server.url, api_key="sk-j")
    judge_server.reply = scores
    for i, answer in enumerate(["Paris", "Lyon", "Paris, I think"]):
        ask(cast.alpha, f"chatcmpl-fr{i}", "Capital of France?", answer)
    for i, answer in enumerate(["Rome", "Milan"]):
        ask(cast.alpha, f"chatcmpl-it{i}", "Capital of Italy?", answer)
    ask(cast.beta, "chatcmpl-beta", "Capital of France?", "Lyon")  # another team's: never sent
    reward = RewardDefinitionFactory(project=alpha_setup.project, name="ruler", spec=RULER)
    grading = services.completion_grading_create(team=cast.alpha, reward=reward, filters={}, limit=100)
    assert completion_jobs.grade(grading.pk) == "succeeded"

    assert len(judge_server.requests) == 2  # one call per prompt's group
    france = next(r for r in judge_server.requests if "France" in json.dumps(r))
    user = next(m["content"] for m in france["messages"] if m["role"] == "user")
    assert user.count("Capital of France?") == 1 and user.count("<trajectory id=") == 3  # prompt once
    assert "chatcmpl-beta" not in json.dumps(judge_server.requests) and "Lyon" in user
    rewards = dict(StoredCompletion.objects.filter(team=cast.alpha).values_list("completion_id", "reward"))
    assert rewards == {"chatcmpl-fr0": 1.0, "chatcmpl-fr1": 0.1, "chatcmpl-fr2": 1.0,
                       "chatcmpl-it0": 1.0, "chatcmpl-it1": 0.1}  # fmt: skip
    assert StoredCompletion.objects.get(completion_id="chatcmpl-beta").reward is None
    assert set(CompletionFeedback.objects.values_list("source", flat=True)) == {"grader:ruler v1"}
    grading.refresh_from_db()
    assert (grading.status, grading.graded, grading.errors) == ("succeeded", 5, 0)
