"""Client trajectory groups (training.runs.art_groups): the ids trained on are the ids sampled, in the
context they were sampled in, for single-turn, multi-turn and tool-call trajectories; ART's
fallback from logprobs token strings; and every malformed upload is refused with its place.

Choices are made as the gateway makes them: the inference server's own prompt renderer and
response body (training.serving), then the gateway's annotation (``annotate_completion``).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from training.engines.base import Choice
from training.runs.art_groups import GroupError, annotate_completion, parse_groups
from training.runs.art_tokens import TrajectoryTokenizer
from training.serving.prompts import render_prompt
from training.serving.protocol import Limits, parse_chat_request
from training.serving.responses import completion_body

MODEL = "math/agent:0"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class Sampler:
    """The inference server and gateway without a model: the prompt rendered as the server renders
    it, the "sampled" ids the tokens of a given text plus the end token, the reply's choice as the
    gateway returns it (a plain dict, as ``Choice.model_dump(mode="json")`` writes it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sampled: list[dict[str, Any]] = []  # per call: the prompt and the ids, for the checks

    def choice(self, messages: list[dict], text: str, *, tools: list | None = None, **body: Any) -> dict:
        request = parse_chat_request(
            {"model": MODEL, "messages": messages, "tools": tools, "logprobs": True,
             "return_token_ids": True, **body},
            Limits.shape_only(),
        )  # fmt: skip
        prompt = render_prompt(self.tokenizer, request, native_tools=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
        sampled = Choice(
            text=text, prompt_token_ids=prompt, token_ids=ids, logprobs=logprobs, finish_reason="stop"
        )
        reply = completion_body(
            request, [sampled], completion_id="chatcmpl-test", created=0, model=MODEL, prompt_token_ids=prompt,
            token_text=lambda token_id: self.tokenizer.decode([token_id]),
        )  # fmt: skip
        reply = annotate_completion(json.loads(json.dumps(reply)), model=MODEL, keep_prompt=False)
        self.sampled.append({"prompt": prompt, "ids": ids, "logprobs": logprobs})
        return reply["choices"][0]


def message_of(choice: dict) -> dict:
    """What a client sends back next turn: the choice's message."""
    return {key: value for key, value in choice["message"].items() if value is not None}


def trajectory(items: list[dict], reward: float, **extra: Any) -> dict:
    return {"messages_and_choices": items, "reward": reward, "tools": None, "additional_histories": [],
            "metrics": {}, "metadata": {}, "logs": [], **extra}  # fmt: skip


def group(*trajectories: dict) -> dict:
    return {"trajectories": list(trajectories), "exceptions": [], "metadata": {}, "metrics": {}, "logs": []}


def trained_spans(sample) -> list[tuple[list[int], list[int], list[float]]]:
    """Each run of mask-1 ids of a sample: (the ids before it, its ids, its logprobs)."""
    tokens = sample.prompt_token_ids + sample.completion_token_ids
    offset = len(sample.prompt_token_ids)
    spans, start = [], None
    mask = sample.completion_mask + [0]
    for position, bit in enumerate(mask):
        if bit and start is None:
            start = position
        elif not bit and start is not None:
            spans.append((tokens[: offset + start], sample.completion_token_ids[start:position],
                          sample.completion_logprobs[start:position]))  # fmt: skip
            start = None
    return spans


def all_spans(tokenized) -> list[tuple[list[int], list[int], list[float]]]:
    return [span for sample in tokenized.samples for span in trained_spans(sample)]


def test_single_turn_trains_on_the_sampled_ids_after_the_prompt_the_sampler_saw(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    groups = parse_groups([group(
        trajectory([*prompt, sampler.choice(prompt, "5")], 1.0),
        trajectory([*prompt, sampler.choice(prompt, "six")], 0.0),
    )])  # fmt: skip
    tokenize = TrajectoryTokenizer(tokenizer, accepts_model=lambda name: name == MODEL)
    for trajectory_, sampled in zip(groups[0].trajectories, sampler.sampled, strict=True):
        tokenized = tokenize.tokenize(trajectory_)
        assert tokenized.token_source == "gateway" and tokenized.prompt_mismatches == 0
        assert all_spans(tokenized) == [(sampled["prompt"], sampled["ids"], sampled["logprobs"])]
        assert tokenized.samples[0].reward == trajectory_.reward


def test_multi_turn_is_one_sequence_whose_every_turn_follows_the_prompt_it_was_sampled_after(tokenizer):
    sampler = Sampler(tokenizer)
    conversation: list[dict] = [{"role": "user", "content": "Name a colour."}]
    items: list[dict] = list(conversation)
    for text, reply in (("red", "Another one."), ("blue", "And one more.")):
        choice = sampler.choice(conversation, text)
        conversation += [message_of(choice), {"role": "user", "content": reply}]
        items += [choice, {"role": "user", "content": reply}]
    choice = sampler.choice(conversation, "green")
    items.append(choice)
    (parsed,) = parse_groups([group(trajectory(items, 1.0))])[0].trajectories
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    assert len(tokenized.samples) == 1 and tokenized.splits == 0
    assert all_spans(tokenized) == [(s["prompt"], s["ids"], s["logprobs"]) for s in sampler.sampled]
    # The ids between two turns are exactly the next prompt's continuation, never trained on.
    sample = tokenized.samples[0]
    assert (
        sample.prompt_token_ids + sample.completion_token_ids
        == sampler.sampled[-1]["prompt"] + sampler.sampled[-1]["ids"]
    )


def test_tool_call_turns_are_trained_in_their_own_context_when_the_template_rewrites_them(tokenizer):
    sampler = Sampler(tokenizer)
    conversation: list[dict] = [{"role": "user", "content": "Add 2 and 3."}]
    # Forced into a call, as tool_choice does: the prompt ends with the prefill the model continued.
    call = sampler.choice(conversation, ' {"a": 2, "b": 3}}</tool_call>', tools=TOOLS,
                          tool_choice={"type": "function", "function": {"name": "add"}})  # fmt: skip
    assert call["message"]["tool_calls"], call
    tool_call_id = call["message"]["tool_calls"][0]["id"]
    result = {"role": "tool", "tool_call_id": tool_call_id, "content": "5"}
    conversation += [message_of(call), result]
    answer = sampler.choice(conversation, "The sum is 5.", tools=TOOLS)
    items = [conversation[0], call, result, answer]
    (parsed,) = parse_groups([group(trajectory(items, 1.0, tools=TOOLS))])[0].trajectories
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    # The call is written back as JSON text, not as the ids sampled: the answer's prompt does not
    # continue the call's ids, so it is a sequence of its own (exact), not a silent retokenisation.
    assert tokenized.splits == 1 and len(tokenized.samples) == 2
    assert all_spans(tokenized) == [(s["prompt"], s["ids"], s["logprobs"]) for s in sampler.sampled]


def test_additional_histories_are_trained_as_their_own_sequences(tokenizer):
    sampler = Sampler(tokenizer)
    first = [{"role": "user", "content": "Hi"}]
    second = [{"role": "user", "content": "Bye"}]
    main = [*first, sampler.choice(first, "hello")]
    extra = {"messages_and_choices": [*second, sampler.choice(second, "ok")], "tools": None}
    parsed = parse_groups([group(trajectory(main, 0.5, additional_histories=[extra]))])[0].trajectories[0]
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    assert [span[1] for span in all_spans(tokenized)] == [
        sampler.sampled[0]["ids"],
        sampler.sampled[1]["ids"],
    ]


def strip_extension(choice: dict, *keys: str) -> dict:
    choice = copy.deepcopy(choice)
    for key in keys or ("token_ids", "prompt_token_ids", "artweb_model"):
        choice.pop(key, None)
    return choice


def test_without_the_gateways_ids_arts_rule_reads_the_logprobs_tokens_and_flags_it(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    choice = sampler.choice(prompt, "the answer is 5")
    (parsed,) = parse_groups([group(trajectory([*prompt, strip_extension(choice)], 1.0))])[0].trajectories
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    assert tokenized.token_source == "logprobs"
    # The tokens' texts map back to the very ids (this tokenizer has one token per text here), and
    # the prompt is re-rendered as the server rendered it.
    assert all_spans(tokenized) == [
        (sampler.sampled[0]["prompt"], sampler.sampled[0]["ids"], sampler.sampled[0]["logprobs"])
    ]


def test_arts_token_id_form_is_accepted(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    choice = strip_extension(sampler.choice(prompt, "hello there"))
    for entry, token_id in zip(choice["logprobs"]["content"], sampler.sampled[0]["ids"], strict=True):
        entry["token"] = f"token_id:{token_id}"
    (parsed,) = parse_groups([group(trajectory([*prompt, choice], 1.0))])[0].trajectories
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    assert all_spans(tokenized)[0][1] == sampler.sampled[0]["ids"]


def test_ids_without_a_prompt_keep_the_completion_exact_and_re_render_the_prompt(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    choice = strip_extension(sampler.choice(prompt, "hello"), "prompt_token_ids", "artweb_model")
    (parsed,) = parse_groups([group(trajectory([*prompt, choice], 1.0))])[0].trajectories
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    assert tokenized.token_source == "token_ids"
    assert all_spans(tokenized) == [
        (sampler.sampled[0]["prompt"], sampler.sampled[0]["ids"], sampler.sampled[0]["logprobs"])
    ]


def test_a_carried_prompt_wins_over_a_re_render_that_differs_and_is_counted(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    choice = sampler.choice(prompt, "hello")
    edited = [{"role": "user", "content": "Hi (edited after sampling)"}]
    (parsed,) = parse_groups([group(trajectory([*edited, choice], 1.0))])[0].trajectories
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    assert tokenized.prompt_mismatches == 1
    assert tokenized.samples[0].prompt_token_ids == sampler.sampled[0]["prompt"]


def test_context_choices_without_logprobs_are_rendered_not_trained(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    context = strip_extension(sampler.choice(prompt, "hello"))
    context["logprobs"] = None
    conversation = [*prompt, message_of(context), {"role": "user", "content": "Again"}]
    trained = sampler.choice(conversation, "hello again")
    (parsed,) = parse_groups([group(trajectory([*prompt, context, conversation[-1], trained], 1.0))])[
        0
    ].trajectories
    tokenized = TrajectoryTokenizer(tokenizer).tokenize(parsed)
    assert all_spans(tokenized) == [
        (sampler.sampled[1]["prompt"], sampler.sampled[1]["ids"], sampler.sampled[1]["logprobs"])
    ]


# ------------------------------------------------------------------------------------ refusals


def good_group(tokenizer) -> dict:
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    return group(trajectory([*prompt, sampler.choice(prompt, "hello")], 1.0),
                 trajectory([*prompt, sampler.choice(prompt, "bye")], 0.0))  # fmt: skip


T0 = "trajectory_groups[0].trajectories[0]"
MALFORMED = [
    ("not a list", lambda g: {"trajectories": []}, "trajectory_groups", "non-empty list"),
    ("empty", lambda g: [], "trajectory_groups", "non-empty list"),
    ("no trajectories anywhere", lambda g: [group()], "trajectory_groups", "holds no trajectories"),
    ("trajectories not a list", lambda g: [{"trajectories": {}}], "trajectory_groups[0].trajectories", "list"),
    ("reward missing a number", lambda g: _set(g, ["trajectories", 0, "reward"], "1"), f"{T0}.reward", "finite"),
    ("reward a boolean", lambda g: _set(g, ["trajectories", 0, "reward"], True), f"{T0}.reward", "finite"),
    ("no items", lambda g: _set(g, ["trajectories", 0, "messages_and_choices"], []),
     f"{T0}.messages_and_choices", "non-empty"),
    ("an item that is neither", lambda g: _set(g, ["trajectories", 0, "messages_and_choices", 0], {"x": 1}),
     f"{T0}.messages_and_choices[0]", "neither a message"),
    ("a bad role", lambda g: _set(g, ["trajectories", 0, "messages_and_choices", 0, "role"], "robot"),
     f"{T0}.messages_and_choices[0].role", "role must be"),
    ("an image part", lambda g: _set(g, ["trajectories", 0, "messages_and_choices", 0, "content"],
                                     [{"type": "image_url", "image_url": {"url": "x"}}]),
     f"{T0}.messages_and_choices[0].content[0]", "only text"),
    ("a tool message without its call id", lambda g: _set(g, ["trajectories", 0, "messages_and_choices", 0],
                                                          {"role": "tool", "content": "5"}),
     f"{T0}.messages_and_choices[0].tool_call_id", "tool_call_id"),
    ("no logprobs anywhere", lambda g: _set(_set(g, ["trajectories", 0, "messages_and_choices", 1, "logprobs"], None)[0],
                                            ["trajectories", 1, "messages_and_choices", 1, "logprobs"], None),
     "trajectory_groups", "no trajectory has a choice with logprobs"),
    ("two kinds of trajectory", lambda g: _set(g, ["trajectories", 0, "exchanges"],
                                               {"chat_completions": [{"request": {}, "response": {}}]}),
     T0, "both captured exchanges and messages_and_choices"),
    ("an exchange of another protocol", lambda g: _set(_set(g, ["trajectories", 0, "messages_and_choices"], [])[0],
                                                       ["trajectories", 0, "exchanges"], {"responses": [{}]}),
     f"{T0}.exchanges.responses", "chat completions only"),
    ("a logprob that is not a number", lambda g: _set(
        g, ["trajectories", 0, "messages_and_choices", 1, "logprobs", "content", 0, "logprob"], None),
     f"{T0}.messages_and_choices[1].logprobs.content[0].logprob", "finite"),
    ("empty logprobs content", lambda g: _set(
        g, ["trajectories", 0, "messages_and_choices", 1, "logprobs", "content"], []),
     f"{T0}.messages_and_choices[1].logprobs.content", "non-empty"),
    ("ids that are not ids", lambda g: _set(g, ["trajectories", 0, "messages_and_choices", 1, "token_ids"], ["a"]),
     f"{T0}.messages_and_choices[1].token_ids", "token ids"),
    ("fewer ids than logprobs", lambda g: _set(g, ["trajectories", 0, "messages_and_choices", 1, "token_ids"], [1]),
     f"{T0}.messages_and_choices[1].token_ids", "ids for"),
    ("a non-assistant choice", lambda g: _set(g, ["trajectories", 0, "messages_and_choices", 1, "message", "role"],
                                              "user"), f"{T0}.messages_and_choices[1].message.role", "assistant"),
    ("bad tools", lambda g: _set(g, ["trajectories", 0, "tools"], [{"type": "function"}]), f"{T0}.tools[0]", "tool"),
]  # fmt: skip


def _set(value: Any, path: list, new: Any) -> list:
    value = copy.deepcopy(value)
    target = value
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return [value]


@pytest.mark.parametrize(("case", "change", "path", "words"), MALFORMED, ids=[case[0] for case in MALFORMED])
def test_every_malformed_upload_is_refused_naming_its_place(tokenizer, case, change, path, words):
    with pytest.raises(GroupError) as refused:
        parse_groups(change(good_group(tokenizer)))
    assert refused.value.path == path, refused.value
    assert words in refused.value.message


def test_a_choice_of_another_model_is_refused_when_tokenizing(tokenizer):
    (parsed,) = parse_groups([good_group(tokenizer)])
    tokenize = TrajectoryTokenizer(tokenizer, accepts_model=lambda name: name.startswith("math/other:"))
    with pytest.raises(GroupError, match="was sampled from `math/agent:0`, not from this model"):
        tokenize.tokenize(parsed.trajectories[0])


def test_a_token_string_outside_the_vocabulary_is_refused_not_replaced_by_an_end_token(tokenizer):
    raw = good_group(tokenizer)
    choice = strip_extension(raw["trajectories"][0]["messages_and_choices"][1])
    choice["logprobs"]["content"][0]["token"] = "\u2603 not one of our tokens"
    raw["trajectories"][0]["messages_and_choices"][1] = choice
    (parsed,) = parse_groups([raw])
    with pytest.raises(GroupError, match="is not one token of this model's vocabulary") as refused:
        TrajectoryTokenizer(tokenizer).tokenize(parsed.trajectories[0])
    assert refused.value.path.endswith("messages_and_choices[1].logprobs.content[0].token")


def test_ids_outside_the_vocabulary_are_refused(tokenizer):
    raw = good_group(tokenizer)
    raw["trajectories"][0]["messages_and_choices"][1]["token_ids"][0] = 10**6
    (parsed,) = parse_groups([raw])
    with pytest.raises(GroupError, match="outside the model's vocabulary"):
        TrajectoryTokenizer(tokenizer).tokenize(parsed.trajectories[0])


def test_a_trajectory_longer_than_the_model_takes_is_refused(tokenizer):
    (parsed,) = parse_groups([good_group(tokenizer)])
    with pytest.raises(GroupError, match="the model takes at most 3"):
        TrajectoryTokenizer(tokenizer, max_length=3).tokenize(parsed.trajectories[0])


def test_a_choice_with_nothing_before_it_is_refused(tokenizer):
    raw = good_group(tokenizer)
    raw["trajectories"][0]["messages_and_choices"] = raw["trajectories"][0]["messages_and_choices"][1:]
    (parsed,) = parse_groups([raw])
    with pytest.raises(GroupError, match="needs the messages it answered"):
        TrajectoryTokenizer(tokenizer).tokenize(parsed.trajectories[0])


def test_the_gateway_annotation_keeps_the_top_level_prompt_only_when_asked():
    body = {"prompt_token_ids": [1, 2], "choices": [{"token_ids": [3]}, {"message": {}}]}
    annotated = annotate_completion(copy.deepcopy(body), model="p/m:1", keep_prompt=False)
    assert "prompt_token_ids" not in annotated
    assert annotated["choices"][0] == {"token_ids": [3], "prompt_token_ids": [1, 2], "artweb_model": "p/m:1"}
    assert annotated["choices"][1] == {"message": {}}
    assert annotate_completion(copy.deepcopy(body), model="p/m:1", keep_prompt=True)["prompt_token_ids"] == [
        1,
        2,
    ]


# ------------------------------------------------------------------------------------ ART 0.5.23


def test_a_trajectory_without_logprobs_is_kept_for_the_job_to_skip_and_with_arts_flag_is_trained(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    bare = sampler.choice(prompt, "hello")
    bare["logprobs"] = None
    raw = [group(trajectory([*prompt, bare], 1.0), trajectory([*prompt, sampler.choice(prompt, "bye")], 0.0))]
    kept, trained = parse_groups(raw)[0].trajectories
    assert not kept.trainable() and trained.trainable()
    assert TrajectoryTokenizer(tokenizer).tokenize(kept).samples == []
    # allow_training_without_logprobs: the sampled ids are trained, their old logprobs unknown (NaN).
    (sample,) = TrajectoryTokenizer(tokenizer, allow_without_logprobs=True).tokenize(kept).samples
    assert sample.completion_token_ids == sampler.sampled[0]["ids"]
    assert sample.completion_mask == [1] * len(sampler.sampled[0]["ids"])
    assert all(value != value for value in sample.completion_logprobs)  # NaN
    with pytest.raises(GroupError, match="no trajectory has a choice"):
        parse_groups([group(trajectory([*prompt, bare], 1.0))])
    assert parse_groups([group(trajectory([*prompt, bare], 1.0))], allow_without_logprobs=True)


def captured(requests_and_choices: list[tuple[list[dict], dict]], reward: float | None = None) -> dict:
    """A trajectory as openpipe-art 0.5.23 dumps a captured one: exchanges, defaults left out."""
    exchanges = [
        {"start_time": "2026-12-01T00:00:00Z", "end_time": "2026-12-01T00:00:01Z", "model": MODEL,
         "request": {"model": MODEL, "messages": messages, "logprobs": True, "return_token_ids": True},
         "response": {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": MODEL,
                      "choices": [{**choice, "art_completion_tokens": choice.get("token_ids")}]}}
        for messages, choice in requests_and_choices
    ]  # fmt: skip
    return {"exchanges": {"chat_completions": exchanges}, **({} if reward is None else {"reward": reward})}


def test_captured_exchanges_train_exactly_like_messages_and_choices(tokenizer):
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    first = sampler.choice(prompt, "hello")
    conversation = [*prompt, message_of(first), {"role": "user", "content": "Again"}]
    second = sampler.choice(conversation, "hello again")
    legacy = parse_groups([group(trajectory([*conversation[:1], first, conversation[2], second], 1.0))])
    exchanged = parse_groups([{"trajectories": [captured([(prompt, first), (conversation, second)], 1.0)]}])
    expected = TrajectoryTokenizer(tokenizer).tokenize(legacy[0].trajectories[0])
    got = TrajectoryTokenizer(tokenizer).tokenize(exchanged[0].trajectories[0])
    assert len(got.samples) == 1 and got.token_source == "gateway"
    assert (
        all_spans(got)
        == all_spans(expected)
        == [(sampled["prompt"], sampled["ids"], sampled["logprobs"]) for sampled in sampler.sampled]
    )
    # A default left out of the dump reads as its default: no "reward" is 0.0.
    assert parse_groups([{"trajectories": [captured([(prompt, first)])]}])[0].trajectories[0].reward == 0.0


def test_an_exchange_that_does_not_continue_the_history_starts_its_own(tokenizer):
    sampler = Sampler(tokenizer)
    one, two = [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Other"}]
    parsed = parse_groups([{"trajectories": [captured([(one, sampler.choice(one, "a")),
                                                       (two, sampler.choice(two, "b"))], 1.0)]}])  # fmt: skip
    (item,) = parsed[0].trajectories
    assert len(item.histories) == 2
    assert len(TrajectoryTokenizer(tokenizer).tokenize(item).samples) == 2
