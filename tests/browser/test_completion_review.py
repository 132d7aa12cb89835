"""Reviewing stored completions in Chromium: the list, one completion rated with thumbs up, the list
filtered to the rated one, and a selection made into a task set; a conversation's turns and their
token join on a turn's page, the whole conversation rated there."""

from __future__ import annotations

import pytest

from projects import services
from projects.models import CompletionFeedback, TaskSet
from tests.browser.test_charts import setup, sign_in, web  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_reviewer_rates_a_completion_and_makes_a_task_set_of_a_selection(browser, web, setup):  # noqa: F811
    team = setup.project.team
    for i, (question, reply) in enumerate([("Capital of France?", "Paris"), ("Capital of Italy?", "Milan"),
                                           ("Capital of Spain?", "Madrid")]):  # fmt: skip
        services.stored_completion_create(
            team_id=team.pk, completion_id=f"chatcmpl-b{i}", api_key_id=None, model="charts/agent:prod",
            served_by="charts/agent:3", checkpoint_id=None, stream=False, metadata={"answer": reply},
            conversation_id="", request={"messages": [{"role": "user", "content": question}]},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                   "finish_reason": "stop", "logprobs": None}]},
            prompt_token_ids=[1, 2], token_ids=[[3]], logprobs=[[-0.5]], latency_ms=40,
        )  # fmt: skip
    sign_in(browser, web)
    page = browser.page
    page.goto(f"{web.url}/completions/")
    assert page.locator("table.completions tbody tr").count() == 3
    page.locator("table.completions tbody tr", has_text="Capital of Italy?").locator("a").first.click()
    page.wait_for_url(f"{web.url}/completions/chatcmpl-b1/")
    assert "Milan" in page.locator("ol.transcript").inner_text()
    page.click("button[aria-label='Thumbs down']")
    page.wait_for_url(f"{web.url}/completions/chatcmpl-b1/")
    assert page.locator("table.feedback tbody tr").first.inner_text().startswith("0.000")
    assert [(f.value, f.source) for f in CompletionFeedback.objects.all()] == [(0.0, "dashboard")]

    page.goto(f"{web.url}/completions/?rated=yes")
    assert page.locator("table.completions tbody tr").count() == 1
    page.goto(f"{web.url}/completions/?rated=no")
    for row in page.locator("input[name=completion]").all():
        row.check()
    page.fill("input[name=name]", "from-traffic")
    page.click("text=Make task set")
    page.wait_for_url(f"{web.url}/task-sets/*/")
    task_set = TaskSet.objects.get(name="from-traffic")
    assert task_set.row_count == 2 and sorted(task_set.source["completion_ids"]) == [
        "chatcmpl-b0",
        "chatcmpl-b2",
    ]
    assert browser.console_errors == []


def test_a_conversations_turns_show_on_its_page_and_it_is_rated_whole(browser, web, setup):  # noqa: F811
    team = setup.project.team
    ask = [{"role": "user", "content": "2+2?"}]
    turns = [("chatcmpl-v1", ask, "4", [1, 2], [3, 4]),
             ("chatcmpl-v2", [*ask, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
              "6", [1, 2, 3, 4, 9], [5])]  # fmt: skip
    for completion_id, messages, reply, prompt_ids, ids in turns:
        services.stored_completion_create(
            team_id=team.pk, completion_id=completion_id, api_key_id=None, model="charts/agent:3",
            served_by="charts/agent:3", checkpoint_id=None, stream=False, metadata={"conversation_id": "talk"},
            conversation_id="talk", request={"messages": messages},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                   "finish_reason": "stop", "logprobs": None}]},
            prompt_token_ids=prompt_ids, token_ids=[ids], logprobs=[[-0.5] * len(ids)], latency_ms=40,
        )  # fmt: skip
    sign_in(browser, web)
    page = browser.page
    page.goto(f"{web.url}/completions/chatcmpl-v2/")
    rows = page.locator("table.turns tbody tr")
    assert rows.count() == 2 and "5–6" in rows.nth(1).inner_text() and "2–4" in rows.nth(0).inner_text()
    page.click("button[aria-label='Conversation thumbs up']")
    page.wait_for_url(f"{web.url}/completions/chatcmpl-v2/")
    assert [(f.value, f.conversation_id) for f in CompletionFeedback.objects.all()] == [(1.0, "talk")]
    rows.nth(0).locator("a").click()
    page.wait_for_url(f"{web.url}/completions/chatcmpl-v1/")
    assert page.locator("dd.reward").inner_text() == "1.000"
    assert browser.console_errors == []
