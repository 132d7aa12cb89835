"""The training session core (training.session) and its named losses (training.session.losses): each loss
on hand-computed values; on the tiny model, forward's logprobs are the model's own, gradients of
several forward_backward calls add up to one call's, cross-entropy steps learn a sequence, and a
datum that does not fit is refused with its reason."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.config import LoraSpec, TrainConfig
from training.session.contract import Datum
from training.session.local import TrainingSession
from training.session.losses import LOSSES, LossInputError, LossInputs, loss_named

HALF, QUARTER = math.log(0.5), math.log(0.25)


def inputs(p=(HALF, QUARTER), q=(HALF, HALF), advantages=(1.0, 1.0), weights=(1.0, 1.0)) -> LossInputs:
    return LossInputs(
        logprobs=torch.tensor([list(p)], requires_grad=True), mask=torch.ones(1, 2), weights=torch.tensor([list(weights)]),
        inputs={"logprobs": torch.tensor([list(q)]), "advantages": torch.tensor([list(advantages)])},
    )  # fmt: skip


def value_and_grad(name: str, batch: LossInputs, **config) -> list[float]:
    """[the loss, d loss / d p for each token]."""
    loss, _ = loss_named(name)(batch, config)
    loss.backward()
    return [float(loss.detach()), *batch.logprobs.grad[0].tolist()]


def test_each_loss_on_hand_computed_values():
    # cross_entropy: -(ln .5 + ln .25) with weights 1; a weight of 0 leaves a token out.
    assert value_and_grad("cross_entropy", inputs()) == pytest.approx([3 * math.log(2), -1.0, -1.0])
    assert value_and_grad("cross_entropy", inputs(weights=(1.0, 0.0)))[0] == pytest.approx(math.log(2))
    # importance_sampling: -(r1 A + r2 A) with r = [1, 0.5]; d/dp = -r A.
    assert value_and_grad("importance_sampling", inputs()) == pytest.approx([-1.5, -1.0, -0.5])
    # ppo (0.8, 1.2): A = 1: min(r, clip r) = [1, 0.5] -> -1.5; the clipped-low token keeps its gradient.
    assert value_and_grad("ppo", inputs()) == pytest.approx([-1.5, -1.0, -0.5])
    # A = -1: max(r, clip r) = [1, 0.8]: the second token is clipped, no gradient.
    assert value_and_grad("ppo", inputs(advantages=(-1.0, -1.0))) == pytest.approx([1.8, 1.0, 0.0])
    # cispo: -sg(clip r) A p = -(1 ln .5 + 0.8 ln .25); d/dp = -clip(r) A.
    assert value_and_grad("cispo", inputs()) == pytest.approx([-(HALF + 0.8 * QUARTER), -1.0, -0.8])
    wide = value_and_grad("cispo", inputs(), clip_low_threshold=0.0, clip_high_threshold=5.0)
    assert wide == pytest.approx([-(HALF + 0.5 * QUARTER), -1.0, -0.5])
    # dro (beta 0.05): -(p A - beta/2 (p - q)^2) = -(ln .5 + ln .25 - 0.025 ln(2)^2).
    expected = -(HALF + QUARTER - 0.025 * math.log(2) ** 2)
    grad = [-1.0, -1.0 + 0.05 * (QUARTER - HALF)]
    assert value_and_grad("dro", inputs()) == pytest.approx([expected, *grad])
    # gspo: one ratio per datum, exp(mean(p - q)) = 2^-0.5 for both tokens, inside no clip range of
    # (0.8, 1.2): min(s, clip s) = 2^-0.5 -> loss -2 * 2^-0.5; each token's gradient -s A.
    assert value_and_grad("gspo", inputs()) == pytest.approx([-2 * 2**-0.5, -(2**-0.5), -(2**-0.5)])


def test_a_loss_says_what_it_needs_and_what_it_does_not_take():
    with pytest.raises(LossInputError, match="needs loss_fn_inputs\\['advantages'\\]"):
        loss_named("ppo")(
            LossInputs(
                torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), {"logprobs": torch.zeros(1, 1)}
            ),
            {},
        )
    with pytest.raises(LossInputError, match="takes no beta"):
        loss_named("ppo")(inputs(), {"beta": 1.0})
    with pytest.raises(LossInputError, match="unknown loss_fn 'reinforce'"):
        loss_named("reinforce")
    assert {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "grpo", "art"} == set(
        LOSSES
    )


@pytest.fixture
def session(tiny_model_dir):
    from training.session.policy import Policy

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    trainer = Policy(model, tokenizer, TrainConfig(micro_batch_tokens=16), LoraSpec(rank=2, alpha=4))
    return TrainingSession(trainer)


def sequence_datum(tokens: list[int], trained_from: int, **extra: float) -> Datum:
    weights = [0.0] * trained_from + [1.0] * (len(tokens) - 1 - trained_from)
    per_token = {name: [value] * (len(tokens) - 1) for name, value in extra.items()}
    return Datum(
        model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights, **per_token}
    )


def test_forward_gives_the_models_own_logprobs_of_the_weighted_targets(session):
    tokens = [5, 9, 14, 3, 22, 7, 30]
    (logprobs,) = session.forward([sequence_datum(tokens, 2)])
    with torch.no_grad():
        logits = session.trainer.model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(6), torch.tensor(tokens[1:])].tolist()
    assert logprobs[:2] == [0.0, 0.0]  # before the first weighted target: not computed
    assert logprobs[2:] == pytest.approx(expected[2:], abs=1e-5)


def test_gradients_of_several_calls_add_up_to_one_calls(session):
    data = [sequence_datum([5, 9, 14, 3, 22], 1, logprobs=-2.0, advantages=1.0),
            sequence_datum([5, 9, 40, 41, 42, 43], 1, logprobs=-2.0, advantages=-0.5),
            sequence_datum([8, 2, 11], 0, logprobs=-1.0, advantages=2.0)]  # fmt: skip
    params = session.trainer.trainable_parameters

    def grads() -> list[torch.Tensor]:
        out = [p.grad.clone() for p in params]
        session.trainer.optimizer.zero_grad(set_to_none=True)
        return out

    whole = session.forward_backward(data, "ppo")
    together = grads()
    first = session.forward_backward(data[:2], "ppo")
    second = session.forward_backward(data[2:], "ppo")
    apart = [a for a in grads()]
    assert whole.loss == pytest.approx(first.loss + second.loss, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(together, apart, strict=True))
    assert (
        len(whole.logprobs) == 3 and len(whole.logprobs[1]) == 5 and whole.metrics["loss:sum"] == whole.loss
    )


def test_cross_entropy_steps_learn_a_sequence_and_state_round_trips(session, tmp_path):
    datum = sequence_datum([5, 9, 14, 3, 22, 7, 30, 2], 3)
    losses = []
    for _ in range(8):
        losses.append(session.forward_backward([datum], "cross_entropy").loss)
        stepped = session.optim_step(learning_rate=5e-2)
        assert stepped["grad_norm"] > 0 and stepped["learning_rate"] == 5e-2
    assert losses[-1] < losses[0] * 0.8, losses
    session.save_state(tmp_path / "state", step=8, metrics={"loss": losses[-1]})
    session.save_weights_for_sampler(tmp_path / "sampler")
    assert (tmp_path / "sampler" / "adapter_model.safetensors").exists()
    # load_state continues exactly: the same logprobs now, and the same next step.
    trainer = session.trainer
    fresh = AutoModelForCausalLM.from_pretrained(
        str(session.trainer.tokenizer.name_or_path), dtype=torch.float32
    )
    loaded = TrainingSession.load_state(
        fresh, trainer.tokenizer, tmp_path / "state", trainer.config, trainer.lora
    )
    assert loaded.forward([datum]) == session.forward([datum])
    steps = [s.forward_backward([datum], "cross_entropy").loss for s in (session, loaded)]
    for s in (session, loaded):
        s.optim_step(learning_rate=5e-2)
    assert steps[0] == pytest.approx(steps[1], abs=1e-6)
    (after_saved,), (after_loaded,) = session.forward([datum]), loaded.forward([datum])
    assert after_loaded == pytest.approx(after_saved, abs=1e-5)  # the optimizer's moments came back too


def test_a_datum_that_does_not_fit_is_refused_with_its_reason():
    with pytest.raises(LossInputError, match="shifted by one"):
        Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 9, 4]})
    with pytest.raises(LossInputError, match="one token per model_input"):
        Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(LossInputError, match="weights has 2 values"):
        Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1, 1]})


def test_the_padded_layout_gives_the_same_logprobs_and_loss_as_the_packed_one(session):
    # Attention kernels without 4-D masks (flash-attention on GPU) get left-padded rows.
    data = [sequence_datum([5, 9, 14, 3, 22], 1, logprobs=-2.0, advantages=1.0),
            sequence_datum([8, 2, 11, 12], 0, logprobs=-1.0, advantages=-1.0)]  # fmt: skip
    packed = session.forward(data), session.forward_backward(data, "cispo").loss
    session.trainer.optimizer.zero_grad(set_to_none=True)
    session.trainer.packed = False
    padded = session.forward(data), session.forward_backward(data, "cispo").loss
    for a, b in zip(packed[0], padded[0], strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert packed[1] == pytest.approx(padded[1], rel=1e-5)


def test_every_session_refuses_token_ids_outside_the_vocabulary_naming_datum_and_position(session):
    """A bad id is refused before it reaches the embedding (an IndexError on the CPU, a device-side
    assert on CUDA), for inputs, targets and sample prompts, negative ids too."""
    from training.engines.base import SamplingParams

    vocabulary = session.vocabulary
    good = sequence_datum([5, 9, 14, 3, 22], trained_from=1)
    bad_input = Datum(model_input=[5, 9, 10**6], loss_fn_inputs={"target_tokens": [9, 10**6, 4]})
    with pytest.raises(
        LossInputError, match=rf"data\[1\]\.model_input\[2\]: token id 1000000 .*{vocabulary}"
    ):
        session.forward_backward([good, bad_input], "cross_entropy")
    bad_target = Datum(model_input=[5, 9], loss_fn_inputs={"target_tokens": [9, -1]})
    with pytest.raises(LossInputError, match=r"data\[0\]\.loss_fn_inputs\.target_tokens\[1\]: token id -1"):
        session.forward([bad_target])
    assert all(p.grad is None for p in session.trainer.trainable_parameters)  # nothing ran
    sampling = SamplingParams(max_new_tokens=4)
    with pytest.raises(LossInputError, match=rf"prompts\[1\]\[0\]: token id {vocabulary} "):
        session.sample([[5, 9], [vocabulary, 3]], sampling)
    # The prompt plus max_new_tokens must fit the model's context (1024 for the tiny model).
    with pytest.raises(
        LossInputError, match=r"prompts\[0\]: 2 prompt tokens plus max_new_tokens 1023 exceed"
    ):
        session.sample([[5, 9]], SamplingParams(max_new_tokens=1023))
    assert len(session.sample([[5, 9]], SamplingParams(max_new_tokens=2))[0].token_ids) <= 2


def test_a_data_parallel_session_refuses_a_bad_token_id_before_any_rank_gets_the_call(session):
    """The mirrored (data-parallel) session checks the whole call on rank 0, so the message names the
    datum's index in the call (not in a rank's share) and no follower is sent a call to fail on."""
    from training.hosting.followers import MirroredSession

    class Followers:
        generation, sent = 0, []

        def send(self, message):
            self.sent.append(message)

    followers = Followers()
    mirrored = MirroredSession(session, followers)  # type: ignore[arg-type]
    good = sequence_datum([5, 9, 14, 3], trained_from=1)
    bad = Datum(model_input=[5, -3], loss_fn_inputs={"target_tokens": [-3, 4]})
    with pytest.raises(LossInputError, match=r"data\[2\]\.model_input\[1\]: token id -3 is outside"):
        mirrored.forward_backward([good, good, bad], "cross_entropy")
    with pytest.raises(LossInputError, match=r"data\[0\]\.model_input\[1\]"):
        mirrored.forward(data=[bad])
    assert followers.sent == []
