"""Input serializers validate shapes; output serializers render rows. Business rules live in
projects.services (which raise ValidationFailed naming the field).

Why one module of this length: one short serializer per resource (about fifty), from which the
OpenAPI schema is generated; they share the field helpers at the top.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping
from operator import attrgetter
from typing import Any

from django.conf import settings
from django.utils import timezone
from rest_framework import ISO_8601, serializers
from rest_framework.fields import SkipField
from rest_framework.relations import PKOnlyObject
from rest_framework.settings import api_settings

from projects import selectors
from projects.environment_config import MASK, config_public
from projects.errors import ValidationFailed
from projects.grader_secrets import grader_public
from projects.models import (
    ApiKey,
    BaseModel,
    Checkpoint,
    Environment,
    Membership,
    Project,
    RewardDefinition,
    Role,
    Run,
    RunEvent,
    StepMetrics,
    TaskRow,
    TaskSet,
    TrainableModel,
    Trajectory,
)
from projects.services.environments import SYSTEM_PROMPT_MAX_CHARS
from projects.services.projects import DESCRIPTION_MAX_CHARS
from training import names
from training.rollouts.strict_json import parse_int

# --- output ---------------------------------------------------------------------------------


class RowOut(serializers.ModelSerializer):
    """A ModelSerializer that renders each row through a plan of one function per field, built once
    per serializer: DRF's generic per-field dispatch (get_attribute, None checks, timezone lookups)
    was most of the time of a 100-run page (benchmarks/api_pg.py). The output is ModelSerializer's,
    key for key and type for type (tests/projects/api/test_row_serializers.py compares them); a
    field it has no fast form for is rendered by DRF's own path."""

    def to_representation(self, instance: Any) -> dict[Any, Any]:
        plan = self.__dict__.get("_row_plan")
        if plan is None:
            plan = self._row_plan = [
                (field.field_name, self._renderer(field)) for field in self._readable_fields
            ]
        row = {}
        for name, render in plan:
            try:  # noqa: SIM105 (contextlib.suppress is a with block per field: slower)
                row[name] = render(instance)
            except SkipField:  # what DRF does too: the key is left out
                pass
        return row

    def _renderer(self, field: serializers.Field) -> Callable[[Any], Any]:
        if isinstance(field, serializers.SerializerMethodField):
            return getattr(self, field.method_name)  # DRF passes the instance itself
        model_field = _concrete_field(self.Meta.model, field.source_attrs)
        if model_field is None:
            return _drf_renderer(field)
        if model_field.is_relation:
            if type(field) is serializers.PrimaryKeyRelatedField and field.pk_field is None:
                return attrgetter(model_field.attname)  # the id column; DRF's PKOnlyObject's pk
            return _drf_renderer(field)
        read = attrgetter(model_field.attname)
        if type(field) is serializers.JSONField and not field.binary:
            return read  # its to_representation returns the value as it is
        if type(field) is serializers.DateTimeField:
            return _datetime_renderer(field, read)
        convert = _CONVERSIONS.get(type(field), field.to_representation)

        def render(instance: Any) -> Any:
            value = read(instance)
            return None if value is None else convert(value)

        return render


_CONVERSIONS: dict[type, Callable[[Any], Any]] = {
    # These fields' to_representation, exactly (rest_framework.fields).
    serializers.IntegerField: int,
    serializers.CharField: str,
    serializers.FloatField: float,
}


def _concrete_field(model: Any, source_attrs: list[str]) -> Any:
    """The model's own column that ``source_attrs`` names, or None (a property, a dotted path)."""
    if len(source_attrs) != 1:
        return None
    field = next((f for f in model._meta.concrete_fields if f.name == source_attrs[0]), None)
    if field is None or (field.is_relation and not (field.many_to_one or field.one_to_one)):
        return None
    return field


def _drf_renderer(field: serializers.Field) -> Callable[[Any], Any]:
    """DRF's Serializer.to_representation for one field."""

    def render(instance: Any) -> Any:
        attribute = field.get_attribute(instance)
        check_for_none = attribute.pk if isinstance(attribute, PKOnlyObject) else attribute
        return None if check_for_none is None else field.to_representation(attribute)

    return render


def _datetime_renderer(field: serializers.DateTimeField, read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """DateTimeField.to_representation with its time zone looked up once, not per value: an aware
    datetime (what the database returns) in that zone, ISO 8601 with ``Z`` for UTC. Anything else
    (a naive value, another format) goes through the field itself."""
    output_format = getattr(field, "format", api_settings.DATETIME_FORMAT)
    zone: datetime.tzinfo | None
    if hasattr(field, "timezone"):
        zone = field.timezone
    else:
        zone = timezone.get_current_timezone() if settings.USE_TZ else None
    if zone is None or not isinstance(output_format, str) or output_format.lower() != ISO_8601:
        return _drf_renderer(field)

    def render(instance: Any) -> Any:
        value = read(instance)
        if value is None:
            return None
        if type(value) is not datetime.datetime or value.utcoffset() is None:
            return field.to_representation(value)
        text = value.astimezone(zone).isoformat()
        return text[:-6] + "Z" if text.endswith("+00:00") else text

    return render


class ProjectOut(serializers.ModelSerializer):
    class Meta:
        model = Project
        fields = ["id", "name", "description", "created_at"]


class BaseModelOut(serializers.ModelSerializer):
    class Meta:
        model = BaseModel
        fields = ["id", "name", "source", "description"]


class TrainableModelOut(serializers.ModelSerializer):
    base_model = serializers.CharField(source="base_model.name")
    latest_step = serializers.SerializerMethodField()
    storage_bytes = serializers.SerializerMethodField(help_text="bytes its checkpoints and exports use")

    class Meta:
        model = TrainableModel
        fields = [
            "id", "project", "name", "base_model", "lora", "retention", "devices", "fsdp", "latest_step", "storage_bytes", "created_at",
        ]  # fmt: skip

    def get_latest_step(self, obj: TrainableModel) -> int | None:
        latest = obj.checkpoints.order_by("-step").first()
        return latest.step if latest else None

    def get_storage_bytes(self, obj: TrainableModel) -> int:
        return selectors.model_storage_bytes(model=obj)


class RewardDefinitionOut(serializers.ModelSerializer):
    spec = serializers.SerializerMethodField(
        help_text=f"the grader spec; endpoint graders' header values are write-only, shown as {MASK!r}"
    )

    class Meta:
        model = RewardDefinition
        fields = ["id", "project", "name", "version", "spec", "created_at"]

    def get_spec(self, obj: RewardDefinition) -> dict[str, Any]:
        return grader_public(obj.spec)


class TaskSetOut(serializers.ModelSerializer):
    class Meta:
        model = TaskSet
        fields = ["id", "project", "name", "row_count", "train_count", "validation_count", "created_at"]


class TaskRowOut(serializers.ModelSerializer):
    class Meta:
        model = TaskRow
        fields = ["id", "index", "split", "data"]


class EnvironmentOut(serializers.ModelSerializer):
    config = serializers.SerializerMethodField(
        help_text=f"kind-specific settings; MCP header values are write-only, shown as {MASK!r}"
    )

    class Meta:
        model = Environment
        fields = [
            "id",
            "project",
            "name",
            "kind",
            "system_prompt",
            "max_turns",
            "tools",
            "config",
            "tool_timeout_s",
            "sampling",
            "created_at",
        ]

    def get_config(self, obj: Environment) -> dict[str, Any]:
        return config_public(obj.config)


class RunOut(RowOut):
    object = serializers.SerializerMethodField()
    steps_done = serializers.IntegerField(read_only=True)

    class Meta:
        model = Run
        fields = [
            "id", "object", "kind", "project", "model", "task_set", "environment", "reward", "config", "status",
            "error", "cancel_requested", "pause_requested", "start_step", "current_step", "steps_done",
            "total_steps", "forked_from", "attempts", "heartbeat_at", "created_at", "started_at",
            "finished_at",
        ]  # fmt: skip

    def get_object(self, obj: Run) -> str:
        return "run"


class RunEventOut(RowOut):
    object = serializers.SerializerMethodField()

    class Meta:
        model = RunEvent
        fields = ["id", "object", "created_at", "level", "type", "message", "data"]

    def get_object(self, obj: RunEvent) -> str:
        return "run.event"


class StepMetricsOut(RowOut):
    class Meta:
        model = StepMetrics
        fields = ["id", "step", "reward_mean", "reward_std", "loss", "metrics", "created_at"]


class CheckpointOut(RowOut):
    model_id = serializers.SerializerMethodField()

    class Meta:
        model = Checkpoint
        fields = ["id", "model", "run", "step", "model_id", "metrics", "created_at"]

    def get_model_id(self, obj: Checkpoint) -> str:
        """The id to use with /v1/chat/completions: ``<project>/<model>:<step>``."""
        return f"{obj.model.project.name}/{obj.model.name}:{obj.step}"


class TrajectoryOut(RowOut):
    class Meta:
        model = Trajectory
        fields = [
            "id", "step", "group_index", "sample_index", "task_row_index", "messages", "reward",
            "sub_rewards", "errors", "metrics", "prompt_tokens", "completion_tokens", "finish_reason",
        ]  # fmt: skip


class MemberOut(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "user_id", "username", "role", "created_at"]


class ApiKeyOut(serializers.ModelSerializer):
    class Meta:
        model = ApiKey
        fields = [
            "id", "name", "prefix", "read_only", "completion_storage", "created_at", "last_used_at", "revoked_at"
        ]  # fmt: skip


# --- input ----------------------------------------------------------------------------------
# Every number has a range and every string the length of its column: a value PostgreSQL would
# refuse (an id past bigint, a name longer than varchar(63)) is a 400 here, not a database error.
# Every key is one the action reads: a misspelt one (max_new_tokns) is a 400 naming it, never a
# default silently used instead.


def unknown_fields(data: Mapping[str, Any], fields: Iterable[str]) -> list[tuple[str, str]]:
    """``(key, reason)`` for each key of the body ``data`` that is none of ``fields``, worded as the
    run config words an unknown hyperparameter (training.names: "...; did you mean max_new_tokens?")."""
    known = sorted(set(fields))
    if not known:
        return [(str(key), "unknown field: this action takes no body") for key in data]
    return [
        (str(key), names.unknown("field", str(key), known, quoted=False)) for key in data if key not in known
    ]


def refuse_unknown_fields(data: Mapping[str, Any], fields: Iterable[str]) -> None:
    """A 400 naming every unknown key of ``data`` (for bodies read without a serializer)."""
    if problems := unknown_fields(data, fields):
        (field, message), *_ = problems
        raise ValidationFailed(message, field=field, problems=problems)


class InputSerializer(serializers.Serializer):
    """The base of every input serializer (nested ones too): a key that is none of its fields is a
    400 naming it, reported together with the other fields' problems, unknown keys first."""

    def to_internal_value(self, data: Any) -> Any:
        writable = [name for name, field in self.fields.items() if not field.read_only]
        unknown = unknown_fields(data, writable) if isinstance(data, Mapping) else []
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if unknown and isinstance(exc.detail, dict):
                raise serializers.ValidationError(
                    {**{key: [reason] for key, reason in unknown}, **exc.detail}
                ) from None
            raise
        if unknown:
            raise serializers.ValidationError({key: [reason] for key, reason in unknown})
        return value


class NoBodyIn(InputSerializer):
    """The body of an action that takes none (cancel, revoke …): ``{}`` or nothing at all."""


ID_MAX = 2**63 - 1  # PostgreSQL's bigint
SEED_MAX = 2**32 - 1  # what random number generators take (training.config.SEED_MAX)


def id_field(**kwargs: Any) -> serializers.IntegerField:
    """The id of a row named in a body: 1 to 2**63 - 1."""
    return serializers.IntegerField(min_value=1, max_value=ID_MAX, **kwargs)


def seed_field(**kwargs: Any) -> serializers.IntegerField:
    return serializers.IntegerField(min_value=0, max_value=SEED_MAX, **kwargs)


def fraction_field(**kwargs: Any) -> serializers.FloatField:
    """A validation fraction: at least 0, below 1 (the service refuses 1 itself)."""
    return serializers.FloatField(min_value=0.0, max_value=1.0, **kwargs)


class ProjectIn(InputSerializer):
    name = serializers.CharField(max_length=63)
    description = serializers.CharField(
        max_length=DESCRIPTION_MAX_CHARS, required=False, allow_blank=True, default=""
    )


class ProjectUpdateIn(InputSerializer):
    name = serializers.CharField(max_length=63, required=False)
    description = serializers.CharField(max_length=DESCRIPTION_MAX_CHARS, required=False, allow_blank=True)


class TrainableModelIn(InputSerializer):
    project = id_field()
    name = serializers.CharField(max_length=63)
    base_model = serializers.CharField(
        max_length=100, help_text="name of a base model from /api/v1/base-models"
    )
    lora = serializers.DictField(required=False, default=dict)
    devices = serializers.IntegerField(
        required=False, default=1, help_text="devices its ART training jobs train on (data-parallel), 1-16"
    )
    fsdp = serializers.BooleanField(
        required=False,
        default=False,
        help_text="its ART training jobs shard the base across their devices (FSDP2)",
    )


class TrainableModelUpdateIn(InputSerializer):
    lora = serializers.DictField(required=False)
    devices = serializers.IntegerField(
        required=False,
        help_text="devices its ART training jobs train on (data-parallel), 1-16; from the next job",
    )
    fsdp = serializers.BooleanField(
        required=False,
        help_text="its ART training jobs shard the base across their devices (FSDP2); from the next job",
    )
    retention = serializers.JSONField(
        required=False,
        help_text='{"keep_last": N, "keep_best": {"metric": "eval.mean_reward", "n": K}}; {} keeps all',
    )


class RewardDefinitionIn(InputSerializer):
    project = id_field()
    name = serializers.CharField(max_length=63)
    spec = serializers.JSONField(help_text="grader spec, e.g. {'type': 'string_check', ...}")


class RewardDefinitionUpdateIn(InputSerializer):
    spec = serializers.JSONField()


class TaskSetIn(InputSerializer):
    project = id_field()
    name = serializers.CharField(max_length=63)
    rows = serializers.ListField(child=serializers.JSONField(), required=False, help_text="task rows")
    jsonl = serializers.CharField(required=False, trim_whitespace=False, help_text="JSONL text")
    file = serializers.FileField(required=False, help_text="JSONL file (multipart upload)")
    validation_fraction = fraction_field(required=False, default=0.0)
    seed = seed_field(required=False, default=0)


CONFIG_HELP = (
    "kind-specific settings (GET /api/v1/environment-kinds). An MCP server's config.headers values "
    "(e.g. Authorization) are write-only: stored encrypted, returned as " + repr(MASK) + "."
)
CONFIG_UPDATE_HELP = (
    CONFIG_HELP + " The whole config is replaced, except header values: a value of " + repr(MASK) + " keeps "
    "the stored one, and a config without headers keeps them all, while config.url stays the same "
    "(a changed URL needs the values again); a header left out of a given headers object is removed."
)


class EnvironmentIn(InputSerializer):
    """Kind, config, tools and max_turns are checked by the environment registry's per-kind rules
    (see GET /api/v1/environment-kinds); a bad value is a 400 naming the field."""

    project = id_field()
    name = serializers.CharField(max_length=63)
    kind = serializers.CharField(max_length=32, required=False, default="chat")
    system_prompt = serializers.CharField(
        max_length=SYSTEM_PROMPT_MAX_CHARS,
        required=False,
        allow_blank=True,
        default="",
        trim_whitespace=False,
    )
    max_turns = serializers.IntegerField(
        min_value=1,
        max_value=1000,
        required=False,
        allow_null=True,
        default=None,
        help_text="default: the kind's",
    )
    tools = serializers.ListField(child=serializers.JSONField(), required=False, default=list)
    config = serializers.DictField(required=False, default=dict, help_text=CONFIG_HELP)
    tool_timeout_s = serializers.FloatField(min_value=0.0, max_value=600.0, required=False, default=10.0)
    sampling = serializers.DictField(required=False, default=dict)


class EnvironmentUpdateIn(InputSerializer):
    kind = serializers.CharField(max_length=32, required=False)
    system_prompt = serializers.CharField(
        max_length=SYSTEM_PROMPT_MAX_CHARS, required=False, allow_blank=True, trim_whitespace=False
    )
    max_turns = serializers.IntegerField(min_value=1, max_value=1000, required=False, allow_null=True)
    tools = serializers.ListField(child=serializers.JSONField(), required=False)
    config = serializers.DictField(required=False, help_text=CONFIG_UPDATE_HELP)
    tool_timeout_s = serializers.FloatField(min_value=0.0, max_value=600.0, required=False)
    sampling = serializers.DictField(required=False)


class EnvironmentKindOut(serializers.Serializer):
    kind = serializers.CharField()
    description = serializers.CharField()
    answer = serializers.CharField(help_text="how the final answer is read")
    default_max_turns = serializers.IntegerField()
    config = serializers.DictField(child=serializers.CharField(), help_text="config keys and their help")
    tools = serializers.CharField(help_text="what the tools field holds for this kind")
    available_tools = serializers.ListField(
        child=serializers.DictField(), help_text="built-in tool definitions"
    )


class AdapterImportIn(InputSerializer):
    file = serializers.FileField(
        help_text="a PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) as .zip or .tar.gz"
    )


class RunIn(InputSerializer):
    kind = serializers.ChoiceField(
        choices=["platform", "sft", "dpo"],
        required=False,
        default="platform",
        help_text="platform: GRPO on rollouts graded by the reward; sft: supervised on the rows' assistant "
        "replies ('completion' or a final assistant message); dpo: on the rows' 'chosen' / 'rejected' replies",
    )
    model = id_field()
    task_set = id_field()
    environment = id_field()
    reward = id_field(help_text="id of a reward definition version")
    config = serializers.DictField(required=False, default=dict, help_text="see /api/v1/hyperparameters")
    start_from = serializers.JSONField(
        required=False,
        help_text='"latest" (default: the model\'s latest checkpoint, or a fresh adapter when it has '
        'none), "base" (a fresh adapter; 409 on a model trained past step 0) or the id of a '
        "checkpoint of the model (409 unless it is the model's latest)",
    )

    def validate_start_from(self, value: Any) -> str | int:
        if value in ("latest", "base"):
            return str(value)
        if isinstance(value, str):  # parse_int, not int(): 5,000 digits are a 400, not a ValueError
            value = parse_int(value, low=1, high=ID_MAX)
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= ID_MAX:
            return value
        raise serializers.ValidationError('must be "latest", "base" or a checkpoint id of the model')


class RunForkIn(InputSerializer):
    from_step = serializers.IntegerField(
        min_value=0, max_value=ID_MAX, help_text="the checkpoint step of the run's model to fork from"
    )
    name = serializers.CharField(max_length=63, help_text="name of the new model (unique in the project)")
    config = serializers.DictField(
        required=False,
        default=dict,
        help_text="hyperparameters overriding the run's (see /api/v1/hyperparameters)",
    )


class MemberRoleIn(InputSerializer):
    role = serializers.ChoiceField(choices=Role.choices)


STORAGE_CHOICES = ["", "off", "requested", "all"]


class ApiKeyIn(InputSerializer):
    name = serializers.CharField(max_length=100)
    read_only = serializers.BooleanField(required=False, default=False)  # type: ignore[assignment]
    completion_storage = serializers.ChoiceField(
        choices=STORAGE_CHOICES, required=False, default="",
        help_text="which of its completions are stored: '' follows the team, else over the team's setting",
    )  # fmt: skip


class ApiKeyUpdateIn(InputSerializer):
    completion_storage = serializers.ChoiceField(choices=STORAGE_CHOICES)
