"""Every OpenAI grader type, in the shapes of OpenAI's graders guide and API reference, through
`POST /v1/fine_tuning/alpha/graders/validate` and `/run` with the real `openai` client, and accepted
as a fine-tuning job's `method.reinforcement.grader`. The judge graders call the team's judge
endpoint (a loopback stub); the endpoint grader a loopback endpoint."""

from __future__ import annotations

import copy

import pytest

from projects import services
from tests.grader_endpoint_stub import grader_endpoint
from tests.openai_stub import openai_stub
from tests.projects.api.test_fine_tuning_api import (  # noqa: F401 - the fixture is used by name
    RL_ROWS,
    _connection_kept_open,
    client_for,
    upload,
)

pytestmark = pytest.mark.django_db

# The API reference's examples (graders/run, graders/validate) and the graders guide's, as given
# there (OpenAI's own model names are kept: the team's judge endpoint answers for them).
STRING_CHECK = {
    "type": "string_check",
    "name": "Example string check grader",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
    "operation": "eq",
}
TEXT_SIMILARITY = {
    "type": "text_similarity",
    "name": "Example text similarity grader",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
    "evaluation_metric": "fuzzy_match",
}
PYTHON = {
    "type": "python",
    "name": "Example python grader",
    "image_tag": "2025-05-08",
    "source": (
        "def grade(sample, item) -> float:\n"
        "    output_text = sample['output_text']\n"
        "    reference_answer = item['reference_answer']\n"
        "    return 1.0 if output_text.strip().lower() == reference_answer.strip().lower() else 0.0\n"
    ),
}
SCORE_MODEL = {
    "type": "score_model",
    "name": "Example score model grader",
    "input": [
        {
            "role": "user",
            "content": (
                "Score how close the reference answer is to the model answer. Score 1.0 if they are "
                "the same and 0.0 if they are different. Return just a floating point score\n\n"
                "Reference answer: {{item.reference_answer}}\n\nModel answer: {{sample.output_text}}"
            ),
        }
    ],
    "model": "gpt-4o-2024-08-06",
    "range": [0, 1],
    "sampling_params": {"temperature": 1, "top_p": 1, "seed": 42},
}
LABEL_MODEL = {
    "type": "label_model",
    "name": "First label grader",
    "model": "o3-mini-2024-01-31",
    "input": [
        {
            "role": "developer",
            "content": "Classify the sentiment of the following statement as one of 'positive', 'neutral', or 'negative'",
        },
        {"role": "user", "content": "Statement: {{sample.output_text}}"},
    ],
    "passing_labels": ["positive"],
    "labels": ["positive", "neutral", "negative"],
}
MULTI = {
    "type": "multi",
    "name": "Example multi grader",
    "graders": {
        "name": {
            "name": "name_grader",
            "type": "text_similarity",
            "input": "{{sample.output_json.name}}",
            "reference": "{{item.name}}",
            "evaluation_metric": "fuzzy_match",
        },
        "email": {
            "name": "email_grader",
            "type": "string_check",
            "input": "{{sample.output_json.email}}",
            "reference": "{{item.email}}",
            "operation": "eq",
        },
    },
    "calculate_output": "(name + email) / 2",
}
FUZZY = "fuzzy wuzzy was a bear"

# (grader, model_sample, item, what the judge stub answers, expected reward)
EXAMPLES = {
    "string_check": (STRING_CHECK, FUZZY, {"reference_answer": FUZZY}, None, 1.0),
    "text_similarity": (TEXT_SIMILARITY, FUZZY, {"reference_answer": FUZZY}, None, 1.0),
    "python": (PYTHON, "Fuzzy Wuzzy was a bear ", {"reference_answer": FUZZY}, None, 1.0),
    "score_model": (SCORE_MODEL, FUZZY, {"reference_answer": FUZZY}, "1.0", 1.0),
    "label_model": (LABEL_MODEL, "I love this!", {}, "positive", 1.0),
    "multi": (
        MULTI,
        '{"name": "Ada Lovelace", "email": "ada@example.com"}',
        {"name": "Ada Lovelace", "email": "ada@example.org"},
        None,
        0.5,
    ),
}


@pytest.fixture
def judge(cast):
    with openai_stub([]) as stub:
        services.judge_endpoint_create(team=cast.alpha, name="default", base_url=stub.url, api_key="sk-judge")
        yield stub


@pytest.mark.parametrize("grader_type", list(EXAMPLES))
def test_openais_example_grader_validates_and_runs(grader_type, alpha_key, judge):
    grader, model_sample, item, judge_reply, reward = copy.deepcopy(EXAMPLES[grader_type])
    judge.replies = [judge_reply] if judge_reply is not None else []
    client = client_for(alpha_key)
    valid = client.fine_tuning.alpha.graders.validate(grader=grader)
    assert valid.grader.type == grader_type and valid.grader.name == grader["name"]
    result = client.fine_tuning.alpha.graders.run(grader=grader, model_sample=model_sample, item=item)
    assert result.reward == pytest.approx(reward), result.metadata
    assert result.metadata.type == grader_type and result.metadata.name == grader["name"]
    assert not any(value is True for value in result.metadata.errors.model_dump().values())
    if judge_reply is not None:  # the team's judge was asked, for the model the grader names
        (request,) = judge.requests
        assert request["model"] == grader["model"]
        assert result.model_grader_token_usage_per_model[grader["model"]]["total_tokens"] == 15
    if grader_type == "multi":
        assert result.sub_rewards == {"name": 1.0, "email": 0.0}


def test_openais_multi_example_reports_each_sub_reward_by_key(alpha_key):
    grader, model_sample, item, _, _ = copy.deepcopy(EXAMPLES["multi"])
    right = {**item, "email": "ada@example.com"}
    result = client_for(alpha_key).fine_tuning.alpha.graders.run(
        grader=grader, model_sample=model_sample, item=right
    )
    assert result.reward == 1.0 and result.sub_rewards == {"name": 1.0, "email": 1.0}


@pytest.mark.parametrize("grader_type", [*EXAMPLES, "endpoint"])
def test_every_grader_type_is_a_reinforcement_jobs_grader(grader_type, alpha_key, tiny_model_dir):
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    client = client_for(alpha_key)
    training_file = upload(client, [{**row, "reference_answer": row["answer"]} for row in RL_ROWS])
    with grader_endpoint() as endpoint:
        grader = (
            {"type": "endpoint", "name": "checker", "url": endpoint.url}
            if grader_type == "endpoint"
            else copy.deepcopy(EXAMPLES[grader_type][0])
        )
        job = client.fine_tuning.jobs.create(
            model="tiny",
            training_file=training_file.id,
            method={"type": "reinforcement", "reinforcement": {"grader": grader}},
        )
    echoed = client.fine_tuning.jobs.retrieve(job.id).method.reinforcement.grader
    assert echoed.type == grader_type and echoed.name == grader["name"]
