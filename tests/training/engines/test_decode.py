"""DecodeBatch (training.engines.decode): rows join and leave a live batch between steps, finished
rows cost nothing more, identical prompts are prefilled once, and a seeded row's output does not
depend on its batch-mates."""

import pytest
import torch

from training.engines.base import SamplingParams, TokenDelta
from training.engines.decode import DecodeBatch
from training.engines.transformers_engine import TransformersEngine

MESSAGES = [
    [{"role": "user", "content": "Hello! How are you today?"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "1 + 2?"}],
    [{"role": "user", "content": "Hi"}],
]


@pytest.fixture
def engine(tiny_model) -> TransformersEngine:
    model, tokenizer = tiny_model
    return TransformersEngine(model.eval(), tokenizer)


@pytest.fixture
def prompts(engine) -> list[list[int]]:
    return [engine.render(messages) for messages in MESSAGES]


class BatchSizes:
    """Rows in each forward pass of the model (read at the embedding layer)."""

    def __init__(self, model):
        self.sizes: list[tuple[int, int]] = []  # (rows, positions)
        embeddings = model.get_input_embeddings()
        self.handle = embeddings.register_forward_hook(
            lambda _m, inputs, _o: self.sizes.append(tuple(inputs[0].shape))
        )

    def decode_rows(self) -> list[int]:
        return [rows for rows, positions in self.sizes if positions == 1]


def run(batch: DecodeBatch) -> dict:
    finished = {}
    while batch.live:
        finished.update(batch.step())
    return finished


def teacher_forced(model, choice, temperature=1.0):
    ids = torch.tensor([choice.prompt_token_ids + choice.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    start = len(choice.prompt_token_ids) - 1
    positions = torch.arange(start, start + len(choice.token_ids))
    return torch.log_softmax(logits, dim=-1)[positions, torch.tensor(choice.token_ids)]


def alone(engine, prompt, sampling):
    (choice,) = engine.generate_from_tokens([prompt], sampling)
    return choice


def test_a_row_that_joins_a_running_batch_decodes_as_if_alone(engine, prompts):
    first = SamplingParams(max_new_tokens=12, seed=1)
    late = SamplingParams(max_new_tokens=6, seed=2, temperature=0.8)
    batch = DecodeBatch(engine, None)
    (early_handle,) = batch.add([prompts[1]], first)
    finished = {}
    for _ in range(4):
        finished.update(batch.step())
    # The late row's prompt is longer than the early row's cache is wide at this point, and shorter
    # than others: both sides get left padding when it joins.
    (late_handle,) = batch.add([prompts[0]], late)
    (later_handle,) = batch.add([prompts[2]], late)
    assert batch.live == 3
    finished.update(run(batch))
    for handle, prompt, sampling in [
        (early_handle, prompts[1], first),
        (late_handle, prompts[0], late),
        (later_handle, prompts[2], late),
    ]:
        choice = finished[handle]
        solo = alone(engine, prompt, sampling)
        assert choice.token_ids == solo.token_ids
        assert choice.logprobs == pytest.approx(solo.logprobs, abs=1e-5)
        expected = teacher_forced(engine.model, choice, sampling.temperature)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def test_finished_rows_leave_the_batch_so_decode_work_follows_tokens_generated(engine, prompts):
    sizes = BatchSizes(engine.model)
    batch = DecodeBatch(engine, None)
    short = batch.add(prompts[:2], SamplingParams(max_new_tokens=2, seed=0))
    long = batch.add(prompts[2:], SamplingParams(max_new_tokens=7, seed=0))
    finished_at = {}
    step = 0
    while batch.live:
        step += 1
        for handle, choice in batch.step():
            finished_at[handle] = step
            assert len(choice.token_ids) == {**dict.fromkeys(short, 2), **dict.fromkeys(long, 7)}[handle]
    sizes.handle.remove()
    assert finished_at == {short[0]: 2, short[1]: 2, long[0]: 7}
    # One prefill of 3 rows, then decode passes: 3 rows once, then the long row alone. No pass is
    # ever made after a row's last token (7 tokens need 6 decode passes).
    assert sizes.decode_rows() == [3] + [1] * 5
    assert batch.forward_rows == 3 + 3 + 5
    assert batch._cache is None and batch.step() == []


def test_a_seeded_row_does_not_depend_on_its_batch_mates(engine, prompts):
    mine = SamplingParams(max_new_tokens=10, seed=11, top_logprobs=2)
    solo = alone(engine, prompts[0], mine)
    batch = DecodeBatch(engine, None)
    batch.add([prompts[1], prompts[2]], SamplingParams(max_new_tokens=4))  # unseeded, global RNG
    (handle,) = batch.add([prompts[0]], mine)
    batch.add([prompts[2]], SamplingParams(max_new_tokens=10, seed=11, temperature=0.5))
    choice = run(batch)[handle]
    assert choice.token_ids == solo.token_ids
    assert choice.logprobs == pytest.approx(solo.logprobs, abs=1e-5)
    assert [[i for i, _ in top] for top in choice.top_logprobs] == [
        [i for i, _ in t] for t in solo.top_logprobs
    ]


def test_rows_of_one_seeded_request_draw_different_streams(engine, prompts):
    choices = engine.generate_from_tokens([prompts[0]] * 4, SamplingParams(max_new_tokens=10, seed=3))
    assert len({tuple(c.token_ids) for c in choices}) == 4
    again = engine.generate_from_tokens([prompts[0]] * 4, SamplingParams(max_new_tokens=10, seed=3))
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]


def test_shared_prompts_are_prefilled_once_with_the_same_tokens_and_logprobs(engine, prompts):
    group = [prompts[0]] * 4 + [prompts[1]] * 3 + [prompts[2]]
    sampling = SamplingParams(max_new_tokens=10, seed=5, top_logprobs=3)
    results = {}
    for share in (True, False):
        sizes = BatchSizes(engine.model)
        batch = DecodeBatch(engine, None, share_prompts=share)
        handles = batch.add(group, sampling)
        finished = run(batch)
        sizes.handle.remove()
        prefill_rows = [rows for rows, positions in sizes.sizes if positions > 1]
        results[share] = ([finished[h] for h in handles], prefill_rows)
    (shared, shared_prefill), (per_row, per_row_prefill) = results[True], results[False]
    assert shared_prefill == [3] and per_row_prefill == [8]
    for a, b in zip(shared, per_row, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert [[i for i, _ in t] for t in a.top_logprobs] == [[i for i, _ in t] for t in b.top_logprobs]
    assert len({tuple(c.token_ids) for c in shared[:4]}) > 1  # the group's rows still differ


def test_cancel_drops_a_row_at_once_and_the_others_go_on_unchanged(engine, prompts):
    sampling = SamplingParams(max_new_tokens=8, seed=4)
    expected = engine.generate_from_tokens(prompts, sampling)
    sizes = BatchSizes(engine.model)
    batch = DecodeBatch(engine, None)
    handles = batch.add(prompts, sampling)
    finished = dict(batch.step())
    batch.cancel(handles[1])
    batch.cancel(handles[1])  # not live any more: ignored
    assert batch.live == 2
    finished.update(run(batch))
    sizes.handle.remove()
    assert handles[1] not in finished
    assert sizes.decode_rows() == [2] * 7
    for position in (0, 2):
        assert finished[handles[position]].token_ids == expected[position].token_ids
    queued = batch.add([prompts[0]], sampling)
    batch.cancel(queued[0])  # still queued: never prefilled
    assert batch.live == 0 and batch.step() == []


def test_rows_in_one_batch_keep_their_own_sampling_params(engine, prompts):
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    tops = SamplingParams(max_new_tokens=3, seed=1, top_logprobs=4)
    nucleus = SamplingParams(top_p=1e-6, max_new_tokens=6, seed=2)
    events: list[TokenDelta] = []
    batch = DecodeBatch(engine, None)
    (g,) = batch.add([prompts[0]], greedy)
    t = batch.add([prompts[1], prompts[2]], tops, on_token=events.append)
    (n,) = batch.add([prompts[2]], nucleus)
    finished = run(batch)
    assert finished[g].token_ids == alone(engine, prompts[0], greedy).token_ids
    assert finished[g].top_logprobs is None
    assert [len(finished[h].token_ids) for h in t] == [3, 3]
    assert all(len(top) == 4 for h in t for top in finished[h].top_logprobs)
    # top_p that small keeps only the most likely token: greedy tokens, full-distribution logprobs.
    assert finished[n].token_ids == alone(engine, prompts[2], greedy).token_ids
    # on_token reports the rows of its own add() call, indexed within that call.
    assert sorted({e.index for e in events}) == [0, 1]
    assert [e.token_id for e in events if e.index == 1] == finished[t[1]].token_ids


def test_unknown_adapter_and_empty_prompt_are_refused(engine, prompts):
    with pytest.raises(ValueError, match="not loaded"):
        DecodeBatch(engine, "nope")
    batch = DecodeBatch(engine, None)
    with pytest.raises(ValueError, match="at least one token"):
        batch.add([prompts[0], []], SamplingParams())
    with pytest.raises(ValueError, match="grammars"):
        batch.add([prompts[0]], SamplingParams(), grammars=[None, None])
    assert batch.live == 0


def test_generate_reports_each_row_when_it_finishes(engine, prompts):
    order: list[int] = []
    sampling = SamplingParams(max_new_tokens=6, seed=0)
    model = engine.model
    eos = engine.tokenizer.eos_token_id
    calls = {"n": 0}

    def end_row_1_at_its_second_token(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode pass: rows 0, 1, 2
            output = output.clone()
            output[1, -1, eos] += 1000.0
        return output

    handle = model.lm_head.register_forward_hook(end_row_1_at_its_second_token)
    try:
        choices = engine.generate_from_tokens(prompts, sampling, on_finished=order.append)
    finally:
        handle.remove()
    assert choices[1].finish_reason == "stop" and len(choices[1].token_ids) == 2
    assert order[0] == 1 and sorted(order) == [0, 1, 2]


def test_decode_steps_append_to_the_kv_cache_in_place(engine, prompts):
    batch = DecodeBatch(engine, None)
    batch.add(prompts[:2], SamplingParams(max_new_tokens=20, seed=0))
    finished = dict(batch.step())
    finished.update(batch.step())  # the first decode pass moves the prefill's keys into a buffer
    layer = batch._cache.layers[0]
    address, length = layer.keys.data_ptr(), layer.keys.shape[2]
    for _ in range(5):
        finished.update(batch.step())
    assert not finished and batch.live == 2
    assert layer.keys.shape[2] == length + 5
    assert layer.keys.data_ptr() == address  # no copy of the whole cache per step
    choices = run(batch)
    expected = engine.generate_from_tokens(prompts[:2], SamplingParams(max_new_tokens=20, seed=0))
    assert [c.token_ids for c in choices.values()] == [c.token_ids for c in expected]
