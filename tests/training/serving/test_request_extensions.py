"""vLLM's request extensions that OpenPipe ART 0.5.23 sends on every completion (issue 23):
accepted, honoured where the engine can, and a clear 400 where it cannot, never ignored."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from training.engines.sampling import sample_tokens
from training.serving.protocol import Limits, RequestError, parse_chat_request

USER = [{"role": "user", "content": "hi"}]
CPU = Limits(max_n=4, max_tokens=100)  # the CPU engine: top_k and min_p only
# What openpipe-art 0.5.23's model.openai_client() adds to every request.
ART_0_5_23_EXTRAS = {
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "nvext": {"extra_fields": ["engine_data"]},
    "chat_template_kwargs": {"preserve_thinking": True},
}


def parse(limits: Limits = CPU, **body: Any):
    return parse_chat_request({"model": "m", "messages": USER, **body}, limits)


def test_art_0_5_23s_default_extras_are_accepted():
    request = parse(**ART_0_5_23_EXTRAS)
    assert request.return_token_ids and request.return_tokens_as_token_ids
    assert request.chat_template_kwargs == {"preserve_thinking": True}


def test_vllm_sampling_parameters_are_read_and_minus_one_means_off():
    request = parse(top_k=-1, min_p=0.05)
    assert (request.top_k, request.min_p) == (0, 0.05)
    assert parse(top_k=5).top_k == 5


@pytest.mark.parametrize(
    "name, value", [("repetition_penalty", 1.1), ("frequency_penalty", 0.5), ("presence_penalty", -0.5),
                    ("logit_bias", {"42": 5})],
)  # fmt: skip
def test_a_sampling_parameter_the_engine_cannot_apply_is_a_400_not_ignored(name, value):
    with pytest.raises(RequestError) as caught:
        parse(**{name: value})
    assert (caught.value.param, caught.value.code) == (name, "unsupported_parameter")
    # At its default it asks for nothing: accepted.
    default = {"repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}}
    parse(**{name: default[name]})
    # The gateway checks the shape only; a vLLM server applies it.
    request = parse(Limits.shape_only(), **{name: value})
    expected = {42: 5.0} if name == "logit_bias" else value
    assert getattr(request, name) == expected


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 3}, "repetition_penalty"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "chat_template_kwargs.chat_template"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": {"x": {"nested": 1}}}, "chat_template_kwargs.x"),
        ({"chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    ],
)
def test_bad_extension_values_name_the_parameter(body, param):
    with pytest.raises(RequestError) as caught:
        parse(Limits.shape_only(), **body)
    assert caught.value.param == param


def test_top_k_and_min_p_truncate_the_draw_but_not_the_reported_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    full = torch.log_softmax(logits, dim=-1)[0]
    uniforms = torch.linspace(0.001, 1.0, 400, dtype=torch.float64)
    rows = logits.expand(400, -1)
    for top_k, min_p, allowed in ((1, 0.0, {0}), (2, 0.0, {0, 1}), (0, math.exp(-1.6), {0, 1, 2})):
        sampled = sample_tokens(
            rows, [1.0] * 400, [1.0] * 400, uniforms, top_ks=[top_k] * 400, min_ps=[min_p] * 400
        )
        drawn = set(sampled.tokens.tolist())
        assert drawn == allowed, (top_k, min_p, drawn)
        for token, logprob in zip(sampled.tokens.tolist(), sampled.logprobs.tolist(), strict=True):
            assert logprob == pytest.approx(full[token].item(), abs=1e-6)  # the whole distribution's
    # Untruncated rows in the same batch are drawn from everything.
    mixed = sample_tokens(logits.expand(2, -1), [1.0, 1.0], [1.0, 1.0], torch.tensor([1.0, 1.0], dtype=torch.float64),
                          top_ks=[1, 0], min_ps=[0.0, 0.0])  # fmt: skip
    assert mixed.tokens.tolist() == [0, 4]  # u = 1 takes the last token when nothing is cut


def test_top_k_with_top_p_renormalises_what_top_k_left():
    # weights after the shift: 1, e^-1, e^-2 ...; top_k 2 leaves {0, 1}; top_p 0.5 of that keeps 0 only.
    logits = torch.tensor([[0.0, -1.0, -2.0, -3.0]]).expand(50, -1)
    uniforms = torch.linspace(0.01, 1.0, 50, dtype=torch.float64)
    sampled = sample_tokens(logits, [1.0] * 50, [0.5] * 50, uniforms, top_ks=[2] * 50, min_ps=[0.0] * 50)
    assert set(sampled.tokens.tolist()) == {0}
    sampled = sample_tokens(logits, [1.0] * 50, [0.8] * 50, uniforms, top_ks=[2] * 50, min_ps=[0.0] * 50)
    assert set(sampled.tokens.tolist()) == {0, 1}  # 1 / (1 + e^-1) = 0.73 < 0.8: both kept


# --- the CPU inference server ------------------------------------------------------------------


def post(app, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One request through the app with its lifespan running (the scheduler samples)."""
    from tests.training.serving.test_serving_metrics import serve

    ((status, raw),) = serve(app, [("POST", "/v1/chat/completions", body, {})])
    return status, json.loads(raw)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from training.base_models import load_base_model

    return load_base_model(str(tiny_model_dir), tiny_model_dir.parent)


def _app(loaded, tmp_path, template: str | None = None):
    import copy

    from training.engines.transformers_engine import TransformersEngine
    from training.serving.app import InferenceApp, ServerConfig

    model, tokenizer = loaded
    if template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = template
    return InferenceApp(
        TransformersEngine(model, tokenizer), ServerConfig(model_name="tiny", adapter_root=tmp_path)
    )


def test_the_server_answers_art_0_5_23s_request_with_ids_as_logprob_tokens(loaded, tmp_path):
    app = _app(loaded, tmp_path)
    status, body = post(app, {"model": "tiny", "messages": USER, "max_tokens": 4, "logprobs": True,
                              "top_logprobs": 2, "seed": 3, **ART_0_5_23_EXTRAS})  # fmt: skip
    assert status == 200, body
    (choice,) = body["choices"]
    entries = choice["logprobs"]["content"]
    assert [entry["token"] for entry in entries] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert all(alt["token"].startswith("token_id:") for entry in entries for alt in entry["top_logprobs"])
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]  # 0.5.23's reply check


def test_chat_template_kwargs_reach_the_template(loaded, tmp_path):
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}NO-THINK {% endif %}assistant:"
    )
    app = _app(loaded, tmp_path, template)
    common = {"model": "tiny", "messages": USER, "max_tokens": 1, "return_token_ids": True, "seed": 0}
    _, plain = post(app, common)
    _, off = post(app, {**common, "chat_template_kwargs": {"enable_thinking": False}})
    tokenizer = loaded[1]
    assert "NO-THINK" not in tokenizer.decode(plain["prompt_token_ids"])
    assert tokenizer.decode(off["prompt_token_ids"]).endswith("NO-THINK assistant:")


def test_the_cpu_server_refuses_repetition_penalty_rather_than_ignoring_it(loaded, tmp_path):
    status, body = post(
        _app(loaded, tmp_path), {"model": "tiny", "messages": USER, "repetition_penalty": 1.2}
    )
    assert status == 400 and body["error"]["param"] == "repetition_penalty"
