"""`response_format` end to end: the real `openai` client, the gateway under uvicorn and
`manage.py serve_inference` on the tiny random model. The client's own structured-output helper
(`chat.completions.parse` with a pydantic model, which sends a strict json_schema) gets a parsed
object back; a streamed json_schema reply joins to valid JSON; a schema the server cannot compile
is the client's BadRequestError naming response_format."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.projects.gateway.conftest import BASE_MODEL, Process, register_base_model, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

QUESTION = [{"role": "user", "content": "Is the sky green? Answer in JSON."}]


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    score: float = Field(ge=0, le=1)
    reason: str = Field(max_length=16)  # bounded: a random model would fill an open string


@pytest.fixture
def live(tiny_model_dir, inference_server, gateway) -> Process:
    from projects.models import InferenceServer

    register_base_model(tiny_model_dir)
    wait_for(lambda: InferenceServer.objects.filter(url=inference_server.url).exists(), timeout=10,
             what="the inference server's heartbeat")  # fmt: skip
    return gateway


def client(gateway: Process, key: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=120)


def test_the_openai_clients_structured_output_helper_gets_a_parsed_object(live, alpha_key):
    api = client(live, alpha_key)
    for seed in (0, 1, 2):
        reply = api.chat.completions.parse(
            model=BASE_MODEL, messages=QUESTION, response_format=Verdict, max_tokens=200, temperature=1.0,
            seed=seed, logprobs=True,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Verdict)
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)


def test_a_streamed_json_schema_reply_joins_to_valid_json(live, alpha_key):
    schema = {**Verdict.model_json_schema(), "additionalProperties": False}  # else any other keys too
    stream = client(live, alpha_key).chat.completions.create(
        model=BASE_MODEL, messages=QUESTION, max_tokens=200, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "Verdict", "schema": schema}},
    )  # fmt: skip
    chunks = [chunk for chunk in stream if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_schema_the_server_cannot_compile_is_a_bad_request_naming_response_format(live, alpha_key):
    with pytest.raises(openai.BadRequestError) as error:
        client(live, alpha_key).chat.completions.create(
            model=BASE_MODEL, messages=QUESTION, max_tokens=20,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "colour"}}},
        )  # fmt: skip
    assert error.value.body["param"] == "response_format"
    assert "colour" in error.value.body["message"]


def test_the_gateway_serves_as_judge_for_the_ruler_and_score_model_graders(live, alpha_key):
    from tests.openai_stub import LOOPBACK
    from training.rewards import JudgeClient, Sample, build_grader, grade_group

    judge = JudgeClient(base_url=f"{live.url}/v1", api_key=alpha_key, outbound=LOOPBACK, timeout=120)
    score = build_grader(
        {"type": "score_model", "model": BASE_MODEL, "response_format": "json_schema", "range": [0, 1],
         "input": [{"role": "user", "content": "Score this answer from 0 to 1: {{sample.output_text}}"}],
         "sampling_params": {"seed": 1, "max_completions_tokens": 64}},
        judge=judge,
    )  # fmt: skip
    results = [score.grade(Sample(output_text=text), {}) for text in ("Paris", "Lyon", "Rome")]
    assert all(result.errors == [] and 0 <= result.reward <= 1 for result in results)
    ruler = build_grader({"type": "ruler", "model": BASE_MODEL, "sampling_params": {"max_completions_tokens": 48}},
                         judge=judge)  # fmt: skip
    samples = [Sample(output_text=text, messages=[{"role": "assistant", "content": text}]) for text in "ab"]
    grade_group(ruler, samples, {})  # a random model's explanation may outrun 48 tokens: not asserted
    assert judge.plain_text_models == set()  # the gateway took both graders' response_format
