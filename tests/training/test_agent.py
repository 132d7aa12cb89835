"""The agent loop: transcripts, tool failures, lockstep batching, chat templates, and token exactness.

Most tests drive the loop with `ScriptedEngine`, which replies from a script, so what the model
"says" is fixed. The token-exactness test at the end samples for real: a tiny model is first
taught (40 SGD steps on one scripted trajectory) to call a tool three times, and the loop must then
hand the trainer exactly the sampled ids with logprobs a teacher-forced forward reproduces.
"""

import copy
import json
import threading
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoTokenizer

from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.engines.base import Choice, Engine, SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import EnvironmentSpec
from training.recipes.grpo_update import grpo_train_step
from training.rollouts.agent import ChatTemplateError, rollout_group, rollout_groups, template_supports_tools
from training.rollouts.tools import Tool
from training.rollouts.trajectory import to_train_group
from training.session.policy import Policy

NUMBERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ADD = Tool("add", "Add a and b.", NUMBERS, lambda a, b: a + b)
SAMPLING = SamplingParams(max_new_tokens=64)
# The environment's ids between two turns of a ChatML model that ended its turn with <|im_end|>.
AFTER_ADD_5 = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def call(a: int, b: int, name: str = "add") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


@dataclass
class Cut:
    """A scripted reply cut off by max_new_tokens: no end token, finish_reason "length"."""

    text: str


@dataclass
class CharByChar:
    """A scripted reply sampled one character per token: valid, but not how the tokenizer splits it."""

    text: str


class ScriptedEngine(Engine):
    """Replies with `scripts[key][k]` to the k-th model turn of the row whose prompt contains `key`.

    Records every batched call's prompts and choices, so tests can rebuild what the loop did.
    """

    def __init__(self, tokenizer, scripts):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.prompts: list[list[list[int]]] = []
        self.choices: list[list[Choice]] = []

    def generate_from_tokens(self, prompt_token_ids, sampling, adapter=None):
        choices = [self._reply(list(prompt)) for prompt in prompt_token_ids]
        self.prompts.append([list(p) for p in prompt_token_ids])
        self.choices.append(choices)
        return choices

    def _reply(self, prompt: list[int]) -> Choice:
        text = self.tokenizer.decode(prompt)
        (key,) = [key for key in self.scripts if key in text]
        reply = self.scripts[key][text.count("<|im_start|>assistant") - 1]
        if isinstance(reply, CharByChar):
            ids = [i for char in reply.text for i in self._encode(char)] + [self.tokenizer.eos_token_id]
            text, finish = reply.text, "stop"
        elif isinstance(reply, Cut):
            ids, text, finish = self._encode(reply.text), reply.text, "length"
        else:
            ids, text, finish = self._encode(reply) + [self.tokenizer.eos_token_id], reply, "stop"
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]  # distinct, to catch misalignment
        return Choice(
            text=text, prompt_token_ids=prompt, token_ids=ids, logprobs=logprobs, finish_reason=finish
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def load_adapter(self, name, path):
        raise NotImplementedError

    def unload_adapter(self, name):
        raise NotImplementedError


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.chat_template  # ChatML, without tool support
    return tokenizer


def turn_pieces(engine, row, trajectory):
    """(sampled ids, environment ids) of each turn of the `row`-th request of every call, rebuilt
    from what the engine was given and returned, checking each prompt continues the one before."""
    pieces = []
    prompts = [call[row] for call in engine.prompts]
    choices = [call[row] for call in engine.choices]
    assert prompts[0] == trajectory.prompt_token_ids
    for k, choice in enumerate(choices):
        if k + 1 < len(prompts):
            sampled_end = len(prompts[k]) + len(choice.token_ids)
            assert prompts[k + 1][:sampled_end] == prompts[k] + choice.token_ids
            pieces.append((choice.token_ids, prompts[k + 1][sampled_end:]))
        else:
            pieces.append((choice.token_ids, []))
    return pieces


def test_tool_turns_make_an_openai_style_transcript(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {"Add 2, 3, 4": [call(2, 3), call(5, 4), "It is 9."]})
    env = EnvironmentSpec(system_prompt="Be brief.", max_turns=5, tools=[ADD])
    (trajectory,) = rollout_group(engine, {"prompt": "Add 2, 3, 4."}, env, SAMPLING, group_size=1)

    assert [m["role"] for m in trajectory.messages] == [
        "system", "user", "assistant", "tool", "assistant", "tool", "assistant"
    ]  # fmt: skip
    system = trajectory.messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call tools.") and '"name": "add"' in system
    assert trajectory.messages[2] == {
        "role": "assistant",
        "content": call(2, 3),
        "tool_calls": [
            {
                "id": "call_1_0",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
        ],
    }
    assert trajectory.messages[3] == {"role": "tool", "tool_call_id": "call_1_0", "content": "5"}
    assert trajectory.messages[5] == {"role": "tool", "tool_call_id": "call_2_0", "content": "9"}
    assert trajectory.messages[6] == {"role": "assistant", "content": "It is 9."}
    assert trajectory.output_text == "It is 9."
    assert trajectory.output_tools == [
        {"name": "add", "arguments": {"a": 2, "b": 3}},
        {"name": "add", "arguments": {"a": 5, "b": 4}},
    ]
    assert trajectory.metrics == {"turns": 3, "tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0}
    assert trajectory.finish_reason == "stop"


def test_tokens_are_sampled_ids_then_environment_ids_with_the_mask_on_sampled_ones(tiny_tokenizer):
    # Turn 2 is cut off by max_new_tokens: the environment closes it with the end token.
    script = [call(2, 3), Cut(call(1, 1)), "Done."]
    engine = ScriptedEngine(tiny_tokenizer, {"Add 2 and 3": script})
    env = EnvironmentSpec(max_turns=5, tools=[ADD])
    (trajectory,) = rollout_group(engine, {"prompt": "Add 2 and 3."}, env, SAMPLING, group_size=1)

    pieces = turn_pieces(engine, 0, trajectory)
    assert [tiny_tokenizer.decode(env_ids) for _, env_ids in pieces] == [
        AFTER_ADD_5,
        "<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n",
        "",
    ]
    expected_ids, expected_mask, expected_logprobs = [], [], []
    for (sampled, env_ids), choice in zip(pieces, [c[0] for c in engine.choices], strict=True):
        expected_ids += sampled + env_ids
        expected_mask += [1] * len(sampled) + [0] * len(env_ids)
        expected_logprobs += choice.logprobs + [0.0] * len(env_ids)
    assert trajectory.completion_token_ids == expected_ids
    assert trajectory.completion_mask == expected_mask
    assert trajectory.logprobs == expected_logprobs
    # Read back as text, the tokens are the conversation as the chat template renders it.
    text = tiny_tokenizer.decode(trajectory.prompt_token_ids + trajectory.completion_token_ids)
    assert text + "\n" == tiny_tokenizer.apply_chat_template(trajectory.messages, tokenize=False)


def test_sampled_ids_are_kept_even_where_re_rendering_would_tokenise_differently(tiny_tokenizer):
    script = [CharByChar(call(2, 3)), CharByChar("It is 5.")]
    engine = ScriptedEngine(tiny_tokenizer, {"Add 2 and 3": script})
    env = EnvironmentSpec(max_turns=3, tools=[ADD])
    (trajectory,) = rollout_group(engine, {"prompt": "Add 2 and 3."}, env, SAMPLING, group_size=1)

    (first, env_ids), (second, _) = turn_pieces(engine, 0, trajectory)
    assert tiny_tokenizer.decode(env_ids) == AFTER_ADD_5
    assert trajectory.completion_token_ids == first + env_ids + second
    # The same conversation re-rendered and re-tokenised is other (fewer) tokens: had the loop
    # re-rendered, the trainer would score tokens the model never sampled.
    rendered = tiny_tokenizer.apply_chat_template(trajectory.messages, tokenize=True, return_dict=False)
    assert len(rendered) < len(trajectory.prompt_token_ids + trajectory.completion_token_ids)


def test_all_trajectories_of_a_step_advance_in_one_batched_call_per_turn(tiny_tokenizer):
    scripts = {"one": ["1."], "two": [call(1, 1), "2."], "three": [call(1, 1), call(2, 1), "3."]}
    engine = ScriptedEngine(tiny_tokenizer, scripts)
    env = EnvironmentSpec(max_turns=4, tools=[ADD])
    rows = [{"prompt": "one"}, {"prompt": "two"}, {"prompt": "three"}]
    groups = rollout_groups(engine, rows, env, SAMPLING, group_size=2)
    assert [len(call) for call in engine.prompts] == [6, 4, 2]  # finished trajectories drop out
    assert [[t.output_text for t in group] for group in groups] == [["1."] * 2, ["2."] * 2, ["3."] * 2]
    assert [group[0].metrics["turns"] for group in groups] == [1, 2, 3]
    # rollout_groups is the same loop.
    engine = ScriptedEngine(tiny_tokenizer, scripts)
    assert rollout_groups(engine, rows, env, SAMPLING, group_size=2) == groups


def test_tool_failures_go_back_to_the_model_and_into_the_metrics(tiny_tokenizer):
    release = threading.Event()
    hang = Tool("hang", "Never returns.", {"type": "object"}, lambda a, b: release.wait(30))
    divide = Tool("divide", "a / b.", NUMBERS, lambda a, b: a / b)
    turn = "".join(
        [
            call(1, 2, name="multiply"),  # unknown tool
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # not JSON
            call(1, 0, name="divide"),  # raises
            call(1, 2, name="hang"),  # times out
            call(1, 2),  # fine
        ]
    )
    engine = ScriptedEngine(tiny_tokenizer, {"Try": [turn, "Sorry."]})
    env = EnvironmentSpec(max_turns=3, tools=[ADD, divide, hang], tool_timeout_s=0.2)
    try:
        (trajectory,) = rollout_group(engine, {"prompt": "Try."}, env, SAMPLING, group_size=1)
    finally:
        release.set()
    replies = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in trajectory.messages if m["role"] == "tool"] == [
        f"call_1_{i}" for i in range(5)
    ]
    assert [json.loads(reply) for reply in replies[:4]] == [
        {"error": "unknown tool 'multiply' (tools: add, divide, hang)"},
        {"error": "the tool call is not valid JSON: Expecting ',' delimiter: line 1 column 37 (char 36)"},
        {"error": "ZeroDivisionError: division by zero"},
        {"error": "tool 'hang' did not finish within 0.2 s"},
    ]
    assert replies[4] == "3"
    assert trajectory.metrics == {"turns": 2, "tool_calls": 5, "tool_errors": 3, "tool_timeouts": 1}
    assert trajectory.output_text == "Sorry."


def test_max_turns_ends_a_trajectory_that_keeps_calling_tools(tiny_tokenizer):
    runs = []
    counting_add = Tool("add", "Add.", NUMBERS, lambda a, b: runs.append((a, b)) or a + b)
    engine = ScriptedEngine(tiny_tokenizer, {"Loop": [call(1, 1), call(2, 2), call(3, 3)]})
    env = EnvironmentSpec(max_turns=2, tools=[counting_add])
    (trajectory,) = rollout_group(engine, {"prompt": "Loop."}, env, SAMPLING, group_size=1)
    assert trajectory.finish_reason == "max_turns"
    assert runs == [(1, 1)]  # the last turn's call has no turn left to read its result: not run
    assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.metrics["tool_calls"] == 2
    assert trajectory.completion_mask[-1] == 1  # it ends with the model's own tokens


def test_without_tools_a_tool_call_is_just_text(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {"Hi": [call(1, 1)]})
    (trajectory,) = rollout_group(engine, {"prompt": "Hi"}, EnvironmentSpec(max_turns=3), SAMPLING, 1)
    assert trajectory.messages[-1] == {"role": "assistant", "content": call(1, 1)}
    assert trajectory.messages[0] == {"role": "user", "content": "Hi"}  # no tool block either
    assert trajectory.metrics["turns"] == 1 and trajectory.completion_mask == [1] * len(
        trajectory.completion_token_ids
    )


CHATML_BODY = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(tokenizer, template: str):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def test_a_template_with_tool_support_shows_the_tools_itself(tiny_tokenizer):
    template = (
        "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
        "<|im_end|>\n{% endif %}" + CHATML_BODY
    )
    tokenizer = with_template(tiny_tokenizer, template)
    assert template_supports_tools(tokenizer) and not template_supports_tools(tiny_tokenizer)
    engine = ScriptedEngine(tokenizer, {"Add": [call(2, 3), "5."]})
    env = EnvironmentSpec(max_turns=3, tools=[ADD])
    (trajectory,) = rollout_group(engine, {"prompt": "Add 2 and 3."}, env, SAMPLING, group_size=1)
    assert trajectory.messages[0] == {"role": "user", "content": "Add 2 and 3."}  # no system block
    assert tokenizer.decode(trajectory.prompt_token_ids).startswith(
        "<|im_start|>system\nTools: add<|im_end|>"
    )
    ((_, env_ids), _) = turn_pieces(engine, 0, trajectory)
    assert tokenizer.decode(env_ids) == AFTER_ADD_5


def test_a_template_that_renders_the_last_turn_differently_falls_back(tiny_tokenizer):
    # Like Qwen3: only the last assistant message gets an (empty) think block, so the rendered
    # conversation is not a prefix of the rendered continued conversation.
    template = CHATML_BODY.replace(
        "{{ m.content }}",
        "{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}{{ m.content }}",
    )
    tokenizer = with_template(tiny_tokenizer, template)
    engine = ScriptedEngine(tokenizer, {"Add": [call(2, 3), Cut(call(5, 0)), "5."]})
    (trajectory,) = rollout_group(
        engine, {"prompt": "Add 2 and 3."}, EnvironmentSpec(max_turns=3, tools=[ADD]), SAMPLING, 1
    )
    pieces = turn_pieces(engine, 0, trajectory)
    assert [tokenizer.decode(env_ids) for _, env_ids in pieces] == [
        AFTER_ADD_5,
        "<|im_end|>" + AFTER_ADD_5,  # the environment closes the cut-off turn
        "",
    ]


def test_a_template_that_renders_the_history_differently_is_a_clear_error(tiny_tokenizer):
    tokenizer = with_template(
        tiny_tokenizer, "<|im_start|>system\n{{ messages | length }}<|im_end|>\n" + CHATML_BODY
    )
    engine = ScriptedEngine(tokenizer, {"Add": [call(2, 3), "5."]})
    with pytest.raises(ChatTemplateError, match="before the model's last turn"):
        rollout_group(engine, {"prompt": "Add."}, EnvironmentSpec(max_turns=3, tools=[ADD]), SAMPLING, 1)


# ---------------------------------------------------------------- real sampling on a taught model

TAUGHT_ROW = {"prompt": "Add 2, 3, 4 and 1."}
TAUGHT_SCRIPT = [call(2, 3), call(5, 4), call(9, 1), "The answer is 10."]
TAUGHT_ENV = EnvironmentSpec(max_turns=6, tools=[ADD])
TEMPERATURE = 0.7


class RecordingEngine(TransformersEngine):
    """The real engine, recording every batched call's prompts and choices."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts: list[list[list[int]]] = []
        self.choices: list[list[Choice]] = []

    def generate_from_tokens(self, prompt_token_ids, sampling, adapter=None):
        choices = super().generate_from_tokens(prompt_token_ids, sampling, adapter)
        self.prompts.append([list(p) for p in prompt_token_ids])
        self.choices.append(choices)
        return choices


@pytest.fixture(scope="module")
def taught_weights(tiny_model_dir, tmp_path_factory):
    """Weights of the tiny model after learning, by teacher forcing, the scripted trajectory."""
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path_factory.mktemp("taught"))
    (script,) = rollout_group(
        ScriptedEngine(tokenizer, {"Add 2, 3, 4": TAUGHT_SCRIPT}), TAUGHT_ROW, TAUGHT_ENV, SAMPLING, 1
    )
    ids = torch.tensor([script.prompt_token_ids + script.completion_token_ids])
    targets = torch.tensor([0] * (len(script.prompt_token_ids) - 1) + script.completion_mask).bool()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(40):
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)
            loss = -logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)[targets].mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def taught_model(tiny_model_dir, tmp_path, weights):
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    model.load_state_dict(weights)
    return model.eval(), tokenizer


def test_multi_turn_tokens_and_logprobs_are_exact_on_a_real_model(tiny_model_dir, tmp_path, taught_weights):
    model, tokenizer = taught_model(tiny_model_dir, tmp_path, taught_weights)
    engine = RecordingEngine(model, tokenizer)
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=40, seed=0)
    group = rollout_group(engine, TAUGHT_ROW, TAUGHT_ENV, sampling, group_size=2)

    for row, trajectory in enumerate(group):
        # The taught model really does call the tool three times, then answers.
        assert trajectory.metrics == {"turns": 4, "tool_calls": 3, "tool_errors": 0, "tool_timeouts": 0}
        assert trajectory.output_text == "The answer is 10."
        pieces = turn_pieces(engine, row, trajectory)
        sampled_ids = [ids for ids, _ in pieces]
        env_ids = [ids for _, ids in pieces]
        assert [tokenizer.decode(ids) for ids in env_ids] == [
            AFTER_ADD_5,
            AFTER_ADD_5.replace("5", "9"),
            AFTER_ADD_5.replace("5", "10"),
            "",
        ]
        # What the trainer gets: exactly the engine's sampled ids and the environment's, in turn.
        assert trajectory.completion_token_ids == [i for s, e in pieces for i in s + e]
        assert trajectory.completion_mask == [m for s, e in pieces for m in [1] * len(s) + [0] * len(e)]
        sampler_logprobs = [lp for call in engine.choices for lp in call[row].logprobs]
        mask = torch.tensor(trajectory.completion_mask).bool()
        assert [lp for lp, m in zip(trajectory.logprobs, trajectory.completion_mask, strict=True) if m] == (
            sampler_logprobs
        )
        assert all(
            lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.completion_mask, strict=True) if not m
        )
        assert sum(len(ids) for ids in sampled_ids) == int(mask.sum())

        # One teacher-forced forward over the whole sequence gives the sampler's logprobs back.
        sequence = torch.tensor([trajectory.prompt_token_ids + trajectory.completion_token_ids])
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0].float() / TEMPERATURE
        logprobs = torch.log_softmax(logits, dim=-1)
        start = len(trajectory.prompt_token_ids) - 1
        positions = torch.arange(start, start + len(trajectory.completion_token_ids))
        recomputed = logprobs[positions, torch.tensor(trajectory.completion_token_ids)]
        assert torch.allclose(recomputed[mask], torch.tensor(sampler_logprobs), atol=1e-4)


def test_the_trainer_sees_ratio_one_on_multi_turn_trajectories(tiny_model_dir, tmp_path, taught_weights):
    model, tokenizer = taught_model(tiny_model_dir, tmp_path, taught_weights)
    config = TrainConfig(group_size=2, temperature=TEMPERATURE, max_new_tokens=40, learning_rate=1e-3)
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=4, alpha=8))  # LoRA starts as a no-op
    engine = TransformersEngine(trainer.policy, tokenizer)
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=40, seed=1)
    group = rollout_group(engine, TAUGHT_ROW, TAUGHT_ENV, sampling, group_size=2)
    assert all(t.metrics["tool_calls"] == 3 for t in group)
    for reward, trajectory in enumerate(group):
        trajectory.reward = float(reward)
    metrics = grpo_train_step(trainer, [to_train_group(group)])
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["trainable_tokens"] == sum(sum(t.completion_mask) for t in group)


def test_generate_from_tokens_is_generate_without_the_rendering(tiny_model):
    model, tokenizer = tiny_model
    engine = TransformersEngine(model, tokenizer)
    requests = [[{"role": "user", "content": "Hello!"}], [{"role": "user", "content": "What is the answer?"}]]
    sampling = SamplingParams(max_new_tokens=6, seed=3)
    from_messages = engine.generate(requests, sampling)
    from_tokens = engine.generate_from_tokens([engine.render(r) for r in requests], sampling)
    assert from_tokens == from_messages
    with pytest.raises(ValueError):
        engine.generate_from_tokens([[]], sampling)
