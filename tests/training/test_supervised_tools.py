"""Rows with tools (issue 56: OpenAI's fine-tuning files with tools, tool_calls, tool messages and
weight 0): SFT trains on exactly the weight-1 assistant turns, their tool calls included, and on
nothing else; DPO's replies may call tools; a rollout offers a row's tools and keeps one call per
turn where the row says ``parallel_tool_calls: false``."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
from transformers import AutoTokenizer

from tests.openai_stub import LOOPBACK, openai_stub, tool_call
from tests.training.test_agent import ScriptedEngine
from tests.training.test_cost_loop import MeteredHooks
from tests.training.test_overlap import spec as overlap_spec
from tests.training.test_supervised import run
from training.engines.base import SamplingParams
from training.environments import EnvironmentSpec, build_environment
from training.recipes.supervised import RowError, dpo_pair, prompt_row, row_problem, sft_sample
from training.rollouts.agent import rollout_group, rollout_groups, template_supports_tools
from training.rollouts.remote import ChatEndpoint, RemotePolicy
from training.rollouts.tools import Tool, tools_prompt
from training.runs.loop import run_training

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL_PARIS = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
WRITTEN_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def tool_row(**extra) -> dict:
    """A conversation with every kind of message: a weight-1 call, a tool result, a weight-0 reply,
    a user turn and a weight-1 final reply."""
    return {
        "messages": [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL_PARIS]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny and 21C"},
            {"role": "assistant", "content": "Perhaps sunny.", "weight": 0},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Sunny, 21C."},
        ],
        "tools": [WEATHER],
        **extra,
    }


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert not template_supports_tools(tokenizer)  # ChatML without tools
    return tokenizer


def spans(tokenizer, sample, bit: int) -> list[str]:
    """The decoded runs of consecutive completion tokens whose mask is ``bit``."""
    runs: list[list[int]] = []
    previous = None
    for token, mask in zip(sample.completion_token_ids, sample.completion_mask, strict=True):
        if mask == bit:
            if previous != bit:
                runs.append([])
            runs[-1].append(token)
        previous = mask
    return [tokenizer.decode(run) for run in runs]


def test_sft_trains_exactly_the_weight_1_replies_and_their_calls(tokenizer):
    sample = sft_sample(tokenizer, tool_row(), "")
    # The template shows no tools: they are described in the system prompt, as a rollout does, and
    # the call is written into the reply as the model is asked to write calls.
    prompt = tokenizer.decode(sample.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nUse the tools.\n\nYou can call tools.")
    assert '"name": "get_weather"' in prompt and prompt.endswith(
        "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Trained: each weight-1 reply, from its first token through its end of turn — nothing else.
    assert spans(tokenizer, sample, 1) == [f"{WRITTEN_CALL}<|im_end|>\n", "Sunny, 21C.<|im_end|>\n"]
    assert spans(tokenizer, sample, 0) == [
        "<|im_start|>tool\nsunny and 21C<|im_end|>\n<|im_start|>assistant\nPerhaps sunny.<|im_end|>\n"
        "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"
    ]
    assert tokenizer.decode(
        sample.prompt_token_ids + sample.completion_token_ids
    ) == tokenizer.apply_chat_template(
        [
            {k: v for k, v in m.items() if k not in ("tool_calls", "weight")}
            for m in _written(tool_row())["messages"]
        ],
        tokenize=False,
    )


def _written(row: dict) -> dict:
    row = copy.deepcopy(row)
    row["messages"][2]["content"] = WRITTEN_CALL
    row["messages"][0]["content"] += "\n\n" + _tools_block()
    return row


def _tools_block() -> str:
    return tools_prompt([WEATHER])


NATIVE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}({{ c.function.arguments.city }})</call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_with_a_template_that_shows_tools_the_calls_are_trained_as_it_renders_them(tokenizer):
    native = copy.deepcopy(tokenizer)
    native.chat_template = NATIVE
    assert template_supports_tools(native)
    sample = sft_sample(native, tool_row(), "")
    assert native.decode(sample.prompt_token_ids).startswith(
        "<|im_start|>system\nTools: get_weather<|im_end|>\n<|im_start|>system\nUse the tools.<|im_end|>"
    )  # the template's own tools block; the system prompt is the row's
    assert spans(native, sample, 1) == [
        "<call>get_weather(Paris)</call><|im_end|>\n",
        "Sunny, 21C.<|im_end|>\n",
    ]
    assert "sunny and 21C" in spans(native, sample, 0)[0] and "Perhaps sunny." in spans(native, sample, 0)[0]


def test_a_row_ending_in_a_call_or_context_trains_only_its_weight_1_turns(tokenizer):
    calling = {"messages": tool_row()["messages"][:3], "tools": [WEATHER]}
    sample = sft_sample(tokenizer, calling, "")
    assert spans(tokenizer, sample, 1) == [f"{WRITTEN_CALL}<|im_end|>\n"]
    ending_in_context = tool_row()
    ending_in_context["messages"][-1]["weight"] = 0
    sample = sft_sample(tokenizer, ending_in_context, "")
    assert spans(tokenizer, sample, 1) == [f"{WRITTEN_CALL}<|im_end|>\n"]
    assert spans(tokenizer, sample, 0)[-1].endswith("Sunny, 21C.<|im_end|>\n")
    # A weight-0 reply without tools is context too (OpenAI's weight; it used to be trained).
    plain = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "skip me", "weight": 0},
                          {"role": "user", "content": "b"}, {"role": "assistant", "content": "learn me"}]}  # fmt: skip
    assert spans(tokenizer, sft_sample(tokenizer, plain, ""), 1) == ["learn me<|im_end|>\n"]


def test_a_row_whose_replies_all_have_weight_0_is_refused(tokenizer):
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]}
    assert "weight 0" in row_problem(row, "sft")
    with pytest.raises(RowError, match="weight 0"):
        sft_sample(tokenizer, row, "")


def test_dpo_replies_may_call_the_rows_tools(tokenizer):
    row = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER],
        "chosen": {"role": "assistant", "content": "", "tool_calls": [CALL_PARIS]},
        "rejected": "I cannot know.",
    }
    pair = dpo_pair(tokenizer, row, "")
    assert pair.chosen.prompt_token_ids == pair.rejected.prompt_token_ids  # both offered the tools
    assert "You can call tools." in tokenizer.decode(pair.chosen.prompt_token_ids)
    assert spans(tokenizer, pair.chosen, 1) == [f"{WRITTEN_CALL}<|im_end|>\n"]
    assert spans(tokenizer, pair.rejected, 1) == ["I cannot know.<|im_end|>\n"]


def test_an_sft_run_on_tool_rows_lowers_its_loss(tiny_model_dir, tmp_path):
    rows = []
    for city in ("Paris", "Rome", "Oslo", "Lima"):
        row = json.loads(json.dumps(tool_row()).replace("Paris", city))
        rows.append({**row, "parallel_tool_calls": False, "item": {"word": city}})
    validation = [{**rows[0], "messages": rows[0]["messages"][:3]}]  # held out: the first call
    hooks = run(tmp_path, tiny_model_dir, "sft", rows, validation, learning_rate=2e-2, steps=6)
    losses = [m["loss"] for m in hooks.metrics]
    print("SFT loss on tool rows:", [round(loss, 3) for loss in losses])
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] * 0.8
    before = next(e for e in hooks.events if e["message"].startswith("Held-out before training"))["data"]
    assert hooks.metrics[-1]["heldout_loss"] < before["heldout_loss"]
    # A held-out row's prompt keeps its tools, so the evaluation rollouts offer them.
    assert prompt_row(validation[0]) == {**validation[0], "messages": validation[0]["messages"][:2]}


def test_a_dpo_run_on_tool_rows_learns_to_prefer_the_call(tiny_model_dir, tmp_path):
    rows = []
    for city in ("Paris", "Rome", "Oslo", "Lima"):
        chosen = {
            "role": "assistant",
            "content": "",
            "tool_calls": [json.loads(json.dumps(CALL_PARIS).replace("Paris", city))],
        }
        rows.append({"messages": [{"role": "user", "content": f"Weather in {city}?"}], "tools": [WEATHER],
                     "chosen": chosen, "rejected": "I cannot know.", "item": {"word": city}})  # fmt: skip
    hooks = run(tmp_path, tiny_model_dir, "dpo", rows, rows[:2], dpo_beta=0.5, learning_rate=5e-3, steps=4)
    before = next(e for e in hooks.events if e["message"].startswith("Held-out before training"))["data"]
    assert before["heldout_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference
    assert all(math.isfinite(m["loss"]) for m in hooks.metrics)
    assert hooks.metrics[-1]["heldout_loss"] < before["heldout_loss"]


# ------------------------------------------------------------------ rollouts
SAMPLING = SamplingParams(max_new_tokens=64)


def written(city: str) -> str:
    return f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>'


def test_a_rollout_offers_the_rows_tools_and_the_grader_sees_the_calls(tokenizer):
    engine = ScriptedEngine(tokenizer, {"Weather in Oslo": [written("Oslo")], "Say hi": ["hi"]})
    rows = [{"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER]},
            {"messages": [{"role": "user", "content": "Say hi"}]}]  # fmt: skip
    (with_tools,), (without,) = rollout_groups(engine, rows, build_environment("chat"), SAMPLING, 1)
    assert with_tools.messages[0]["content"].startswith("You can call tools.")  # offered in the prompt
    assert with_tools.output_tools == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert with_tools.finish_reason == "max_turns"  # one turn: the call is not run
    assert without.messages == [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    native = copy.deepcopy(tokenizer)
    native.chat_template = NATIVE
    engine = ScriptedEngine(native, {"Weather in Oslo": [written("Oslo")]})
    (trajectory,) = rollout_group(engine, rows[0], build_environment("chat"), SAMPLING, 1)
    assert native.decode(trajectory.prompt_token_ids).startswith("<|im_start|>system\nTools: get_weather")


def test_parallel_tool_calls_false_keeps_only_a_turns_first_call(tokenizer):
    turn = written("Oslo") + written("Rome")
    engine = ScriptedEngine(tokenizer, {"Weather": [turn, "Cold."]})
    row = {
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER],
        "parallel_tool_calls": False,
    }
    env = EnvironmentSpec(max_turns=3)  # runs what it has: not this row's tool
    (one,) = rollout_group(engine, row, env, SAMPLING, 1)
    assert [m["role"] for m in one.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert one.messages[2]["content"] == turn  # the text stays as sampled
    assert [c["function"]["name"] for c in one.messages[2]["tool_calls"]] == ["get_weather"]
    assert one.output_tools == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert "error" in one.messages[3]["content"]  # the environment has no get_weather
    engine = ScriptedEngine(tokenizer, {"Weather": [turn, "Cold."]})
    (both,) = rollout_group(engine, {**row, "parallel_tool_calls": True}, env, SAMPLING, 1)
    assert [c["name"] for c in both.output_tools] == ["get_weather", "get_weather"]


def test_a_rows_tool_named_as_an_environment_tool_is_offered_once(tokenizer):
    own = Tool("get_weather", "The environment's.", {"type": "object", "properties": {}}, lambda: "rain")
    engine = ScriptedEngine(tokenizer, {"Weather": ["Rain."]})
    row = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    (trajectory,) = rollout_group(engine, row, EnvironmentSpec(max_turns=2, tools=[own]), SAMPLING, 1)
    assert trajectory.messages[0]["content"].count('"name": "get_weather"') == 1
    assert "The environment's." in trajectory.messages[0]["content"]


def test_a_remote_policy_is_offered_the_rows_tools_and_keeps_one_call_without_parallel_calls():
    calls = [tool_call("get_weather", {"city": "Oslo"}, "a"), tool_call("get_weather", {"city": "Rome"}, "b")]
    with openai_stub([{"content": "", "tool_calls": calls}]) as stub:
        policy = RemotePolicy(ChatEndpoint(stub.url, outbound=LOOPBACK), model="m", max_concurrency=1)
        row = {
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [WEATHER],
            "parallel_tool_calls": False,
        }
        trajectory = policy.episode(row, build_environment("chat"))
    assert stub.requests[0]["tools"] == [WEATHER]
    assert trajectory.output_tools == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]


def test_a_grpo_run_on_rows_with_tools_offers_them_in_every_rollout(tiny_model_dir, tmp_path):
    rows = [{"index": i, "data": {"messages": [{"role": "user", "content": f"Weather in {city}?"}],
                                  "tools": [WEATHER], "parallel_tool_calls": False, "item": {"city": city}}}
            for i, city in enumerate(("Paris", "Rome"))]  # fmt: skip
    spec = overlap_spec(tiny_model_dir, tmp_path, steps=1)
    spec = dataclasses.replace(spec, train_rows=rows, validation_rows=rows[:1])
    hooks = MeteredHooks()
    assert run_training(spec, hooks) == "succeeded"
    (step,) = hooks.metrics
    assert step["trajectories"] and all(
        t.messages[0]["content"].startswith("You can call tools.") for t in step["trajectories"]
    )
