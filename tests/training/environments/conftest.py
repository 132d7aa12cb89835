"""An engine whose replies come from a policy function of the conversation so far, so environment
tests fix what the "model" says; and the tiny model's tokenizer (ChatML, no tool support)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import AutoTokenizer

from training.engines.base import Choice, Engine


class PolicyEngine(Engine):
    """Replies `policy(prompt_text)` to each prompt; records prompts and choices per batched call."""

    def __init__(self, tokenizer, policy: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.policy = policy
        self.prompts: list[list[list[int]]] = []
        self.choices: list[list[Choice]] = []

    def generate_from_tokens(self, prompt_token_ids, sampling, adapter=None):
        choices = []
        for prompt in prompt_token_ids:
            text = self.policy(self.tokenizer.decode(prompt))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
            choices.append(Choice(text, list(prompt), ids, logprobs, finish_reason="stop"))
        self.prompts.append([list(p) for p in prompt_token_ids])
        self.choices.append(choices)
        return choices

    def load_adapter(self, name, path):
        raise NotImplementedError

    def unload_adapter(self, name):
        raise NotImplementedError


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def policy_engine(tiny_tokenizer):
    return lambda policy: PolicyEngine(tiny_tokenizer, policy)


@pytest.fixture
def token_exact(tiny_tokenizer):
    return lambda engine, trajectory: assert_token_exact(engine, trajectory, tiny_tokenizer)


def assert_token_exact(engine: PolicyEngine, trajectory, tokenizer) -> None:
    """For an engine that ran ONE episode: the trajectory is each turn's sampled ids (mask 1) then
    the environment's ids (mask 0), each prompt continuing the one before, and it reads back as the
    chat template renders the transcript."""
    prompts = [call[0] for call in engine.prompts]
    choices = [call[0] for call in engine.choices]
    assert prompts[0] == trajectory.prompt_token_ids
    ids: list[int] = []
    mask: list[int] = []
    for k, choice in enumerate(choices[: trajectory.metrics["turns"]]):
        ids += choice.token_ids
        mask += [1] * len(choice.token_ids)
        if k + 1 < trajectory.metrics["turns"]:
            following = prompts[k + 1]
            start = len(trajectory.prompt_token_ids) + len(ids)
            assert following[:start] == trajectory.prompt_token_ids + ids
            environment_ids = following[start:]
            assert environment_ids, "an environment turn between two model turns has tokens"
            ids += environment_ids
            mask += [0] * len(environment_ids)
    assert trajectory.completion_token_ids == ids
    assert trajectory.completion_mask == mask
    assert len(trajectory.logprobs) == len(ids)
    assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, mask, strict=True) if not m)
    text = tokenizer.decode(trajectory.prompt_token_ids + trajectory.completion_token_ids)
    assert text + "\n" == tokenizer.apply_chat_template(trajectory.messages, tokenize=False)
