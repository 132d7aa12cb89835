"""OpenAI's fine-tuning API on artweb's own objects (``/v1/files``, ``/v1/fine_tuning/jobs``): a file
is a task set, a job is a run (kind platform for ``reinforcement``, sft, dpo), a grader is a reward
definition, a job checkpoint is a checkpoint. Nothing here is a second copy of a run: a job is
created by ``run_create`` and trained, recorded, cancelled, paused and resumed as every run is.

Where the objects live: the project the request's ``OpenAI-Project`` header names (the openai
client's ``project=``), or the team's ``fine-tuning`` project, made on the first upload.

Rows: a file is JSONL in any of OpenAI's three formats, stored as task rows line by line
(``projects.services.fine_tuning_rows``: the mapping, and the files' writes).

Why one module of this length: OpenAI's fine-tuning objects mapped onto artweb's, as one table read
top to bottom (three row formats, three methods' hyperparameters, the job's states and events);
every write is a call to the run, task-set and reward services.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from django.db import transaction
from django.utils.text import slugify

from projects.defaults import RUN_CONFIG
from projects.errors import NotFound, ValidationFailed
from projects.grader_secrets import grader_public
from projects.models import (
    BaseModel,
    Checkpoint,
    Environment,
    Project,
    Run,
    RunKind,
    TaskRow,
    TaskSet,
    Team,
    TrainableModel,
)
from projects.services import agent_rft, task_sets
from projects.services.environments import environment_create
from projects.services.fine_tuning_rows import file_create as file_create  # the API and tests call these here
from projects.services.fine_tuning_rows import openai_line as openai_line
from projects.services.fine_tuning_rows import task_row as task_row
from projects.services.projects import project_create, trainable_model_create
from projects.services.rewards import grader_problems, reward_definition_create
from projects.services.run_forks import checkpoint_fork
from projects.services.runs import run_create
from training.config import TrainConfig

DEFAULT_PROJECT = "fine-tuning"
ENVIRONMENT = "fine-tuning-chat"  # one user turn, one reply: what OpenAI's fine-tuning trains
METHODS = {"reinforcement": RunKind.PLATFORM, "supervised": RunKind.SFT, "dpo": RunKind.DPO}
# The grader of a supervised or DPO job (OpenAI's take none): similarity of a held-out answer to
# the row's target, so the run's evaluations say something beside the held-out loss.
REFERENCE_GRADER = {
    "type": "text_similarity",
    "name": "similarity-to-reference",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference}}",
    "evaluation_metric": "fuzzy_match",
}
# Per method, the hyperparameters OpenAI's API takes; each is honoured (mapped below) or refused.
HYPERPARAMETERS = {
    "reinforcement": {
        "n_epochs", "batch_size", "learning_rate_multiplier", "eval_interval", "eval_samples",
        "reasoning_effort", "compute_multiplier",
    },
    "supervised": {"n_epochs", "batch_size", "learning_rate_multiplier"},
    "dpo": {"n_epochs", "batch_size", "learning_rate_multiplier", "beta"},
}  # fmt: skip
DEFAULTS = TrainConfig()
# What a job trains with where OpenAI's hyperparameters say nothing, per method; the learning
# rate is the one ``learning_rate_multiplier`` multiplies. Reinforcement: the levers the demo
# measured best on the bundled model (projects.defaults.RUN_CONFIG, README "The demo": cosine from a
# 1e-3 peak, warm-up 1, two passes per batch, 8 completions per prompt) and dynamic sampling, which
# the demo turns off only because its length penalty (which jobs do not have) gives the groups it
# would drop a signal (RUN_CONFIG's comment).
# Supervised: AdamW 5e-4, the rate of the bundled model's SFT curve (benchmarks/README.md,
# tinker_curves.py). DPO: 2e-4, the DPO runs' default peak (benchmarks/dpo_rates.py).
RECIPES: dict[str, dict[str, Any]] = {
    "reinforcement": {
        key: RUN_CONFIG[key]
        for key in (
            "learning_rate",
            "lr_schedule",
            "warmup_steps",
            "min_lr_ratio",
            "ppo_epochs",
            "num_minibatches",
            "max_resample_factor",
            "temperature",
            "group_size",
        )
    }
    | {"dynamic_sampling": True},  # fmt: skip
    "supervised": {"learning_rate": 5e-4},
    "dpo": {"learning_rate": 2e-4},
}


# ---------------------------------------------------------------- where the objects live


def job_project(*, team: Team, name: str | None, create: bool) -> Project | None:
    """The project a request's objects live in (see the module docstring); None when the default
    one does not exist yet and ``create`` is false (a list is then empty)."""
    if name:
        project = Project.objects.filter(team=team, name=name).first()
        if project is None:
            raise ValidationFailed(
                f"this team has no project named {name!r} (the OpenAI-Project header names an "
                "artweb project; leave it out for the team's fine-tuning project)",
                field="OpenAI-Project",
            )
        return project
    project = Project.objects.filter(team=team, name=DEFAULT_PROJECT).first()
    if project is None and create:
        try:
            project = project_create(
                team=team, name=DEFAULT_PROJECT, description="Files and jobs of the OpenAI fine-tuning API"
            )
        except ValidationFailed:  # created by a concurrent request
            project = Project.objects.get(team=team, name=DEFAULT_PROJECT)
    return project


# ---------------------------------------------------------------- jobs


def _choice(value: Any, field: str, *, default: Any, kind: type, low: float, high: float) -> Any:
    """A hyperparameter: ``"auto"`` (or absent) is ``default``; otherwise a number in range."""
    if value is None or value == "auto":
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (kind is int and not float(value).is_integer())
    ):
        raise ValidationFailed(
            f'must be "auto" or {"an integer" if kind is int else "a number"}', field=field
        )
    if not low <= value <= high:
        raise ValidationFailed(f"must be between {low:g} and {high:g}", field=field)
    return kind(value)


def _method(method: Any, legacy: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(type, its hyperparameters, its grader or {})`` from ``method`` (or the deprecated
    top-level ``hyperparameters``, which OpenAI reads as supervised ones)."""
    if method is None:
        if legacy is not None and not isinstance(legacy, dict):
            raise ValidationFailed("must be an object", field="hyperparameters")
        return "supervised", dict(legacy or {}), {}
    if legacy is not None:
        raise ValidationFailed("give hyperparameters inside method, not beside it", field="hyperparameters")
    if not isinstance(method, dict) or method.get("type") not in METHODS:
        raise ValidationFailed(
            "must be an object with type reinforcement, supervised or dpo", field="method.type"
        )
    kind = method["type"]
    unknown = set(method) - {"type", kind}
    if unknown:
        raise ValidationFailed(f"unknown field for method {kind}", field=f"method.{sorted(unknown)[0]}")
    body = method.get(kind) or {}
    if not isinstance(body, dict):
        raise ValidationFailed("must be an object", field=f"method.{kind}")
    allowed = {"hyperparameters"} | (
        {"grader", "response_format", *agent_rft.FIELDS} if kind == "reinforcement" else set()
    )
    unknown = set(body) - allowed
    if unknown:
        raise ValidationFailed("unknown field", field=f"method.{kind}.{sorted(unknown)[0]}")
    if body.get("response_format") is not None:
        raise ValidationFailed(
            "not supported: the environment's reply is free text", field=f"method.{kind}.response_format"
        )
    hyper = body.get("hyperparameters") or {}
    if not isinstance(hyper, dict):
        raise ValidationFailed("must be an object", field=f"method.{kind}.hyperparameters")
    grader = body.get("grader")
    if kind == "reinforcement" and grader is None:
        raise ValidationFailed("a reinforcement job needs a grader", field="method.reinforcement.grader")
    return kind, hyper, grader or {}


def job_config(
    *, kind: str, hyper: dict[str, Any], train_rows: int, seed: int | None, where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's TrainConfig overrides for OpenAI's hyperparameters, and the hyperparameters as
    the job reports them (``auto`` resolved)."""
    unknown = set(hyper) - HYPERPARAMETERS[kind]
    if unknown:
        raise ValidationFailed(f"not a {kind} hyperparameter", field=f"{where}.{sorted(unknown)[0]}")
    field = lambda name: f"{where}.{name}"  # noqa: E731
    batch = _choice(hyper.get("batch_size"), field("batch_size"), default=min(DEFAULTS.groups_per_step, train_rows),
                    kind=int, low=1, high=1024)  # fmt: skip
    epochs = _choice(hyper.get("n_epochs"), field("n_epochs"), default=None, kind=int, low=1, high=50)
    multiplier = _choice(hyper.get("learning_rate_multiplier"), field("learning_rate_multiplier"), default=1.0,
                         kind=float, low=1e-3, high=100)  # fmt: skip
    steps = DEFAULTS.steps if epochs is None else max(1, math.ceil(epochs * train_rows / batch))
    recipe = RECIPES[kind]
    config: dict[str, Any] = {
        **recipe,
        "groups_per_step": batch,
        "steps": steps,
        "learning_rate": recipe["learning_rate"] * multiplier,
    }
    if seed is not None:
        config["seed"] = seed
    reported: dict[str, Any] = {
        "n_epochs": epochs if epochs is not None else max(1, math.ceil(steps * batch / train_rows)),
        "batch_size": batch,
        "learning_rate_multiplier": multiplier,
    }
    if kind == "dpo":
        beta = _choice(
            hyper.get("beta"), field("beta"), default=DEFAULTS.dpo_beta, kind=float, low=1e-3, high=10
        )
        config["dpo_beta"] = reported["beta"] = beta
    if kind == "reinforcement":
        effort = hyper.get("reasoning_effort", "default")
        if effort != "default":
            raise ValidationFailed(
                'only "default": artweb\'s base models take no reasoning effort',
                field=field("reasoning_effort"),
            )
        compute = _choice(hyper.get("compute_multiplier"), field("compute_multiplier"), default=1.0,
                          kind=float, low=0.5, high=16)  # fmt: skip
        config["group_size"] = max(2, round(recipe["group_size"] * compute))  # completions per prompt
        interval = _choice(hyper.get("eval_interval"), field("eval_interval"), default=DEFAULTS.eval_interval,
                           kind=int, low=0, high=100_000)  # fmt: skip
        samples = _choice(hyper.get("eval_samples"), field("eval_samples"), default=DEFAULTS.eval_samples_per_row,
                          kind=int, low=1, high=64)  # fmt: skip
        config.update(eval_interval=interval, eval_samples_per_row=samples)
        reported.update(reasoning_effort=effort, compute_multiplier=compute, eval_interval=interval or "auto",
                        eval_samples=samples)  # fmt: skip
    return config, reported


def _file(project: Project, value: Any, field: str) -> TaskSet:
    task_set = file_lookup(project=project, file_id=value) if isinstance(value, str) else None
    if task_set is None:
        raise ValidationFailed(f"no file {value!r} in this project", field=field)
    return task_set


def file_lookup(*, project: Project, file_id: str) -> TaskSet | None:
    number = parse_id(file_id, "file")
    return None if number is None else TaskSet.objects.filter(project=project, pk=number).first()


def parse_id(value: str, prefix: str) -> int | None:
    """The number in ``<prefix>-<n>`` (the ids this API hands out), or None for anything else."""
    head, _, digits = value.partition("-")
    if head != prefix or not digits.isascii() or not digits.isdigit() or len(digits) > 18:
        return None
    return int(digits)


def _job_rows(project: Project, training: TaskSet, validation: TaskSet | None) -> TaskSet:
    """The run's task set: the training file itself, or (with a validation file) a task set of
    its rows for training and the validation file's rows held out."""
    if validation is None:
        return training
    rows = [
        {**data, "split": "train"}
        for data in TaskRow.objects.filter(task_set=training).values_list("data", flat=True)
    ]
    rows += [{**data, "split": "validation"} for data in TaskRow.objects.filter(task_set=validation).values_list("data", flat=True)]  # fmt: skip
    combined = task_sets.task_set_create(project=project, name=f"job-data-{secrets.token_hex(4)}", rows=rows)
    combined.source = {"fine_tuning": {"training_file": training.pk, "validation_file": validation.pk}}
    combined.save(update_fields=["source"])
    return combined


def _environment(
    project: Project, agent: agent_rft.AgentSettings | None = None, token: str = ""
) -> Environment:
    if agent is not None:  # Agent RFT: an environment of the job's own tool endpoints
        return agent_rft.job_environment(project=project, settings=agent, name=f"ft-tools-{token}")
    found = Environment.objects.filter(project=project, name=ENVIRONMENT).first()
    if found is not None:
        return found
    try:
        return environment_create(project=project, name=ENVIRONMENT, max_turns=1)
    except ValidationFailed:  # made by a concurrent request
        return Environment.objects.get(project=project, name=ENVIRONMENT)


JOB_FIELDS = {
    "model", "training_file", "validation_file", "suffix", "seed", "metadata", "method",
    "hyperparameters", "integrations",
}  # fmt: skip


def job_create(*, project: Project, body: dict[str, Any], created_by: Any = None) -> Run:
    """A fine-tuning job's request (OpenAI's body) as a queued run; every field is honoured or
    refused with a 400 naming it."""
    unknown = set(body) - JOB_FIELDS
    if unknown:
        raise ValidationFailed("unknown field", field=sorted(unknown)[0])
    if body.get("integrations"):
        raise ValidationFailed(
            "not supported: runs report to artweb's dashboard and webhooks", field="integrations"
        )
    kind, hyper, grader = _method(body.get("method"), body.get("hyperparameters"))
    agent = agent_rft.agent_settings(body.get("method"))
    model_name = body.get("model")
    if not isinstance(model_name, str) or not model_name:
        raise ValidationFailed("must name a base model or a fine-tuned checkpoint", field="model")
    base = BaseModel.objects.filter(name=model_name).first()
    source = None if base is not None else _checkpoint(project.team, model_name)
    suffix = body.get("suffix")
    if suffix is not None and (not isinstance(suffix, str) or not 1 <= len(suffix) <= 64):
        raise ValidationFailed("must be a string of 1 to 64 characters", field="suffix")
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**31 - 1
    ):
        raise ValidationFailed("must be an integer between 0 and 2147483647", field="seed")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or any(not isinstance(k, str) or len(k) > 64 or not isinstance(v, str) or len(v) > 512 for k, v in metadata.items())
    ):  # fmt: skip
        raise ValidationFailed(
            "at most 16 string keys (64 characters) with string values (512)", field="metadata"
        )
    training = _file(project, body.get("training_file"), "training_file")
    validation = (
        _file(project, body["validation_file"], "validation_file") if body.get("validation_file") else None
    )
    where = f"method.{kind}.hyperparameters" if body.get("method") is not None else "hyperparameters"
    config, reported = job_config(
        kind=kind, hyper=hyper, train_rows=training.train_count, seed=seed, where=where
    )
    if validation is not None:  # every held-out row is evaluated, at step 0 and at the end (eval_interval)
        config["eval_max_rows"] = max(1, min(validation.row_count, 10_000))
    grader_spec = grader_problems(grader, field="method.reinforcement.grader") if grader else REFERENCE_GRADER
    label = slugify(suffix or "")[:40].strip("-_")
    token = secrets.token_hex(3)
    with transaction.atomic():
        data = _job_rows(project, training, validation)
        reward = reward_definition_create(project=project, name=f"ft-grader-{token}", spec=grader_spec)
        environment, name = _environment(project, agent, token), f"ft-{label + '-' if label else ''}{token}"

        def start(model: TrainableModel) -> Run:
            try:
                return run_create(
                    model=model, task_set=data, environment=environment, reward=reward, config=config,
                    created_by=created_by, kind=METHODS[kind], forked_from=source,
                )  # fmt: skip
            except ValidationFailed as exc:  # the rows cannot train this method: the file is at fault
                if exc.field == "task_set":
                    raise ValidationFailed(exc.message, field="training_file") from exc
                raise

        if source is None:
            assert base is not None
            run = start(trainable_model_create(project=project, name=name, base_model=base))
        else:  # continue a fine-tuned checkpoint: a new model whose step 0 is a copy of it
            run = checkpoint_fork(
                source=source, project=project, name=name, config=config, start=start, field="model"
            )
        run.fine_tuning = {
            "model": model_name,
            "training_file": training.pk,
            "validation_file": validation.pk if validation else None,
            "suffix": suffix,
            "seed": config.get("seed", DEFAULTS.seed),
            "metadata": metadata,
            "method": {"type": kind, kind: {"hyperparameters": reported, **({"grader": grader_public(grader_spec)} if grader else {}),
                                      **(agent_rft.method_echo(environment) if agent else {})}},
        }  # fmt: skip
        run.save(update_fields=["fine_tuning"])
    return run


def _checkpoint(team: Team, name: str) -> Checkpoint:
    """The team's checkpoint a job's ``model`` names (``<project>/<model>:<step>``, as a job's
    ``fine_tuned_model`` and every checkpoint's ``fine_tuned_model_checkpoint`` are written;
    ``:latest`` or no tag: the model's latest)."""
    path, _, tag = name.rpartition(":") if ":" in name else (name, "", "latest")
    project_name, slash, model = path.partition("/")
    found = None
    if slash and (tag == "latest" or (tag.isascii() and tag.isdigit() and len(tag) < 10)):
        checkpoints = Checkpoint.objects.filter(
            model__project__team=team, model__project__name=project_name, model__name=model
        ).select_related("model__base_model")
        found = (
            checkpoints.order_by("-step").first()
            if tag == "latest"
            else checkpoints.filter(step=int(tag)).first()
        )
    if found is None:
        raise ValidationFailed(
            f"no base model or fine-tuned checkpoint {name!r} (GET /v1/models lists what you can use)",
            field="model",
        )
    return found


def job_lookup(*, team: Team, job_id: str) -> Run:
    number = parse_id(job_id, "ftjob")
    run = (
        None
        if number is None
        else Run.objects.filter(project__team=team, pk=number).filter(fine_tuning__has_key="method").first()
    )
    if run is None:
        raise NotFound(f"No fine-tuning job found with id '{job_id}'.", field="fine_tuning_job_id")
    return run
