"""TransformersEngine's per-token callback (what the inference server streams) and its top-k
logprobs, on the tiny model: the callback changes nothing about what is sampled, its text deltas
join to the final text without ever showing half a character or anything past a stop string, and
the top alternatives are those of a teacher-forced pass over the same tokens."""

from __future__ import annotations

import pytest
import torch

from training.engines.base import SamplingParams, TextDeltas, TokenDelta
from training.engines.transformers_engine import TransformersEngine


def prompts(engine: TransformersEngine) -> list[list[int]]:
    return [
        engine.render([{"role": "user", "content": "Hello! How are you today?"}]),
        engine.render([{"role": "user", "content": "Say something long."}]),
        engine.render([{"role": "user", "content": "x"}]),
    ]


@pytest.mark.parametrize("stop", [[], ["e"], ["th", " a"]])
def test_token_callback_streams_every_token_and_its_deltas_join_to_the_text(engine, stop):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5, stop=stop, top_logprobs=3)
    plain = engine.generate_from_tokens(prompts(engine), sampling)
    events: list[TokenDelta] = []
    streamed = engine.generate_from_tokens(prompts(engine), sampling, on_token=events.append)
    assert [(c.token_ids, c.text, c.logprobs, c.finish_reason, c.top_logprobs) for c in streamed] == [
        (c.token_ids, c.text, c.logprobs, c.finish_reason, c.top_logprobs) for c in plain
    ]
    for index, choice in enumerate(streamed):
        mine = [event for event in events if event.index == index]
        assert [event.token_id for event in mine] == choice.token_ids
        assert [event.logprob for event in mine] == choice.logprobs
        assert [event.top_logprobs for event in mine] == choice.top_logprobs
        assert "".join(event.text for event in mine) == choice.text
        assert [event.finish_reason for event in mine] == [None] * (len(mine) - 1) + [choice.finish_reason]
        shown = ""
        for event in mine:
            shown += event.text
            # Never taken back: what is shown is always the start of the final text (the random
            # model also writes invalid UTF-8, which stays U+FFFD in the final text too).
            assert choice.text.startswith(shown)
            assert not any(s in shown for s in stop)  # nothing at or past a stop string


def test_rows_are_reported_step_by_step_not_after_the_batch(engine):
    events: list[TokenDelta] = []
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1)
    engine.generate_from_tokens(prompts(engine), sampling, on_token=events.append)
    # Rows interleave: row 0's second token comes after every live row's first.
    first_of_row_2 = next(i for i, e in enumerate(events) if e.index == 2)
    second_of_row_0 = [i for i, e in enumerate(events) if e.index == 0][1]
    assert first_of_row_2 < second_of_row_0


def test_text_deltas_hold_back_split_characters_and_possible_stop_prefixes(engine):
    tokenizer = engine.tokenizer
    text = "héllo wörld ✓ done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.encode()) // 2  # non-ASCII is split into byte tokens here
    deltas = TextDeltas(stop=[])
    pieces = [deltas.update(tokenizer.decode(ids[:end])) for end in range(1, len(ids))]
    pieces.append(deltas.finish(tokenizer.decode(ids)))
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)

    deltas = TextDeltas(stop=["STOP"])
    assert deltas.update("abc ST") == "abc "  # "ST" may begin the stop string
    assert deltas.update("abc STA") == "STA"
    assert deltas.update("abc STA S") == " "
    assert deltas.finish("abc STA ") == ""  # the final text is cut before "STOP"
    assert deltas.emitted == "abc STA "


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_top_logprobs_are_the_teacher_forced_top_k(engine, temperature):
    k = 5
    prompt = prompts(engine)[0]
    sampling = SamplingParams(temperature=temperature, max_new_tokens=10, seed=3, top_logprobs=k)
    (choice,) = engine.generate_from_tokens([prompt], sampling)
    assert choice.top_logprobs is not None and len(choice.top_logprobs) == len(choice.token_ids)

    ids = torch.tensor([prompt + choice.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    for position, alternatives in enumerate(choice.top_logprobs):
        assert len(alternatives) == k
        values = [logprob for _, logprob in alternatives]
        assert values == sorted(values, reverse=True)
        kth_best = expected[position].topk(k).values[-1].item()
        for token_id, logprob in alternatives:
            assert logprob == pytest.approx(expected[position, token_id].item(), abs=1e-4)
            assert logprob >= kth_best - 1e-4  # truly among the k most likely
        sampled = choice.token_ids[position]
        assert choice.logprobs[position] == pytest.approx(expected[position, sampled].item(), abs=1e-4)
    if temperature == 0:  # greedy: the sampled token is the top alternative
        assert [alts[0][0] for alts in choice.top_logprobs] == choice.token_ids
