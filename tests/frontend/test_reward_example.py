"""The reward editor's "Try it" panel is prefilled with an item its own grader can read: a real
row of the reward's (or the project's) task sets when one has every ``{{item.…}}`` field, else an
item made of those fields. Checked by sending what app.js sends (the editor's spec, the sample
and the item as the page prefills them) to ``POST /api/v1/graders/run``."""

from __future__ import annotations

import html
import json
import re

import pytest

from artweb.demo import REWARD_SPEC
from projects import selectors, services
from tests import factories
from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db


def textarea(page: str, attribute: str) -> str:
    match = re.search(rf"<textarea[^>]*{attribute}[^>]*>(.*?)</textarea>", page, re.S)
    assert match, attribute
    return html.unescape(match.group(1)).strip("\n")


def dry_run_as_prefilled(client, reward) -> tuple[dict, dict]:
    """The page's prefilled item, and the answer to the request app.js sends on "Grade"."""
    page = client.get(f"/rewards/{reward.pk}/").content.decode()
    item = json.loads(textarea(page, 'id="try-item"'))
    payload = {
        "grader": json.loads(textarea(page, 'name="spec"')),
        "model_sample": textarea(page, 'id="try-sample"'),
        "item": item,
    }
    answer = client.post("/api/v1/graders/run", json.dumps(payload), content_type="application/json")
    assert answer.status_code == 200, answer.content
    return item, answer.json()


def test_the_demo_rewards_dry_run_works_on_a_row_of_its_project(cast, alpha_setup):
    rows = [{"prompt": "Capital of France?", "item": {"answer": "Paris", "accept": "Paris"}}]
    factories.TaskSetFactory(project=alpha_setup.project, name="capitals", rows=rows, validation_fraction=0)
    reward = services.reward_definition_create(project=alpha_setup.project, name="demo", spec=REWARD_SPEC)
    item, answer = dry_run_as_prefilled(client_for(cast.alice), reward)
    assert item == rows[0]["item"]
    assert answer["metadata"]["error_details"] == [], answer
    assert answer["reward"] == 0.5  # "The answer is Paris": correct, not exact
    assert (
        "row 0 of task set “capitals”"
        in client_for(cast.alice).get(f"/rewards/{reward.pk}/").content.decode()
    )


def test_without_a_matching_row_the_item_is_made_from_the_specs_fields(cast, alpha_setup):
    # alpha's task set rows have only item.answer; the demo's grader reads item.accept.
    reward = services.reward_definition_create(project=alpha_setup.project, name="demo", spec=REWARD_SPEC)
    item, answer = dry_run_as_prefilled(client_for(cast.alice), reward)
    assert item == {"accept": "42"}
    assert answer["metadata"]["error_details"] == [], answer
    assert answer["reward"] == 0.5


def test_a_nested_field_is_made_as_a_nested_item(cast, alpha_setup):
    spec = {
        "type": "string_check",
        "input": "{{sample.output_text}}",
        "reference": "The answer is {{ item.expected.0 }}",
        "operation": "eq",
    }
    reward = services.reward_definition_create(project=alpha_setup.project, name="nested", spec=spec)
    item, answer = dry_run_as_prefilled(client_for(cast.alice), reward)
    assert item == {"expected": {"0": "42"}}
    assert answer["metadata"]["error_details"] == [] and answer["reward"] == 1.0, answer


def test_the_paths_read_are_every_item_template_once():
    assert selectors.reward_item_paths(REWARD_SPEC) == [("accept",)]
    spec = {"a": ["{{item.x}} and {{ item.y.z }}", {"b": "{{item.x}}{{sample.output_text}}"}]}
    assert selectors.reward_item_paths(spec) == [("x",), ("y", "z")]
