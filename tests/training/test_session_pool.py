"""Many sessions on one base model (training.hosting.pool): two teams' sessions interleaving
forward_backward / optim_step on one copy of the base get exactly the gradients and updates each
gets on a base of its own; a session evicted under the memory budget and loaded back continues bit
for bit; the base is loaded once."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.config import LoraSpec, TrainConfig
from training.hosting.pool import SessionPool, SessionPoolError
from training.session.contract import Datum
from training.session.local import TrainingSession

ALPHA = (TrainConfig(seed=1, micro_batch_tokens=64), LoraSpec(rank=2, alpha=4, dropout=0.1))
BETA = (
    TrainConfig(seed=7, micro_batch_tokens=64),
    LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
)


def datum(tokens: list[int], trained_from: int = 1) -> Datum:
    weights = [0.0] * trained_from + [1.0] * (len(tokens) - 1 - trained_from)
    return Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


DATA = {
    "alpha": [[datum([5, 9, 14, 3, 22, 7])], [datum([5, 9, 40, 41, 42])], [datum([8, 2, 11, 12, 13, 14])]],
    "beta": [[datum([3, 4, 5, 6, 7, 8, 9])], [datum([30, 31, 2, 33])], [datum([7, 7, 8, 8, 9])]],
}


def load(source: str):
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(source)


def adapter_state(session: TrainingSession) -> list[torch.Tensor]:
    return [p.detach().clone() for p in session.trainer.trainable_parameters]


def step(session: TrainingSession, data: list[Datum]) -> tuple[list[torch.Tensor], float]:
    """One forward_backward + optim_step; the gradients it applied and the loss."""
    loss = session.forward_backward(data, "cross_entropy").loss
    grads = [p.grad.detach().clone() for p in session.trainer.trainable_parameters]
    session.optim_step(learning_rate=1e-2)
    return grads, loss


def alone(source: str, config: TrainConfig, lora: LoraSpec, batches, save_to=None) -> list:
    """The reference: one Policy on its own freshly loaded base (its adapter saved to ``save_to``)."""
    from training.session.policy import Policy

    model, tokenizer = load(source)
    session = TrainingSession(Policy(model, tokenizer, config, lora))
    history = [step(session, batch) for batch in batches]
    if save_to is not None:
        session.save_weights_for_sampler(save_to)
    return [*history, adapter_state(session)]


def identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_two_teams_interleaving_on_one_base_get_exactly_what_each_gets_alone(tiny_model_dir, tmp_path):
    source = str(tiny_model_dir)
    pool = SessionPool(load, spill_dir=tmp_path / "spill")
    pool.open("team-a/run", source, *ALPHA)
    pool.open("team-b/run", source, *BETA)
    history = {"alpha": [], "beta": []}
    # Interleaved at every primitive: a's backward, b's backward, a's step, b's forward + step, ...
    for index in range(3):
        with pool.use("team-a/run") as a:
            loss_a = a.forward_backward(DATA["alpha"][index], "cross_entropy").loss
            grads_a = [p.grad.detach().clone() for p in a.trainer.trainable_parameters]
        with pool.use("team-b/run") as b:
            loss_b = b.forward_backward(DATA["beta"][index], "cross_entropy").loss
            grads_b = [p.grad.detach().clone() for p in b.trainer.trainable_parameters]
        with pool.use("team-a/run") as a:
            a.optim_step(learning_rate=1e-2)
        with pool.use("team-b/run") as b:
            b.forward(DATA["alpha"][index])  # a read of other data in between changes nothing
            b.optim_step(learning_rate=1e-2)
        history["alpha"].append((grads_a, loss_a))
        history["beta"].append((grads_b, loss_b))
    with pool.use("team-a/run") as a:
        history["alpha"].append(adapter_state(a))
    with pool.use("team-b/run") as b:
        history["beta"].append(adapter_state(b))
    assert pool.stats()["base_loads"] == 1 and pool.stats()["sessions"] == 2

    for name, (config, lora) in (("alpha", ALPHA), ("beta", BETA)):
        reference = alone(source, config, lora, DATA[name])
        for (grads, loss), (expected_grads, expected_loss) in zip(
            history[name][:3], reference[:3], strict=True
        ):
            assert loss == expected_loss
            assert identical(grads, expected_grads), f"{name}: gradients differ from the session alone"
        assert identical(history[name][3], reference[3]), (
            f"{name}: the adapter differs from the session alone"
        )
    # The two adapters are different sessions, not one shared.
    assert len(history["alpha"][3]) != len(history["beta"][3])


def test_an_evicted_session_reloads_and_continues_bit_for_bit(tiny_model_dir, tmp_path):
    source = str(tiny_model_dir)
    batches = DATA["alpha"] + DATA["alpha"]
    reference = alone(source, *ALPHA, batches)

    pool = SessionPool(load, spill_dir=tmp_path / "spill")
    pool.open("a", source, *ALPHA)
    with pool.use("a") as a:
        per_session = a.trainer.trainable_parameters
        size = 4 * sum(p.numel() * p.element_size() for p in per_session)
    pool.budget_bytes = int(size * 1.5)  # room for one session of this size
    history = []
    for index, batch in enumerate(batches):
        with pool.use("a") as a:
            history.append(step(a, batch))
        if index in (1, 3):
            # Another team's session takes the room: "a" is saved to the spill folder and unloaded.
            pool.open(f"other-{index}", source, *ALPHA)
            assert pool.stats()["resident"] == 1 and pool.stats()["evictions"] >= 1
            assert pool._entries["a"].trainer is None and any((tmp_path / "spill").iterdir())
    with pool.use("a") as a:
        history.append(adapter_state(a))
    assert pool.reloads == 2
    for (grads, loss), (expected_grads, expected_loss) in zip(history[:-1], reference[:-1], strict=True):
        assert loss == expected_loss and identical(grads, expected_grads)
    assert identical(history[-1], reference[-1])


def test_a_session_with_gradients_not_stepped_is_never_evicted(tiny_model_dir, tmp_path):
    source = str(tiny_model_dir)
    pool = SessionPool(load, spill_dir=tmp_path / "spill", budget_bytes=1)  # room for nothing
    pool.open("a", source, *ALPHA)
    with pool.use("a") as a:
        a.forward_backward(DATA["alpha"][0], "cross_entropy")
    pool.open("b", source, *BETA)  # over budget: "b" is in use, "a" holds gradients
    assert pool._entries["a"].trainer is not None
    with pytest.raises(ValueError, match="gradients not yet stepped"):
        pool.evict("a")
    with pool.use("a") as a:
        a.optim_step(learning_rate=1e-2)
    pool.open("c", source, *BETA)  # now "a" and "b" (least recently used first) give way
    assert pool._entries["a"].trainer is None and pool._entries["b"].trainer is None
    pool.close("a")
    assert "a" not in pool and not (tmp_path / "spill" / "s1").exists()
    with pytest.raises(SessionPoolError, match="no session 'a'"), pool.use("a"):
        pass


def test_a_pooled_sessions_weights_for_the_sampler_are_its_adapter_alone(tiny_model_dir, tmp_path):
    from peft import PeftModel

    source = str(tiny_model_dir)
    pool = SessionPool(load, spill_dir=tmp_path / "spill")
    pool.open("a", source, *ALPHA)
    pool.open("b", source, *BETA)
    with pool.use("b") as b:  # no LoRA dropout: its logprobs are deterministic, as a server's are
        step(b, DATA["alpha"][0])
        b.save_weights_for_sampler(tmp_path / "sampler")
        expected = b.forward(DATA["alpha"][1])
    with pool.use("a") as a:
        step(a, DATA["alpha"][0])
    # On a base of its own (as an inference server loads it) the adapter gives the same logprobs.
    model, _ = load(source)
    served = PeftModel.from_pretrained(model, str(tmp_path / "sampler"))
    names = [n for n, _ in served.named_parameters() if "lora_" in n]
    assert names and all(".default." in n for n in names)  # one adapter, under peft's default name
    with torch.no_grad():
        tokens = DATA["alpha"][1][0].model_input + [
            int(DATA["alpha"][1][0].loss_fn_inputs["target_tokens"][-1])
        ]
        logits = served(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].tolist()
    assert logprobs[1:] == pytest.approx(expected[0][1:], abs=1e-5)


def test_a_pooled_session_samples_exactly_as_it_would_alone(tiny_model_dir, tmp_path):
    from training.engines.base import SamplingParams
    from training.session.policy import Policy

    source, prompts = str(tiny_model_dir), [[5, 9, 14], [8, 2]]
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)  # seed None: the session's own RNG
    pool = SessionPool(load, spill_dir=tmp_path / "spill")
    pool.open("a", source, *ALPHA)
    pool.open("b", source, *BETA)
    pooled = []
    with pool.use("a") as a:
        step(a, DATA["alpha"][0])
        pooled.append(a.sample(prompts, sampling))
    with pool.use("b") as b:  # another team samples in between: it draws from its own RNG
        b.sample(prompts, sampling)
    with pool.use("a") as a:
        pooled.append(a.sample(prompts, sampling))

    model, tokenizer = load(source)
    alone = TrainingSession(Policy(model, tokenizer, *ALPHA))
    step(alone, DATA["alpha"][0])
    expected = [alone.sample(prompts, sampling), alone.sample(prompts, sampling)]
    for got, want in zip(pooled, expected, strict=True):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.logprobs for c in got] == [c.logprobs for c in want]
    assert (
        pooled[0][0].token_ids != pooled[1][0].token_ids or pooled[0][1].token_ids != pooled[1][1].token_ids
    )
