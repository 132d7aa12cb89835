"""The inference server's token-in route (``POST /generate``, training.engines.token_wire): prompts as
token ids, completions as token ids with their logprobs, exactly what the same engine gives in the
worker (greedy and seeded), under a checkpoint named by path; bad input is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.training.serving.test_app_errors import post
from training.engines.base import SamplingParams
from training.serving.app import InferenceApp, ServerConfig
from training.serving.protocol import ADAPTER_HEADER, Limits

PROMPTS = [[5, 9, 14, 3], [8, 2, 11], [5, 9, 14, 3], [40, 41, 42, 43, 44]]


def call(app: InferenceApp, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    return post(app, json.dumps(body).encode(), generate=True, path="/generate", headers=headers)


@pytest.fixture
def app(engine, tmp_path) -> InferenceApp:
    config = ServerConfig(model_name="tiny", adapter_root=tmp_path, limits=Limits(max_tokens=64))
    return InferenceApp(engine, config)


def local(engine, prompts, sampling: SamplingParams, adapter: str | None = None):
    return engine.generate_from_tokens([list(p) for p in prompts], sampling, adapter=adapter)


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0, "max_new_tokens": 6},
    {"temperature": 1.0, "max_new_tokens": 6, "seed": 11, "top_logprobs": 2},
])  # fmt: skip
def test_completions_from_token_ids_are_the_engines_own(app, engine, sampling):
    status, body = call(app, {"prompts": PROMPTS, "sampling": sampling})
    assert status == 200, body
    expected = local(engine, PROMPTS, SamplingParams(**sampling))
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in expected]
    for got, want in zip(body["choices"], expected, strict=True):
        assert got["logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
        assert got["finish_reason"] == want.finish_reason and got["text"] == want.text
    assert body["stop_token_ids"] == sorted(engine.stop_token_ids)
    if sampling.get("seed") is not None:  # each prompt its own stream, as one engine call's rows
        assert body["choices"][0]["token_ids"] != body["choices"][2]["token_ids"]
        assert len(body["choices"][1]["top_logprobs"][0]) == 2


def test_a_checkpoint_named_by_its_folder_is_sampled(app, engine, tiny_model_dir, tmp_path):
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.session.policy import Policy

    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    trainer = Policy(model, tokenizer, TrainConfig(seed=4), LoraSpec(rank=2, alpha=4))
    with torch.no_grad():  # a LoRA B of zeros is the base model: make the adapter matter
        for parameter in trainer.trainable_parameters:
            parameter.add_(0.5 * torch.randn_like(parameter))
    folder = tmp_path / "step-000001"
    trainer.save_adapter(folder)
    greedy = {"temperature": 0.0, "max_new_tokens": 5}
    status, body = call(app, {"prompts": PROMPTS[:2], "sampling": greedy}, {ADAPTER_HEADER: str(folder)})
    assert status == 200, body
    engine.load_adapter("check", folder)
    try:
        expected = local(engine, PROMPTS[:2], SamplingParams(**greedy), adapter="check")
    finally:
        engine.unload_adapter("check")
    base = local(engine, PROMPTS[:2], SamplingParams(**greedy))
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in expected]
    assert body["choices"][0]["logprobs"] == pytest.approx(expected[0].logprobs, abs=1e-5)
    assert body["choices"][0]["logprobs"] != pytest.approx(base[0].logprobs, abs=1e-3)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompts": [], "sampling": {}}, "prompts"),
    ({"prompts": [[1, 2], []]}, "prompts"),
    ({"prompts": [[1, "2"]]}, "prompts"),
    ({"prompts": [[1, 2], [3, 10**7]]}, "prompts[1]"),
    ({"prompts": [[1, 2]], "sampling": {"beams": 2}}, "sampling"),
    ({"prompts": [[1, 2]], "sampling": {"temperature": -1}}, "sampling"),
    ({"prompts": [[1, 2]], "sampling": {"max_new_tokens": 65}}, "sampling.max_new_tokens"),
    ([[1, 2]], None),
])  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(app, body, param):
    status, answer = call(app, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_a_folder_outside_the_servers_root_is_refused(app, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    status, answer = call(app, {"prompts": [[1, 2]]}, {ADAPTER_HEADER: str(elsewhere)})
    assert 400 <= status < 500 and "adapter" in json.dumps(answer).lower(), answer
