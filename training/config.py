"""Run hyperparameters and LoRA settings.

Both are plain dataclasses. Every field carries a one-line help in its metadata; the REST API and
the dashboard show it through `field_help()`. An instance is validated in `__post_init__`, so a
config that exists is a valid one, whether it came from `from_dict` (user JSON) or from code.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Self

LOSS_TYPES = ("ppo", "cispo")
NORMALIZATIONS = ("sequence", "token", "constant")
IMPORTANCE_LEVELS = ("token", "sequence")

# The seven projections of a Llama-style block: attention and MLP.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ConfigError(ValueError):
    """A bad hyperparameter. `field` names it so the API can point at the offending key."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def _help(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


class _Settings:
    """Shared `from_dict` / `to_dict` / `field_help` and type checking for the config dataclasses."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        if not isinstance(data, dict):
            raise ConfigError("__all__", f"expected an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        for key in data:
            if key not in names:
                raise ConfigError(str(key), "unknown hyperparameter")
        return cls(**data)

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
            out[f.name] = entry
        return out

    def _check_types(self) -> None:
        """Coerce ints given for float fields; reject everything else of the wrong type."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), hints[f.name]))
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ConfigError(f.name, f"must be one of {', '.join(choices)}")


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
        if not math.isfinite(value):
            raise ConfigError(name, "must be a finite number")
        return float(value)
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


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ConfigError(name, message)


@dataclass
class TrainConfig(_Settings):
    """Hyperparameters of one GRPO run. Defaults suit the bundled 135M model on CPU."""

    steps: int = field(default=10, metadata=_help("Number of GRPO updates (one optimizer step each)."))
    groups_per_step: int = field(default=2, metadata=_help("Task rows sampled per step; each forms a group."))
    group_size: int = field(
        default=4, metadata=_help("Completions sampled per row; advantages compare them.")
    )
    learning_rate: float = field(default=5e-5, metadata=_help("AdamW learning rate for the LoRA weights."))
    max_new_tokens: int = field(default=32, metadata=_help("Most tokens the model may generate per turn."))
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature during rollouts (> 0)."))
    top_p: float = field(
        default=1.0, metadata=_help("Nucleus sampling: keep the smallest token set with this mass.")
    )
    loss_type: str = field(
        default="ppo",
        metadata=_help(
            "Objective: ppo (clipped surrogate) or cispo (clipped IS-weight REINFORCE).", choices=LOSS_TYPES
        ),
    )
    epsilon: float = field(
        default=0.2, metadata=_help("Lower clip range: ratios below 1 - epsilon are clipped.")
    )
    epsilon_high: float | None = field(
        default=None, metadata=_help("Upper clip range (1 + epsilon_high); empty means same as epsilon.")
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
        default=0.0, metadata=_help("Weight of the KL penalty to the base model (0 = off).")
    )
    max_grad_norm: float = field(default=1.0, metadata=_help("Clip the gradient to this global norm."))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW decoupled weight decay."))
    micro_batch_tokens: int = field(
        default=4096, metadata=_help("Padded tokens per forward pass; gradients accumulate across them.")
    )
    seed: int = field(default=0, metadata=_help("Seed for LoRA init and sampling; same seed, same run."))
    # Evaluation on the task set's validation rows (stored per checkpoint). Small defaults: it runs
    # inside the training worker, and 8 greedy answers cost a few seconds on the CPU model.
    eval_interval: int = field(
        default=0,
        metadata=_help("Evaluate on the validation rows every N steps (0 = only at step 0 and at the end)."),
    )
    eval_max_rows: int = field(
        default=8, metadata=_help("Validation rows evaluated (the first N by index; same rows every time).")
    )
    eval_samples_per_row: int = field(default=1, metadata=_help("Answers sampled per validation row."))
    eval_temperature: float = field(
        default=0.0, metadata=_help("Sampling temperature for evaluation (0 = greedy, reproducible).")
    )
    eval_pass_threshold: float = field(
        default=1.0, metadata=_help("A validation answer passes when its reward is at least this.")
    )

    def __post_init__(self) -> None:
        self._check_types()
        for name in ("steps", "groups_per_step", "max_new_tokens", "micro_batch_tokens"):
            _require(getattr(self, name) >= 1, name, "must be a positive integer")
        # A group of one has zero variance by construction and would never train.
        _require(self.group_size >= 2, "group_size", "must be at least 2 (advantages compare completions)")
        _require(self.learning_rate > 0, "learning_rate", "must be greater than 0")
        _require(self.temperature > 0, "temperature", "must be greater than 0")
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _require(self.epsilon > 0, "epsilon", "must be greater than 0")
        _require(self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high", "must be greater than 0")
        _require(self.kl_coef >= 0, "kl_coef", "must be 0 or more")
        _require(self.max_grad_norm > 0, "max_grad_norm", "must be greater than 0")
        _require(self.weight_decay >= 0, "weight_decay", "must be 0 or more")
        _require(self.seed >= 0, "seed", "must be 0 or more")
        _require(self.eval_interval >= 0, "eval_interval", "must be 0 or more")
        _require(self.eval_max_rows >= 1, "eval_max_rows", "must be a positive integer")
        _require(self.eval_samples_per_row >= 1, "eval_samples_per_row", "must be a positive integer")
        _require(self.eval_temperature >= 0, "eval_temperature", "must be 0 or more")

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class LoraSpec(_Settings):
    """Shape of the LoRA adapter trained on top of the frozen base model."""

    rank: int = field(default=8, metadata=_help("LoRA rank r: width of the low-rank update."))
    alpha: int = field(default=16, metadata=_help("LoRA alpha; the update is scaled by alpha / rank."))
    dropout: float = field(default=0.0, metadata=_help("Dropout on the LoRA input during training."))
    target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        metadata=_help("Names of the linear layers that get an adapter."),
    )

    def __post_init__(self) -> None:
        self._check_types()
        _require(self.rank >= 1, "rank", "must be a positive integer")
        _require(self.alpha >= 1, "alpha", "must be a positive integer")
        _require(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        _require(len(self.target_modules) > 0, "target_modules", "must name at least one module")
        _require(all(self.target_modules), "target_modules", "module names must not be empty")
