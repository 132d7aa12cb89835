"""ART's ``experimental_config`` (openpipe-art 0.5.18 and 0.5.23, ``ExperimentalTrainingConfig`` in
art/serverless/client.py) read into a training job's settings: a TrainConfig (learning rate, reward
scaling) and ``ArtOptions`` (ART's loss, packing and learning-rate rules, training.recipes.art_loss).

Every key of both versions is accepted at ART's default (null means the default). A non-default
value is honoured, except the few that name something on the client's machine or that only draw
debugging plots there; those are a ConfigError naming the key, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from training import names as names_help
from training.config import ConfigError, TrainConfig

# Both versions' keys, in art/serverless/client.py's order.
EXPERIMENTAL_KEYS = (
    "advantage_balance", "allow_training_without_logprobs", "epsilon", "epsilon_high",
    "importance_sampling_level", "kimi_k2_tau", "kl_penalty_coef", "kl_penalty_reference_step",
    "kl_penalty_source", "kl_penalty_step_lag", "kl_ref_adapter_path", "learning_rate",
    "logprob_calculation_chunk_size", "loss_fn", "mask_prob_ratio",
    "max_negative_advantage_importance_sampling_weight", "normalize_advantages",
    "num_trajectories_learning_rate_multiplier_power", "packed_sequence_length", "plot_tensors", "ppo",
    "precalculate_logprobs", "scale_learning_rate_by_reward_std_dev", "scale_rewards",
    "truncated_importance_sampling",
)  # fmt: skip
LOSS_FUNCTIONS = ("cispo", "ppo")
IMPORTANCE_LEVELS = ("token", "sequence", "average", "geometric_average")
KL_SOURCES = ("current_learner", "sample")
# ART's LocalBackend: with no packed_sequence_length, the longest trajectory rounded up to this.
DEFAULT_SEQUENCE_QUANTUM = 2048


@dataclass(frozen=True)
class ArtLoss:
    """The loss settings of one job (ART's experimental_config, resolved to its defaults)."""

    ppo: bool = False
    epsilon: float = 1.0
    epsilon_high: float = 4.0
    importance_sampling_level: str = "token"
    mask_prob_ratio: bool = False
    max_negative_advantage_importance_sampling_weight: float | None = None
    kimi_k2_tau: float | None = None
    kl_penalty_coef: float = 0.0
    kl_penalty_source: str = "sample"
    truncated_importance_sampling: float | None = None


@dataclass(frozen=True)
class ArtOptions:
    """What a job does beyond TrainConfig, stored with it (``TrainingJob.config["art"]``)."""

    loss: ArtLoss = dataclasses.field(default_factory=ArtLoss)
    advantage_balance: float = 0.0
    kl_penalty_reference_step: int | None = None  # None with a KL penalty: the base model
    kl_penalty_step_lag: int | None = None  # the reference is max(0, current step - lag)
    packed_sequence_length: int | None = None  # None: ART's default (see sequence_length)
    logprob_calculation_chunk_size: int = 1024
    num_trajectories_learning_rate_multiplier_power: float = 0.0
    scale_learning_rate_by_reward_std_dev: bool = False
    allow_training_without_logprobs: bool = False
    precalculate_logprobs: bool = False

    @property
    def needs_trainer_logprobs(self) -> bool:
        """Old logprobs come from the trainer before the job's first update (the sampler's become
        the 'original' ones): asked for, or the only way truncated IS has a meaning."""
        return self.precalculate_logprobs or bool(self.loss.truncated_importance_sampling)

    def reference_step(self, current_step: int) -> int | None:
        """The checkpoint step the KL penalty compares with (0: the base model), None without one."""
        if self.loss.kl_penalty_coef <= 0:
            return None
        if self.kl_penalty_step_lag is not None:
            return max(0, current_step - self.kl_penalty_step_lag)
        return self.kl_penalty_reference_step or 0

    def sequence_length(self, longest: int, model_max: int | None) -> int:
        """ART's packed sequence length: the one asked for, else the longest trajectory rounded up
        to a multiple of 2048, at most the model's context."""
        if self.packed_sequence_length is not None:
            return self.packed_sequence_length
        length = max(1, math.ceil(longest / DEFAULT_SEQUENCE_QUANTUM)) * DEFAULT_SEQUENCE_QUANTUM
        return min(length, model_max) if model_max else length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArtOptions:
        values = dict(data)
        values["loss"] = ArtLoss(**values.get("loss", {}))
        return cls(**values)


def _number(experimental: dict[str, Any], key: str, *, minimum: float | None = None,
            maximum: float | None = None, above: bool = False, integer: bool = False) -> Any:  # fmt: skip
    value = experimental.get(key)
    if value is None:
        return None
    kind = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise ConfigError(key, "expected an integer" if integer else "expected a number")
    if minimum is not None and (value <= minimum if above else value < minimum):
        raise ConfigError(key, f"must be {'greater than' if above else 'at least'} {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(key, f"must be at most {maximum}")
    return value


def _flag(experimental: dict[str, Any], key: str) -> bool | None:
    value = experimental.get(key)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(key, "expected a boolean")
    return value


def _choice(experimental: dict[str, Any], key: str, choices: tuple[str, ...]) -> str | None:
    value = experimental.get(key)
    if value is not None and value not in choices:
        raise ConfigError(key, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


# A job whose request names no learning rate (ART's client always sends its TrainConfig's): the
# rate such jobs trained at before a run's default became width-dependent. One update per job
# (training.recipes.art): a run's schedule and minibatches do not apply.
NO_LEARNING_RATE = 5e-5


def art_job_config(experimental: Any) -> tuple[TrainConfig, ArtOptions]:
    """The job's TrainConfig and ArtOptions for ``experimental_config`` (None: ART's defaults).
    Raises ConfigError naming the first key it cannot take."""
    if experimental is None:
        experimental = {}
    if not isinstance(experimental, dict):
        raise ConfigError("experimental_config", "must be an object or null")
    for key in experimental:
        if key not in EXPERIMENTAL_KEYS:
            raise ConfigError(
                str(key), names_help.unknown("experimental_config key", str(key), EXPERIMENTAL_KEYS)
            )
    if experimental.get("kl_ref_adapter_path") is not None:
        raise ConfigError(
            "kl_ref_adapter_path",
            "a path on the trainer's disk cannot be given to artweb: name the checkpoint to compare "
            "with by kl_penalty_reference_step (0 is the base model) or kl_penalty_step_lag",
        )
    if experimental.get("plot_tensors"):
        raise ConfigError(
            "plot_tensors",
            "artweb draws no tensor plots (ART writes them to the trainer's disk): the trajectory "
            "viewer shows each trajectory's advantage and tokens; leave it false",
        )

    ppo = _flag(experimental, "ppo")
    loss_fn = _choice(experimental, "loss_fn", LOSS_FUNCTIONS)
    if loss_fn is not None and ppo is not None and ppo != (loss_fn == "ppo"):
        raise ConfigError("loss_fn", f"{loss_fn!r} contradicts ppo={str(ppo).lower()}")
    use_ppo = loss_fn == "ppo" if loss_fn is not None else bool(ppo)
    scale = _flag(experimental, "scale_rewards")
    normalize = _flag(experimental, "normalize_advantages")
    if scale is not None and normalize is not None and scale != normalize:
        raise ConfigError(
            "normalize_advantages", "is ART's other name for scale_rewards: give them one value"
        )
    epsilon = _number(experimental, "epsilon", minimum=0, maximum=10, above=True)
    epsilon_high = _number(experimental, "epsilon_high", minimum=0, maximum=10, above=True)
    if epsilon is None:
        epsilon = 0.2 if use_ppo else 1.0
    if epsilon_high is None:
        epsilon_high = epsilon if use_ppo else 4.0
    coef = _number(experimental, "kl_penalty_coef", minimum=0, maximum=100) or 0.0
    reference_step = _number(experimental, "kl_penalty_reference_step", minimum=0, integer=True)
    lag = _number(experimental, "kl_penalty_step_lag", minimum=1, integer=True)
    if reference_step is not None and lag is not None:
        raise ConfigError(
            "kl_penalty_step_lag", "only one of kl_penalty_reference_step and kl_penalty_step_lag may be set"
        )
    source = _choice(experimental, "kl_penalty_source", KL_SOURCES) or (
        "sample" if coef > 0 else "current_learner"
    )
    level = _choice(experimental, "importance_sampling_level", IMPORTANCE_LEVELS) or "token"
    loss = ArtLoss(
        ppo=use_ppo,
        epsilon=float(epsilon),
        epsilon_high=float(epsilon_high),
        importance_sampling_level=level,
        mask_prob_ratio=bool(_flag(experimental, "mask_prob_ratio")),
        max_negative_advantage_importance_sampling_weight=_number(
            experimental, "max_negative_advantage_importance_sampling_weight", minimum=0, above=True
        ),
        kimi_k2_tau=_number(experimental, "kimi_k2_tau", minimum=0),
        kl_penalty_coef=float(coef),
        kl_penalty_source=source,
        truncated_importance_sampling=_number(
            experimental, "truncated_importance_sampling", minimum=0, above=True
        ),
    )
    options = ArtOptions(
        loss=loss,
        advantage_balance=float(_number(experimental, "advantage_balance", minimum=-1, maximum=1) or 0.0),
        kl_penalty_reference_step=reference_step,
        kl_penalty_step_lag=lag,
        packed_sequence_length=_number(
            experimental, "packed_sequence_length", minimum=1, maximum=1_048_576, integer=True
        ),
        logprob_calculation_chunk_size=_number(
            experimental, "logprob_calculation_chunk_size", minimum=1, integer=True
        )
        or 1024,  # fmt: skip
        num_trajectories_learning_rate_multiplier_power=float(
            _number(experimental, "num_trajectories_learning_rate_multiplier_power", minimum=-4, maximum=4)
            or 0.0
        ),
        scale_learning_rate_by_reward_std_dev=bool(
            _flag(experimental, "scale_learning_rate_by_reward_std_dev")
        ),
        allow_training_without_logprobs=bool(_flag(experimental, "allow_training_without_logprobs")),
        precalculate_logprobs=bool(_flag(experimental, "precalculate_logprobs")),
    )
    values: dict[str, Any] = {
        "steps": 1,
        "loss_type": "ppo" if use_ppo else "cispo",
        "epsilon": float(epsilon),
        "epsilon_high": float(epsilon_high),
        "importance_level": "token" if level == "token" else "sequence",
        "normalization": "token",  # ART: the sum over a sequence's trained tokens / their count
        "scale_rewards": True if scale is None and normalize is None else bool(scale if scale is not None else normalize),
    }  # fmt: skip
    learning_rate = experimental.get("learning_rate")
    values["learning_rate"] = NO_LEARNING_RATE if learning_rate is None else learning_rate
    return TrainConfig(**values), options
