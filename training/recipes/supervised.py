"""SFT and DPO runs: the same run loop contract as GRPO (``training.runs.loop``: checkpoints, steps,
evaluations, resume), on the session core's primitives, with targets from the task rows instead of
rollouts and rewards.

Rows:
- SFT: ``{"prompt": ..., "completion": "..."}`` or ``{"messages": [..., {"role": "assistant", ...}]}``
  (the conversation ends with the assistant's reply). Every assistant message is a target, but one
  with ``"weight": 0`` (context, as in OpenAI's files): ``cross_entropy`` on its tokens only (its
  end-of-turn token included), weights 1 / (the batch's target tokens), so the loss is the mean
  negative log-likelihood per target token. A row may offer ``tools`` (OpenAI's function
  definitions) and hold assistant ``tool_calls`` and ``tool`` messages: it is rendered as a rollout
  renders such a conversation (``training.rollouts.agent.offer_tools``: the template's ``tools=``
  where it shows tools, else the tools in the system prompt and the calls written into the
  content), and a target's tool-call tokens are targets; the tool messages are not.
- DPO: ``{"prompt" | "messages": ..., "chosen": ..., "rejected": ...[, "tools"]}`` (each a string or
  an assistant message, which may hold ``tool_calls``). The loss is DPO's ``-log σ(β·((π_c - ρ_c) - (π_r - ρ_r)))`` over sequence
  log-likelihoods (π: the policy, ρ: the reference, the run's start checkpoint), with β the config's
  ``dpo_beta``. Its gradient is applied exactly through ``cross_entropy``: a forward pass gives each
  sequence's coefficient ``∂L/∂π``, and a linear loss with those coefficients as token weights has the
  same gradient (Tinker's ``forward_backward_custom`` trick), so DPO needs no loss of its own.

Each step trains on ``groups_per_step`` rows (deterministic in seed and step, as GRPO's rows).
Evaluation: at the loop's evaluation steps, the held-out loss (SFT) or preference accuracy (DPO) on
the validation rows goes into the step's metrics (step 0's into an event), and the task's reward
grades the policy's answers to the validation prompts (``training.runs.evaluation``), as in a GRPO run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import time
from dataclasses import dataclass
from typing import Any

from training.cost import device_usage
from training.engines.base import render_chat
from training.environments.base import prompt_messages
from training.recipes.schedules import learning_rate_at
from training.rollouts.agent import for_template, offer_tools, template_supports_tools
from training.rollouts.trajectory import TrainSample
from training.runs.evaluation import evaluate_during_run, is_evaluation_step
from training.runs.progress import phase, step_label
from training.session.contract import Session, datum_of

OBJECTIVES = ("sft", "dpo")


class RowError(ValueError):
    """A task row an SFT or DPO run cannot train on; the message names the row."""


# ---------------------------------------------------------------------- rows
def row_problem(row: dict[str, Any], objective: str) -> str | None:
    """Why ``row`` (a task row's data) cannot train an ``objective`` run, or None. Checked when the
    run is created, without a tokenizer."""
    if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
        return "needs 'prompt' or 'messages'"
    if objective == "sft":
        if "completion" in row:
            return None if isinstance(row["completion"], str) else "'completion' must be a string"
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            return "needs a 'completion', or 'messages' ending with the assistant's reply"
        if messages[-1].get("role") != "assistant":
            return "needs a 'completion', or 'messages' ending with the assistant's reply"
        if all(
            m.get("weight") == 0 for m in messages if isinstance(m, dict) and m.get("role") == "assistant"
        ):
            return "every assistant message has weight 0: there is nothing to train on"
        return None
    if objective == "dpo":
        for name in ("chosen", "rejected"):
            if name not in row:
                return f"needs '{name}' (a string or an assistant message)"
            if _reply(row[name]) is None:
                return f"'{name}' must be a string or an assistant message"
        return None
    raise ValueError(f"unknown objective {objective!r}")


def _reply(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("role", "assistant") == "assistant":
        content = value.get("content")
        if content is None and value.get("tool_calls"):
            return ""
        return content if isinstance(content, str) else None
    return None


def sft_sample(tokenizer: Any, row: dict[str, Any], system_prompt: str) -> TrainSample:
    """The row's conversation as one sample: the prompt up to the first target (an assistant reply
    without weight 0), then the rest, with the targets' tokens marked (mask 1), tool calls included."""
    problem = row_problem(row, "sft")
    if problem:
        raise RowError(problem)
    messages = prompt_messages(row, system_prompt)
    if "completion" in row:
        messages.append({"role": "assistant", "content": row["completion"]})
    definitions = row.get("tools") or []
    if not definitions and not any(m.get("tool_calls") or "weight" in m for m in messages):

        def render(conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
            return render_chat(tokenizer, conversation, add_generation_prompt=add_generation_prompt)

    else:  # as a rollout offers these tools and renders these calls (training.rollouts.agent)
        native = bool(definitions) and template_supports_tools(tokenizer)
        messages = offer_tools(messages, definitions, native=native)

        def render(conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
            return render_chat(tokenizer, for_template(conversation), tools=definitions if native else None,
                               add_generation_prompt=add_generation_prompt)  # fmt: skip

    full = render(messages, add_generation_prompt=False)
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and m.get("weight") != 0]
    prompt = render(messages[: replies[0]])
    mask = [0] * (len(full) - len(prompt))
    for index in replies:
        before = render(messages[:index])
        through = render(messages[: index + 1], add_generation_prompt=False)
        if full[: len(before)] != before or full[: len(through)] != through or len(through) <= len(before):
            raise RowError(
                "the chat template does not render this conversation turn by turn (an earlier turn "
                "is written differently once a later one follows), so its targets cannot be marked"
            )
        for position in range(len(before), len(through)):
            mask[position - len(prompt)] = 1
    completion = full[len(prompt) :]
    return TrainSample(prompt, completion, [0.0] * len(completion), reward=0.0, completion_mask=mask)


@dataclass
class Pair:
    chosen: TrainSample
    rejected: TrainSample


def dpo_pair(tokenizer: Any, row: dict[str, Any], system_prompt: str) -> Pair:
    problem = row_problem(row, "dpo")
    if problem:
        raise RowError(problem)
    context = {key: value for key, value in row.items() if key in ("prompt", "messages", "tools")}
    replies = []
    for name in ("chosen", "rejected"):
        reply = row[name]
        if isinstance(reply, dict) and reply.get("tool_calls"):  # the reply's calls are targets too
            before = context.get("messages") or [{"role": "user", "content": context["prompt"]}]
            conversation = [*before, {**reply, "role": "assistant", "content": _reply(reply)}]
            example = {
                "messages": conversation,
                **({"tools": context["tools"]} if "tools" in context else {}),
            }
        else:
            example = {**context, "completion": _reply(reply)}
        replies.append(sft_sample(tokenizer, example, system_prompt))
    return Pair(*replies)


def prompt_row(row: dict[str, Any]) -> dict[str, Any]:
    """A training row as a prompt for evaluation: the conversation before its (last) reply."""
    prompt = {key: value for key, value in row.items() if key not in ("completion", "chosen", "rejected")}
    messages = prompt.get("messages")
    if "completion" not in row and isinstance(messages, list) and messages and "chosen" not in row:
        last_user = max((i for i, m in enumerate(messages) if m.get("role") != "assistant"), default=-1)
        prompt["messages"] = messages[: last_user + 1]
    return prompt


# ---------------------------------------------------------------------- losses
def sft_data(samples: list[TrainSample]) -> list[Any]:
    """Datums for ``cross_entropy``: weight 1 / (all target tokens) on each target token."""

    total = max(sum(s.trainable_tokens() for s in samples), 1)
    return [datum_of(s, weights=[bit / total for bit in (s.completion_mask or [])]) for s in samples]


def sequence_logprobs(sample: TrainSample, logprobs: list[float]) -> float:
    """The sum of a sample's target tokens' logprobs, from ``TrainingSession.forward``'s output
    (one per target position; the completion starts at the prompt's last position)."""
    start = len(sample.prompt_token_ids) - 1
    mask = sample.completion_mask or [1] * len(sample.completion_token_ids)
    return sum(value for value, bit in zip(logprobs[start:], mask, strict=False) if bit)


def dpo_terms(
    policy: list[tuple[float, float]], reference: list[tuple[float, float]], beta: float
) -> tuple[float, list[tuple[float, float]], dict[str, float]]:
    """DPO over pairs of sequence log-likelihoods ``(chosen, rejected)``: the mean loss, each pair's
    ``(∂L/∂π_chosen, ∂L/∂π_rejected)``, and metrics (reward accuracy: the implicit reward margin
    above 0; preference accuracy: the policy likes the chosen reply more; the mean margin)."""
    count = max(len(policy), 1)
    loss, grads, above, prefers, margins = 0.0, [], 0, 0, 0.0
    for (chosen, rejected), (ref_chosen, ref_rejected) in zip(policy, reference, strict=True):
        margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
        loss += _softplus(-margin) / count  # -log σ(m)
        weight = beta * _sigmoid(-margin) / count
        grads.append((-weight, weight))
        above += margin > 0
        prefers += chosen > rejected
        margins += margin / beta / count if beta else 0.0
    metrics = {
        "reward_accuracy": above / count,
        "preference_accuracy": prefers / count,
        "reward_margin": margins,
    }
    return loss, grads, metrics


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _with_weights(sample: TrainSample, coefficient: float) -> Any:
    """A datum whose ``cross_entropy`` gradient is ``coefficient`` × ∇(the sample's log-likelihood)."""

    return datum_of(sample, weights=[-coefficient * bit for bit in (sample.completion_mask or [])])


# ---------------------------------------------------------------------- the run
class _Objective:
    """What differs between SFT and DPO: the examples, one update, the held-out measurement."""

    def __init__(self, spec: Any, session: Session, tokenizer: Any, reference: Any) -> None:
        self.spec, self.session, self.reference = spec, session, reference
        self.kind = spec.objective
        system = spec.environment.system_prompt
        build = sft_sample if self.kind == "sft" else dpo_pair
        self.examples = {row["index"]: _example(build, tokenizer, row, system) for row in spec.train_rows}
        self.held_out = [_example(build, tokenizer, row, system) for row in spec.validation_rows]

    def update(self, rows: list[dict[str, Any]], rate: float) -> dict[str, float]:
        examples = [self.examples[row["index"]] for row in rows]
        config = self.spec.config
        if self.kind == "sft":
            result = self.session.forward_backward(sft_data(examples), "cross_entropy")
            metrics = {
                "loss": result.loss,
                "trainable_tokens": float(sum(s.trainable_tokens() for s in examples)),
            }
        else:
            loss, grads, metrics = self._dpo(examples, config.dpo_beta)
            data = [
                datum
                for pair, (d_chosen, d_rejected) in zip(examples, grads, strict=True)
                for datum in (_with_weights(pair.chosen, d_chosen), _with_weights(pair.rejected, d_rejected))
            ]
            self.session.forward_backward(data, "cross_entropy")
            metrics = {**metrics, "loss": loss, "trainable_tokens": float(sum(
                p.chosen.trainable_tokens() + p.rejected.trainable_tokens() for p in examples))}  # fmt: skip
        stepped = self.session.optim_step(learning_rate=rate, weight_decay=config.weight_decay)
        return {**metrics, "grad_norm": stepped["grad_norm"], "learning_rate": rate}

    def _dpo(
        self, pairs: list[Pair], beta: float
    ) -> tuple[float, list[tuple[float, float]], dict[str, float]]:
        samples = [sample for pair in pairs for sample in (pair.chosen, pair.rejected)]

        data = [datum_of(sample) for sample in samples]
        sums = [
            sequence_logprobs(s, values)
            for s, values in zip(samples, self.session.forward(data), strict=True)
        ]
        ref = self.session.forward(data, reference=self.reference)
        ref_sums = [sequence_logprobs(s, values) for s, values in zip(samples, ref, strict=True)]
        return dpo_terms(list(zip(sums[::2], sums[1::2], strict=True)),
                         list(zip(ref_sums[::2], ref_sums[1::2], strict=True)), beta)  # fmt: skip

    def measure(self) -> dict[str, float]:
        """The held-out figure: mean NLL per target token (SFT); DPO's loss and accuracies."""
        if not self.held_out:
            return {}
        if self.kind == "sft":
            result = self.session.forward_backward(
                sft_data(self.held_out), "cross_entropy", forward_only=True
            )
            return {"heldout_loss": result.loss}
        loss, _, metrics = self._dpo(self.held_out, self.spec.config.dpo_beta)
        return {"heldout_loss": loss, **{f"heldout_{name}": value for name, value in metrics.items()}}


def _example(build: Any, tokenizer: Any, row: dict[str, Any], system: str) -> Any:
    try:
        return build(tokenizer, row["data"], system)
    except RowError as exc:
        raise RowError(f"task row {row['index']}: {exc}") from None


def run_supervised(spec: Any, hooks: Any, trainer: Any, tokenizer: Any, dtype: Any, current: int,
                   followers: Any = None) -> str:  # fmt: skip
    """Train ``spec`` (a ``training.runs.loop.RunSpec`` with objective sft or dpo) from ``current`` with
    ``trainer`` (``training.runs.loop.start_run``'s: in this process, or a session on the host's
    trainer service); the outcome as ``run_training``'s. With ``followers`` (``devices`` > 1,
    training.hosting.followers.Followers) every primitive runs over all ranks (``MirroredSession``) and
    an update a rank is lost in is redone from the checkpoint before it."""
    from training.runs.sampler import PolicySampler
    from training.runs.steps import checkpoint_path, rows_for_step

    config = spec.config
    session: Session = trainer.run_session(followers)
    objective = _Objective(spec, session, tokenizer, checkpoint_path(spec.checkpoint_root, spec.start_step))
    # A sharded base (fsdp) cannot sample on rank 0 alone: the held-out answers are then sampled by
    # a copy of the base of its own, which loads each saved checkpoint (as an overlapped GRPO run's).
    sampler = PolicySampler(spec, trainer, tokenizer, dtype, current, detached=config.fsdp)
    try:
        evaluation = dataclasses.replace(
            spec, validation_rows=[{**row, "data": prompt_row(row["data"])} for row in spec.validation_rows]
        )
        final_step = spec.start_step + config.steps
        if spec.resume_step is None:
            held = objective.measure()
            if held:
                hooks.event(f"Held-out before training: {_describe(held)}", data={"step": current, **held})
            evaluate_during_run(evaluation, sampler.engine, sampler.adapter, current, hooks)
        for step in range(current + 1, final_step + 1):
            reason = hooks.should_stop()
            if reason:
                return reason
            started = time.monotonic()
            label = step_label(step, start_step=spec.start_step, final_step=final_step)
            phase(hooks, "updating", f"{label}: {spec.objective} update", step=step)
            sampler.before_update()
            rows = rows_for_step(spec.train_rows, seed=config.seed, step=step, count=config.groups_per_step)
            rate = learning_rate_at(config, step - spec.start_step, config.steps)
            if followers is None:
                metrics = objective.update(rows, rate)
            else:
                metrics = followers.run(trainer, functools.partial(objective.update, rows, rate),
                                        checkpoint=checkpoint_path(spec.checkpoint_root, step - 1),
                                        on_restart=lambda message: hooks.event(message, level="warn"))  # fmt: skip
                metrics["update_devices"] = float(followers.world_size)
            metrics["train_seconds"] = time.monotonic() - started
            evaluated = is_evaluation_step(step, start_step=spec.start_step, final_step=final_step,
                                           interval=config.eval_interval)  # fmt: skip
            if evaluated:
                metrics.update(objective.measure())
            path = checkpoint_path(spec.checkpoint_root, step)
            phase(hooks, "saving", f"{label}: saving checkpoint", step=step)
            if path.exists():
                shutil.rmtree(path)
            trainer.save_checkpoint(path, step=step, metrics=metrics)
            sampler.use_checkpoint(step, path)
            metrics["step_seconds"] = time.monotonic() - started
            metrics.update(device_usage(spec.device, metrics["step_seconds"]))
            if not hooks.record_step(step=step, metrics=metrics, trajectories=[], path=path):
                return "lost"
            if evaluated:
                evaluate_during_run(evaluation, sampler.engine, sampler.adapter, step, hooks)
        return "succeeded"
    finally:
        sampler.release()


def _describe(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.4g}" for name, value in metrics.items())
