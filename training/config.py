"""Run hyperparameters and LoRA settings.

Both are plain dataclasses. Every field carries a one-line help in its metadata; the REST API and
the dashboard show it through `field_help()`. An instance is validated in `__post_init__`, so a
config that exists is a valid one, whether it came from `from_dict` (user JSON) or from code.

Why one module of this length: ~60 run settings, each with its bounds and the line of help the API
and the dashboard show, and the rules between them (``__post_init__``, ``check_objective``,
``resolved``); split, a rule would live apart from the fields it relates.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Self

from training import names as names_help
from training.recipes.schedules import default_learning_rate

LOSS_TYPES = ("ppo", "cispo")
LR_SCHEDULES = ("constant", "cosine", "linear")
ROLLOUT_PLACES = ("worker", "inference_servers")  # TrainConfig.rollouts_on
NORMALIZATIONS = ("sequence", "token", "constant")
IMPORTANCE_LEVELS = ("token", "sequence")

# The seven projections of a Llama-style block: attention and MLP.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """Bad hyperparameters. `field` and `message` name the first so the API can point at the
    offending key; `problems` lists every `(field, message)` found, so a form shows them all at once."""

    def __init__(self, field: str, message: str, *, problems: list[tuple[str, str]] | None = None) -> None:
        self.field = field
        self.message = message
        self.problems = problems or [(field, message)]
        super().__init__("; ".join(f"{name}: {text}" for name, text in self.problems))

    @classmethod
    def of(cls, problems: list[tuple[str, str]]) -> ConfigError:
        (field, message), *_ = problems
        return cls(field, message, problems=problems)


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


@dataclass(frozen=True)
class Bounds:
    """The range a number must lie in; `why` is the reason for the maximum, shown in the error."""

    minimum: float
    maximum: float
    above_minimum: bool = False  # True: the minimum itself is refused (must be greater than it)
    why: str = ""

    def problem(self, value: float) -> str | None:
        low_ok = value > self.minimum if self.above_minimum else value >= self.minimum
        if low_ok and value <= self.maximum:
            return None
        low = f"greater than {self.minimum:g}" if self.above_minimum else f"at least {self.minimum:g}"
        reason = f" ({self.why})" if self.why and value > self.maximum else ""
        return f"must be {low} and at most {self.maximum:g}{reason}"


SEED_MAX = 2**32 - 1  # numpy, torch and Python's random all take a 32-bit seed
MAX_COMPLETIONS_PER_STEP = 8192  # groups_per_step × group_size


class _Settings:
    """Shared `from_dict` / `to_dict` / `field_help` and type checking for the config dataclasses."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The config `data` describes; ConfigError listing every unknown key and bad value."""
        if not isinstance(data, dict):
            raise ConfigError("__all__", f"expected an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = [
            (str(key), names_help.unknown("hyperparameter", str(key), names, quoted=False))
            for key in data
            if key not in names
        ]
        try:
            config = cls(**{key: value for key, value in data.items() if key in names})
        except ConfigError as exc:
            raise ConfigError.of(unknown + exc.problems) from None
        if unknown:
            raise ConfigError.of(unknown)
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def field_help(cls) -> dict[str, dict[str, Any]]:
        hints = typing.get_type_hints(cls)
        out: dict[str, dict[str, Any]] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            missing = f.default is dataclasses.MISSING
            default = f.default_factory() if missing else f.default  # type: ignore[misc,operator]
            entry = {"default": default, "help": f.metadata["help"], "type": _type_name(hints[f.name])}
            if "choices" in f.metadata:
                entry["choices"] = list(f.metadata["choices"])
            if "bounds" in f.metadata:
                entry["minimum"] = f.metadata["bounds"].minimum
                entry["maximum"] = f.metadata["bounds"].maximum
            out[f.name] = entry
        return out

    def _check(self, *rules: tuple[str, Callable[[], bool], str]) -> None:
        """Coerce ints given for float fields, then check types, choices, every field's `bounds`
        and the cross-field `rules` (field, holds, message) of fields whose own checks passed;
        raise one ConfigError listing every problem."""
        hints = typing.get_type_hints(type(self))
        problems: list[tuple[str, str]] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            try:
                value = _coerce(f.name, getattr(self, f.name), hints[f.name])
            except ConfigError as exc:
                problems.append((exc.field, exc.message))
                continue
            setattr(self, f.name, value)
            choices = f.metadata.get("choices")
            bounds = f.metadata.get("bounds")
            if choices is not None and value not in choices:
                problems.append((f.name, f"must be one of {', '.join(choices)}"))
            elif bounds is not None and value is not None and (problem := bounds.problem(value)):
                problems.append((f.name, problem))
        if not problems:  # cross-field rules read several fields: only once each is valid
            problems += [(name, message) for name, holds, message in rules if not holds()]
        if problems:
            raise ConfigError.of(problems)


def _type_name(tp: Any) -> str:
    if isinstance(tp, types.UnionType):
        return " | ".join(_type_name(arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return tp.__name__


def _coerce(name: str, value: Any, tp: Any) -> Any:
    if isinstance(tp, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _coerce(name, value, inner)
    # bool is a subclass of int: `True` is not a step count, and 1 is not a switch.
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected a boolean, got {type(value).__name__}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an integer, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(name, f"expected a number, got {type(value).__name__}")
        try:
            number = float(value)
        except OverflowError:  # an int past a float's range, e.g. 10**400
            raise ConfigError(name, "must be a finite number") from None
        if not math.isfinite(number):
            raise ConfigError(name, "must be a finite number")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"expected a string, got {type(value).__name__}")
        return value
    if typing.get_origin(tp) is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(name, f"expected a list, got {type(value).__name__}")
        (item_type,) = typing.get_args(tp)
        return [_coerce(name, item, item_type) for item in value]
    raise TypeError(f"{name}: unsupported field type {tp!r}")  # a bug in this module, not user input


# TRL GRPOTrainer's recipe, and TrainConfig's defaults before 2026-12-05: a constant learning rate
# and one optimizer step per batch, on every step (benchmarks that compare with TRL at equal budget
# pin it).
SINGLE_UPDATE_RECIPE: dict[str, typing.Any] = {
    "lr_schedule": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0, "num_minibatches": 1,
    "early_ppo_epochs_steps": 0,
}  # fmt: skip


@dataclass
class TrainConfig(_Settings):
    """Hyperparameters of one GRPO run. Defaults suit the bundled 135M model on CPU; the learning-rate
    recipe (cosine from a width-dependent peak after one warm-up step, to a floor of 0.1×, two
    minibatches per step, two passes over the batch on a run's first step) is the one
    benchmarks/sample_efficiency.py picked (benchmarks/README.md).
    Every number has a range (`bounds`, shown by `field_help`); the maxima say why, and catch typos
    like 10**6 steps."""

    steps: int = field(
        default=10,
        metadata=_help(
            "Number of GRPO updates (one optimizer step each).",
            bounds=Bounds(1, 100_000, why="for more, start another run from the last checkpoint"),
        ),
    )
    groups_per_step: int = field(
        default=2,
        metadata=_help(
            "Task rows sampled per step; each forms a group.",
            bounds=Bounds(1, 1024, why="one policy update per step must fit in a worker's memory"),
        ),
    )
    group_size: int = field(
        default=4,
        metadata=_help(
            "Completions sampled per row; advantages compare them.",
            # A group of one has zero variance by construction and would never train.
            bounds=Bounds(2, 256, why="advantages of more completions per row barely change"),
        ),
    )
    learning_rate: float | None = field(
        default=None,
        metadata=_help(
            "AdamW peak learning rate for the LoRA weights; empty: chosen from the base model's "
            "width and the run's objective (GRPO: 1e-3 at the bundled model's width 576, 2.2e-4 at "
            "4096; SFT half and DPO a tenth of that), filled in when the run is created.",
            bounds=Bounds(0, 1, above_minimum=True, why="LoRA training diverges long before 1"),
        ),
    )
    lr_schedule: str = field(
        default="cosine",
        metadata=_help(
            "Learning rate over the run's steps after warm-up: constant, or cosine / linear decay to "
            "learning_rate × min_lr_ratio at the last step.",
            choices=LR_SCHEDULES,
        ),
    )
    warmup_steps: int = field(
        default=1,
        metadata=_help(
            "Steps of linear warm-up from learning_rate / (warmup_steps + 1) to learning_rate (0 = none).",
            bounds=Bounds(0, 100_000, why="the most steps a run has"),
        ),
    )
    min_lr_ratio: float = field(
        default=0.1,
        metadata=_help(
            "Floor of the cosine and linear schedules, as a fraction of learning_rate.",
            bounds=Bounds(0, 1, why="a fraction of learning_rate"),
        ),
    )
    num_minibatches: int = field(
        default=2,
        metadata=_help(
            "Split each step's batch into this many minibatches, one optimizer step each.",
            bounds=Bounds(1, 256, why="more updates than completions per step train on single samples"),
        ),
    )
    devices: int = field(
        default=1,
        metadata=_help(
            "Devices (processes) the policy update runs on, data-parallel with torch.distributed; "
            "rollouts and grading stay in the first.",
            bounds=Bounds(1, 16, why="one host's devices"),
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=_help(
            "With devices > 1: shard the frozen base model's weights across the devices (FSDP2), for a "
            "base too big for one; the adapter stays whole on each. Samplers then need their own copy "
            "(a GRPO run: max_off_policy_steps of 1 or more).",
        ),
    )
    max_off_policy_steps: int = field(
        default=0,
        metadata=_help(
            "Rollouts for the next steps run while a step trains, sampled from a policy at most this "
            "many steps older than the one they train (0 = synchronous: each step samples the newest).",
            bounds=Bounds(0, 16, why="older samples leave the clip range and teach little"),
        ),
    )
    rollouts_on: str = field(
        default="worker",
        metadata=_help(
            "Where an overlapped run's rollouts (max_off_policy_steps > 0) are sampled: worker (a copy "
            "of the base model in the worker's process) or inference_servers (a live inference server "
            "of the base model, each checkpoint named by its store key).",
            choices=ROLLOUT_PLACES,
        ),
    )
    ppo_epochs: int = field(
        default=1,
        metadata=_help(
            "Passes over each step's batch (after the first, the importance ratio and clipping do real work).",
            bounds=Bounds(1, 16, why="past a few passes the policy leaves the clip range and stops learning"),
        ),
    )
    early_ppo_epochs: int = field(
        default=2,
        metadata=_help(
            "Passes over the batch on each of the model's first early_ppo_epochs_steps steps, where "
            "successes are rarest (when more than ppo_epochs; later steps make ppo_epochs). Steps "
            "count from the base model: a run that continues a trained checkpoint makes none.",
            bounds=Bounds(1, 16, why="past a few passes the policy leaves the clip range and stops learning"),
        ),
    )
    early_ppo_epochs_steps: int = field(
        default=1,
        metadata=_help(
            "How many of the model's first steps make early_ppo_epochs passes (0: none).",
            bounds=Bounds(0, 100_000, why="the most steps a run has"),
        ),
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata=_help(
            "Drop groups whose rewards are all equal and roll out more rows until groups_per_step "
            "groups carry a signal (DAPO), up to max_resample_factor × groups_per_step rows."
        ),
    )
    max_resample_factor: float = field(
        default=3.0,
        metadata=_help(
            "With dynamic_sampling: the most rows rolled out per step, as a multiple of groups_per_step.",
            bounds=Bounds(1, 16, why="each row drawn costs a group of rollouts"),
        ),
    )
    overlong_filter: bool = field(
        default=False,
        metadata=_help(
            "Do not train on completions cut off at max_new_tokens (they still count in their group's advantages)."
        ),
    )
    length_penalty_buffer: int = field(
        default=0,
        metadata=_help(
            "Soft overlong penalty (DAPO): a completion turn longer than max_new_tokens − buffer loses "
            "up to 1 reward, linearly, by max_new_tokens (0 = off).",
            bounds=Bounds(0, 32_768, why="longer than the context of the models artweb serves"),
        ),
    )
    dpo_beta: float = field(
        default=0.1,
        metadata=_help(
            "DPO runs: β, how far the policy's preference margin may move from the reference's.",
            bounds=Bounds(0, 100, above_minimum=True, why="past that the loss saturates at once"),
        ),
    )
    max_new_tokens: int = field(
        default=32,
        metadata=_help(
            "Most tokens the model may generate per turn.",
            bounds=Bounds(1, 32_768, why="longer than the context of the models artweb serves"),
        ),
    )
    temperature: float = field(
        default=1.0,
        metadata=_help(
            "Sampling temperature during rollouts (> 0).",
            bounds=Bounds(0, 5, above_minimum=True, why="past 5 sampling is close to uniform noise"),
        ),
    )
    top_p: float = field(
        default=1.0,
        metadata=_help(
            "Nucleus sampling: keep the smallest token set with this mass.",
            bounds=Bounds(0, 1, above_minimum=True, why="a probability mass"),
        ),
    )
    loss_type: str = field(
        default="ppo",
        metadata=_help(
            "Objective: ppo (clipped surrogate) or cispo (clipped IS-weight REINFORCE).", choices=LOSS_TYPES
        ),
    )
    epsilon: float = field(
        default=0.2,
        metadata=_help(
            "Lower clip range: ratios below 1 - epsilon are clipped.",
            bounds=Bounds(0, 10, above_minimum=True, why="a wider clip range clips nothing"),
        ),
    )
    epsilon_high: float | None = field(
        default=None,
        metadata=_help(
            "Upper clip range (1 + epsilon_high); empty means same as epsilon.",
            bounds=Bounds(0, 10, above_minimum=True, why="a wider clip range clips nothing"),
        ),
    )
    normalization: str = field(
        default="sequence",
        metadata=_help(
            "Loss averaging: sequence (GRPO), token (DAPO) or constant (Dr.GRPO, / max_new_tokens).",
            choices=NORMALIZATIONS,
        ),
    )
    importance_level: str = field(
        default="token",
        metadata=_help(
            "Importance ratio vs the sampler: per token, or per sequence (GSPO: geometric mean over the sequence).",
            choices=IMPORTANCE_LEVELS,
        ),
    )
    scale_rewards: bool = field(default=True, metadata=_help("Divide advantages by the group's reward std."))
    kl_coef: float = field(
        default=0.0,
        metadata=_help(
            "Weight of the KL penalty to the base model (0 = off).",
            bounds=Bounds(0, 100, why="a larger penalty only pins the policy to the base model"),
        ),
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata=_help(
            "Clip the gradient to this global norm.",
            bounds=Bounds(0, 1e6, above_minimum=True, why="a larger norm never clips"),
        ),
    )
    weight_decay: float = field(
        default=0.0,
        metadata=_help("AdamW decoupled weight decay.", bounds=Bounds(0, 1, why="a fraction per step")),
    )
    micro_batch_tokens: int = field(
        default=4096,
        metadata=_help(
            "Padded tokens per forward pass; gradients accumulate across them.",
            bounds=Bounds(1, 1_048_576, why="no worker holds activations for more tokens at once"),
        ),
    )
    seed: int = field(
        default=0,
        metadata=_help(
            "Seed for LoRA init and sampling; same seed, same run.",
            bounds=Bounds(0, SEED_MAX, why="random number generators take a 32-bit seed"),
        ),
    )
    # Evaluation on the task set's validation rows (stored per checkpoint). Small defaults: it runs
    # inside the training worker, and 8 greedy answers cost a few seconds on the CPU model.
    eval_interval: int = field(
        default=0,
        metadata=_help(
            "Evaluate on the validation rows every N steps (0 = only at step 0 and at the end).",
            bounds=Bounds(0, 100_000, why="the most steps a run has"),
        ),
    )
    eval_max_rows: int = field(
        default=8,
        metadata=_help(
            "Validation rows evaluated (the first N by index; same rows every time).",
            bounds=Bounds(1, 100_000, why="evaluation runs inside the training worker"),
        ),
    )
    eval_samples_per_row: int = field(
        default=1,
        metadata=_help(
            "Answers sampled per validation row.",
            bounds=Bounds(1, 64, why="evaluation runs inside the training worker"),
        ),
    )
    eval_temperature: float = field(
        default=0.0,
        metadata=_help(
            "Sampling temperature for evaluation (0 = greedy, reproducible).",
            bounds=Bounds(0, 5, why="past 5 sampling is close to uniform noise"),
        ),
    )
    eval_pass_threshold: float = field(
        default=1.0,
        metadata=_help(
            "A validation answer passes when its reward is at least this.",
            bounds=Bounds(-1e6, 1e6, why="rewards are moderate numbers"),
        ),
    )
    no_signal_patience: int = field(
        default=3,
        metadata=_help(
            "Warn after this many steps in a row with no learning signal (every group scored alike).",
            bounds=Bounds(1, 100_000, why="the most steps a run has"),
        ),
    )

    def __post_init__(self) -> None:
        self._check(
            (
                "group_size",
                lambda: self.groups_per_step * self.group_size <= MAX_COMPLETIONS_PER_STEP,
                f"groups_per_step × group_size must be at most {MAX_COMPLETIONS_PER_STEP} completions "
                "per step (one policy update must fit in a worker's memory)",
            ),
            (
                "num_minibatches",
                lambda: self.num_minibatches <= self.groups_per_step * self.group_size,
                "num_minibatches must be at most groups_per_step × group_size (a minibatch needs a completion)",
            ),
            (
                "length_penalty_buffer",
                lambda: self.length_penalty_buffer <= self.max_new_tokens,
                "length_penalty_buffer must be at most max_new_tokens",
            ),
            (
                "fsdp",
                lambda: not self.fsdp or self.devices > 1,
                "fsdp shards the base across devices: it needs devices of 2 or more",
            ),
            (
                "rollouts_on",
                lambda: self.rollouts_on == "worker" or self.max_off_policy_steps > 0,
                "inference_servers needs max_off_policy_steps of 1 or more (a synchronous run "
                "samples the live policy in the worker)",
            ),
        )

    def check_objective(self, objective: str) -> None:
        """Raise ConfigError for options that only GRPO runs (rollouts and an update per step)
        have, set in a run of another objective (``sft``, ``dpo``), and for a GRPO run a sharded
        base without a sampler of its own (an SFT or DPO run with ``fsdp`` grades its held-out
        answers with a copy of its own: training.recipes.supervised)."""
        if objective == "grpo":
            if self.fsdp and not self.max_off_policy_steps:
                raise ConfigError(
                    "fsdp",
                    "fsdp needs max_off_policy_steps of 1 or more in a GRPO run: a sharded base cannot "
                    "sample on one device, so the rollouts need a sampler of their own (an overlapped run's)",
                )
            return
        problems = [
            (name, f"{name}: {getattr(self, name)} applies to GRPO runs only, not {objective} runs")
            for name, default in (("max_off_policy_steps", 0), ("rollouts_on", "worker"))
            if getattr(self, name) != default
        ]
        if problems:
            raise ConfigError.of(problems)

    def resolved(self, *, objective: str, width: int | None) -> TrainConfig:
        """This config as work of ``objective`` (grpo | sft | dpo) trains with it on a base model of
        hidden size ``width`` (``training.model_files.hidden_size``; None: unknown): checked against
        the objective (``check_objective``) and an empty ``learning_rate`` filled in
        (training.recipes.schedules.default_learning_rate). The one place a config is resolved:
        the platform calls it when the work is created and stores the result
        (projects.services.runs.run_config_check); the worker, the trainer service and the
        session read that, and derive nothing (RunSpec refuses an unresolved config)."""
        self.check_objective(objective)
        if self.learning_rate is not None:
            return self
        return replace(self, learning_rate=default_learning_rate(width, objective))

    @property
    def peak_learning_rate(self) -> float:
        """``learning_rate``, set in a resolved config (``resolved``, when the work was created)."""
        if self.learning_rate is None:
            raise RuntimeError(
                "learning_rate is empty: TrainConfig.resolved fills it in for the base model and objective"
            )
        return self.learning_rate

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class LoraSpec(_Settings):
    """Shape of the LoRA adapter trained on top of the frozen base model."""

    rank: int = field(
        default=8,
        metadata=_help(
            "LoRA rank r: width of the low-rank update.",
            bounds=Bounds(1, 1024, why="wider than the layers of the models artweb trains"),
        ),
    )
    alpha: int = field(
        default=16,
        metadata=_help(
            "LoRA alpha; the update is scaled by alpha / rank.",
            bounds=Bounds(1, 65_536, why="a larger scale only destabilises training"),
        ),
    )
    dropout: float = field(
        default=0.0,
        metadata=_help(
            "Dropout on the LoRA input during training.", bounds=Bounds(0, 0.99, why="a probability below 1")
        ),
    )
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        metadata=_help("Names of the linear layers that get an adapter."),
    )

    def __post_init__(self) -> None:
        self._check(
            ("target_modules", lambda: len(self.target_modules) > 0, "must name at least one module"),
            ("target_modules", lambda: all(self.target_modules), "module names must not be empty"),
            ("target_modules", lambda: len(self.target_modules) <= 64, "at most 64 module names"),
        )
