"""The domain: teams and their keys, projects, models, rewards, task sets, environments, runs,
evaluations, client-driven training jobs, and what the gateway keeps. One module per subject; this
package re-exports every model, so ``from projects.models import Run`` and the migrations see one
app, ``projects``.

Every row below a Team is reachable from exactly one team (directly or through its project); the
API's one base view class scopes by that path (``TEAM_PATH``) so a query can never cross teams.
Business logic lives in projects.services (writes) and projects.selectors (reads), not here.
"""

from __future__ import annotations

from projects.models.base import EventLevel, slug_validator
from projects.models.catalogue import (
    BaseModel,
    Environment,
    EnvironmentKind,
    Project,
    RewardDefinition,
    Split,
    TaskRow,
    TaskSet,
    TrainableModel,
)
from projects.models.completions import (
    AliasAction,
    AliasEvent,
    CompletionFeedback,
    CompletionGrading,
    GradingStatus,
    ModelAlias,
    StoredCompletion,
)
from projects.models.evaluations import Evaluation, EvaluationEvent, EvaluationSample, EvaluationStatus
from projects.models.exports import Export, ExportFormat, ExportStatus
from projects.models.gateway import InferenceServer, UsageRecord
from projects.models.runs import (
    CLIENT_KINDS,
    WORKER_KINDS,
    Checkpoint,
    EventType,
    Run,
    RunEvent,
    RunKind,
    RunStatus,
    StepMetrics,
    Trajectory,
)
from projects.models.scenarios import ScenarioJob, ScenarioJobStatus
from projects.models.teams import ApiKey, CompletionStorage, Invitation, JudgeEndpoint, Membership, Role, Team
from projects.models.tinker import TinkerFuture, TinkerFutureStatus, TinkerModel, TinkerSampler, TinkerSession
from projects.models.training_jobs import (
    ClientLog,
    TrainingJob,
    TrainingJobEvent,
    TrainingJobEventType,
    TrainingJobStatus,
)
from projects.models.webhooks import WEBHOOK_EVENT_TYPES, DeliveryStatus, WebhookDelivery, WebhookEndpoint

__all__ = [
    "CompletionGrading",
    "GradingStatus",
    "AliasAction",
    "AliasEvent",
    "ModelAlias",
    "CompletionFeedback",
    "CompletionStorage",
    "StoredCompletion",
    "CLIENT_KINDS",
    "TinkerFuture",
    "TinkerFutureStatus",
    "TinkerModel",
    "TinkerSampler",
    "TinkerSession",
    "WEBHOOK_EVENT_TYPES",
    "DeliveryStatus",
    "WebhookDelivery",
    "WebhookEndpoint",
    "ApiKey",
    "BaseModel",
    "Checkpoint",
    "ClientLog",
    "Environment",
    "EnvironmentKind",
    "Evaluation",
    "EvaluationEvent",
    "EvaluationSample",
    "EvaluationStatus",
    "EventLevel",
    "EventType",
    "Export",
    "ExportFormat",
    "ExportStatus",
    "InferenceServer",
    "Invitation",
    "JudgeEndpoint",
    "Membership",
    "Project",
    "RewardDefinition",
    "Role",
    "Run",
    "RunEvent",
    "RunKind",
    "WORKER_KINDS",
    "RunStatus",
    "ScenarioJob",
    "ScenarioJobStatus",
    "Split",
    "StepMetrics",
    "TaskRow",
    "TaskSet",
    "Team",
    "TrainableModel",
    "TrainingJob",
    "TrainingJobEvent",
    "TrainingJobEventType",
    "TrainingJobStatus",
    "Trajectory",
    "UsageRecord",
    "slug_validator",
]
