"""What a run is given: ``RunSpec`` (base model, config, environment, grader, rows, where
checkpoints go) and ``RunHooks`` (how the caller records results and says "stop"). No Django here:
projects.jobs.runs fills both from the database."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.config import LoraSpec, TrainConfig
from training.environments import Environment
from training.model_files import resolve_config
from training.rollouts.trajectory import Trajectory


@dataclass
class RunSpec:
    base_model_source: str  # BUNDLED_MODEL or a local model directory
    model_cache_dir: Path  # where converted base models are cached
    checkpoint_root: Path  # one folder per step: <root>/step-000003
    config: TrainConfig
    lora: LoraSpec
    environment: Environment  # from training.environments.build_environment; run_training closes it
    grader_spec: dict[str, Any]
    train_rows: list[dict[str, Any]]  # each {"index": int, "data": task row}
    start_step: int  # model step this run started from
    resume_step: int | None  # recorded checkpoint to resume from; None = fresh adapter (step 0)
    stop: list[str] = field(default_factory=list)
    max_grader_error_fraction: float = 0.5
    device: str = "cpu"
    engine: str = "auto"  # rollout engine: auto | vllm | transformers (training.engines.select_engine_kind)
    unsloth: str = "auto"  # base model loader: auto | on | off (training.unsloth_loader.use_unsloth)
    reward_name: str = ""  # how users know the reward definition, for error messages
    judge: Any = None  # training.rewards.JudgeClient for LLM-judge graders (the team's endpoint)
    sandbox: Any = None  # training.rewards.SandboxConfig: the operator's python-grader limits
    outbound: Any = None  # training.safety.outbound.OutboundPolicy for endpoint graders (None: public only)
    validation_rows: list[dict[str, Any]] = field(
        default_factory=list
    )  # evaluated (training.runs.evaluation)
    objective: str = (
        "grpo"  # grpo (rollouts and rewards) | sft | dpo (training.recipes.supervised: rows carry targets)
    )
    # The worker's SessionHost (training.hosting.resident: its trainer service's sessions, or this
    # process's), which its client work opens sessions through too: the run's session opens there
    # under ``session_id`` when the placement rule lets it (service_refusal); None: in this process.
    host: Any = None
    session_id: str = "run"  # the run's session on its host: "run-<id>", one per run
    # ``rollouts_on: inference_servers``: the inference server an overlapped run's rollouts are
    # sampled on (training.engines.remote_engine.RolloutServer); None: a sampler in this process.
    rollout_server: Any = None
    # vLLM when this interpreter does not import it: the python of its own virtualenv (the CPU
    # build's, or a GPU image's), and the CPU build's KV cache in GiB (training.serving.vllm).
    vllm_python: str = ""
    vllm_cpu_kv_cache_gib: float = 2.0

    @classmethod
    def resolving(cls, **fields: Any) -> RunSpec:
        """A RunSpec whose ``config`` is resolved here (training.model_files.resolve_config: the
        base model's width read on this host): for a run built by hand (a benchmark, a test). The
        platform resolves when it creates the run, and its worker builds ``RunSpec(...)`` from the
        stored config."""
        fields["config"] = resolve_config(fields["config"], source=fields["base_model_source"],
                                          cache_dir=fields["model_cache_dir"],
                                          objective=fields.get("objective", "grpo"))  # fmt: skip
        return cls(**fields)

    def __post_init__(self) -> None:
        # The config comes resolved (TrainConfig.resolved: checked against the objective, the
        # learning rate filled in), as the platform stored it when the run was created; nothing
        # here re-derives it.
        if self.config.learning_rate is None:
            raise ValueError(
                "RunSpec takes a resolved config: TrainConfig.resolved(objective=..., width=...) "
                "fills in the learning rate for the base model (training.model_files.hidden_size)"
            )


# A finished step's trajectories as ``hooks.record_step`` gets them: (group_index, task_row_index, trajectory).
StepTrajectories = list[tuple[int, int, Trajectory]]


class RunHooks(Protocol):
    def should_stop(self) -> str | None:
        """A reason to stop before the next step ("cancelled", "lost") or None."""

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None: ...

    def record_step(
        self, *, step: int, metrics: dict[str, Any], trajectories: StepTrajectories, path: Path
    ) -> bool:
        """Persist a finished step (see StepTrajectories); False if this worker lost the run."""

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None: ...

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        """Persist the validation evaluation of checkpoint ``step`` (training.runs.evaluation.EvalSample list)."""

    def is_evaluated(self, *, step: int) -> bool:
        """Whether checkpoint ``step`` has its evaluation recorded (asked only when resuming)."""
