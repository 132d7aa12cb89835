"""Constrained decoding on the tiny random model (the best adversary: it has no idea what JSON
is): every constrained completion is JSON valid against its schema, whatever the seed, at
temperature 1; a grammar row does not disturb the rows without one; logprobs are those of the
masked distribution the token was sampled from."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from training.engines.base import SamplingParams
from training.engines.grammar import GrammarError, json_grammar
from training.engines.transformers_engine import TransformersEngine

# Bounded on purpose: a random model would fill an unbounded string until max_tokens.
VERDICT = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["yes", "no", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "passed": {"type": "boolean"},
        "why": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["verdict", "score", "confidence", "passed", "why", "tags"],
    "additionalProperties": False,
}
HELLO = [{"role": "user", "content": "Judge this: is the sky green?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> TransformersEngine:
    from training.base_models import load_base_model

    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    return TransformersEngine(model, tokenizer)


@pytest.mark.parametrize("seed", range(6))
def test_a_json_schema_completion_is_valid_json_of_the_schema_at_temperature_one(engine, seed):
    grammar = json_grammar(VERDICT)
    prompt = engine.render(HELLO)
    choices = engine.generate_from_tokens(
        [prompt] * 2, SamplingParams(temperature=1.0, max_new_tokens=300, seed=seed), grammars=[grammar] * 2
    )
    for choice in choices:
        assert choice.finish_reason == "stop"  # the grammar completed, not the budget
        jsonschema.validate(json.loads(choice.text), VERDICT)
        assert choice.text == engine.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert len(choice.logprobs) == len(choice.token_ids)
        assert all(-1e9 < logprob <= 1e-6 for logprob in choice.logprobs)


def test_json_object_gives_json_objects_or_a_prefix_of_one_when_cut_short(engine):
    # "Any object" lets a random model write keys for ever: some rows run out of tokens.
    prompt, grammar = engine.render(HELLO), json_grammar(None)
    choices = engine.generate_from_tokens(
        [prompt] * 12, SamplingParams(temperature=1.0, max_new_tokens=300, seed=0), grammars=[grammar] * 12
    )
    finished = [choice for choice in choices if choice.finish_reason == "stop"]
    assert len(finished) >= 3
    for choice in finished:
        assert isinstance(json.loads(choice.text), dict)
    for choice in choices:
        if choice.finish_reason == "length":  # every token the grammar's: a prefix of an object
            replay = engine.grammars.matchers([grammar])
            assert not any(replay.advance(0, token) for token in choice.token_ids)
            assert choice.text.startswith("{")


def test_greedy_decoding_is_constrained_too(engine):
    (choice,) = engine.generate_from_tokens(
        [engine.render(HELLO)],
        SamplingParams(temperature=0, max_new_tokens=300),
        grammars=[json_grammar(VERDICT)],
    )
    jsonschema.validate(json.loads(choice.text), VERDICT)


def test_rows_without_a_grammar_are_untouched_by_constrained_rows_in_their_batch(engine):
    prompts = [engine.render(HELLO), engine.render([{"role": "user", "content": "Hi"}])] * 2
    sampling = SamplingParams(temperature=0, max_new_tokens=24)
    free = engine.generate_from_tokens(prompts, sampling)
    grammar = json_grammar(VERDICT)
    mixed = engine.generate_from_tokens(prompts, sampling, grammars=[grammar, None, None, grammar])
    assert [c.token_ids for c in mixed[1:3]] == [c.token_ids for c in free[1:3]]
    assert [c.logprobs for c in mixed[1:3]] == [c.logprobs for c in free[1:3]]
    for choice in (mixed[0], mixed[3]):  # 24 tokens may cut the JSON short: a prefix of valid JSON
        assert choice.text.startswith("{") and choice.token_ids != free[0].token_ids


def test_logprobs_are_those_of_the_masked_distribution(engine):
    grammar = json_grammar(VERDICT)
    prompt = engine.render(HELLO)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=300, seed=11, top_logprobs=5)
    (choice,) = engine.generate_from_tokens([prompt], sampling, grammars=[grammar])
    # Teacher forcing: one pass over prompt + completion, each position masked by a fresh matcher
    # replaying the completion.
    ids = torch.tensor([prompt + choice.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    replay = engine.grammars.matchers([grammar])
    raised = 0
    for position, token in enumerate(choice.token_ids):
        row = logits[position : position + 1]
        masked = torch.log_softmax(replay.mask_logits(row, [False]) / 0.8, dim=-1)[0]
        plain = torch.log_softmax(row / 0.8, dim=-1)[0]
        assert choice.logprobs[position] == pytest.approx(float(masked[token]), abs=1e-4)
        assert choice.logprobs[position] >= float(plain[token]) - 1e-5  # renormalised over fewer tokens
        raised += choice.logprobs[position] > float(plain[token]) + 1e-3
        alternatives = choice.top_logprobs[position]
        assert alternatives and all(masked[other] > float("-inf") for other, _ in alternatives)
        assert [other for other, _ in alternatives][0] == int(masked.argmax())
        replay.advance(0, token)
    assert raised > 0


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        ({"type": "colour"}, "colour"),
        ({"$ref": "#/definitions/missing"}, "missing"),
        ({"type": "string", "format": "not-a-format"}, "not-a-format"),
    ],
)
def test_a_schema_that_cannot_be_compiled_says_why(engine, schema, reason):
    with pytest.raises(GrammarError, match=reason):
        engine.check_grammar(json_grammar(schema))


def test_streamed_tokens_of_a_constrained_row_join_to_its_json(engine):
    events = []
    (choice,) = engine.generate_from_tokens(
        [engine.render(HELLO)], SamplingParams(temperature=1.0, max_new_tokens=300, seed=2),
        on_token=events.append, grammars=[json_grammar(VERDICT)],
    )  # fmt: skip
    assert "".join(event.text for event in events) == choice.text
    assert [event.finish_reason for event in events][-1] == "stop"
    jsonschema.validate(json.loads(choice.text), VERDICT)


def test_arts_ruler_schema_as_pydantic_and_the_openai_client_write_it_compiles(engine):
    from openai.lib._parsing._completions import type_to_response_format_param
    from pydantic import BaseModel

    class TrajectoryScore(BaseModel):  # ART's RULER reply model (art/rewards/ruler.py)
        trajectory_id: str
        explanation: str
        score: float

    class Response(BaseModel):
        scores: list[TrajectoryScore]

    schema = type_to_response_format_param(Response)["json_schema"]["schema"]
    assert "$defs" in schema  # nested models come as $ref: the grammar must resolve them
    engine.check_grammar(json_grammar(schema))
