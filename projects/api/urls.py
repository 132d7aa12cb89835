from typing import Any

from django.urls import URLPattern, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from projects.api import (
    aliases,
    checkpoints,
    completions,
    evaluations,
    feedback,
    graders,
    invitations,
    scenarios,
    schema,  # noqa: F401  (registers the API key's OpenAPI security scheme)
    views,
    webhooks,
)
from projects.api.costs import CostViewSet
from projects.api.usage import UsageViewSet

router = DefaultRouter()
router.include_root_view = False  # an unscoped index of the API; the schema and docs describe it
router.register("projects", views.ProjectViewSet, basename="project")
router.register("base-models", views.BaseModelViewSet, basename="base-model")
router.register("models", views.TrainableModelViewSet, basename="model")
router.register("reward-definitions", views.RewardDefinitionViewSet, basename="reward-definition")
router.register("task-sets", views.TaskSetViewSet, basename="task-set")
router.register("environments", views.EnvironmentViewSet, basename="environment")
router.register("runs", views.RunViewSet, basename="run")
router.register("api-keys", views.ApiKeyViewSet, basename="api-key")
router.register("members", views.MemberViewSet, basename="member")
router.register("invitations", invitations.InvitationViewSet, basename="invitation")
router.register("judge-endpoints", graders.JudgeEndpointViewSet, basename="judge-endpoint")
router.register("evaluations", evaluations.EvaluationViewSet, basename="evaluation")
router.register("checkpoints", checkpoints.CheckpointViewSet, basename="checkpoint")
router.register("exports", checkpoints.ExportViewSet, basename="export")
router.register("webhooks", webhooks.WebhookViewSet, basename="webhook")
router.register("feedback", feedback.FeedbackView, basename="feedback")
router.register("aliases", aliases.AliasView, basename="alias")
router.register("completion-gradings", feedback.CompletionGradingView, basename="completion-grading")


def without_slash(patterns: list[Any]) -> list[URLPattern]:
    """The router's routes again without their trailing slash, out of the schema and unnamed (so
    reverse() keeps writing the documented form): ``POST /runs`` creates instead of a redirect
    that would lose its body (or APPEND_SLASH's 500 under DEBUG)."""
    found = []
    for pattern in patterns:
        regex, view = pattern.pattern.regex.pattern, pattern.callback
        if regex.endswith("/$") and hasattr(view, "actions"):
            found.append(
                re_path(
                    regex[:-2] + "$", view.cls.as_view(view.actions, **{**view.initkwargs, "schema": None})
                )
            )
    return found


def both_ways(route: str, viewset: Any, actions: dict[str, str], name: str | None = None) -> list[URLPattern]:
    """``route`` (as documented) and the same with its trailing slash toggled (out of the schema):
    every path answers with or without the slash, like the router's, and never redirects (a
    redirected POST loses its body)."""
    other = route[:-1] if route.endswith("/") else f"{route}/"
    return [
        path(route, viewset.as_view(actions), name=name),
        path(other, viewset.as_view(actions, schema=None)),
    ]


# The docs page renders only through its HTML template, which DRF's OPTIONS answer has none of
# (a 500): GET alone, so OPTIONS is a 405.
docs_view = SpectacularSwaggerView.as_view(
    url_name="schema", permission_classes=[], http_method_names=["get", "head"]
)

urlpatterns = [
    *both_ways("hyperparameters", views.HyperparametersView, {"get": "list"}, "hyperparameters"),
    *both_ways("environment-kinds", views.EnvironmentKindsView, {"get": "list"}, "environment-kinds"),
    *both_ways("graders/validate", graders.GraderValidateView, {"post": "create"}, "graders-validate"),
    *both_ways("graders/run", graders.GraderRunView, {"post": "create"}, "graders-run"),
    *both_ways("team", completions.TeamSettingsView, {"get": "list", "patch": "partial_update"}, "team"),
    *both_ways(
        "stored-completions/export",
        completions.StoredCompletionsAdminView,
        {"get": "export"},
        "stored-completions-export",
    ),
    *both_ways(
        "stored-completions/purge",
        completions.StoredCompletionsAdminView,
        {"post": "purge"},
        "stored-completions-purge",
    ),
    *both_ways(
        "stored-completions/train",
        feedback.TrainOnCompletionsView,
        {"post": "train"},
        "stored-completions-train",
    ),
    *both_ways(
        "stored-completions/train/<int:schedule_id>",
        feedback.TrainingScheduleView,
        {"get": "retrieve"},
        "training-schedule",
    ),
    *both_ways(
        "stored-completions/train/<int:schedule_id>/cancel",
        feedback.TrainingScheduleView,
        {"post": "cancel"},
        "training-schedule-cancel",
    ),
    *both_ways(
        "models/<int:model_id>/checkpoint-feedback",
        aliases.CheckpointFeedbackView,
        {"get": "list"},
        "model-checkpoint-feedback",
    ),
    *both_ways("conversations", completions.ConversationsView, {"get": "list"}, "conversations"),
    *both_ways(
        "conversations/<str:conversation_id>",
        completions.ConversationsView,
        {"get": "retrieve"},
        "conversation",
    ),
    *both_ways("usage", UsageViewSet, {"get": "list"}, "usage"),
    *both_ways("costs", CostViewSet, {"get": "list"}, "costs"),
    *both_ways(
        "runs/<int:run_id>/evaluations/", evaluations.RunEvaluationsView, {"get": "list"}, "run-evaluations"
    ),
    *both_ways(
        "checkpoints/<int:checkpoint_id>/evaluations/",
        evaluations.CheckpointEvaluationsView,
        {"get": "list"},
        "checkpoint-evaluations",
    ),
    *both_ways(
        "models/<int:model_id>/checkpoints/prune",
        checkpoints.ModelCheckpointsPruneView,
        {"post": "create"},
        "model-checkpoints-prune",
    ),
    # Not team-scoped: the signed-in person accepting is not a member yet (projects.api.base).
    *both_ways(
        "invitations/accept", invitations.InvitationAcceptView, {"post": "create"}, "invitation-accept"
    ),
    # Before the router: "generate" is not a task-set id.
    *both_ways("task-sets/generate", scenarios.TaskSetGenerateView, {"post": "create"}, "task-sets-generate"),
    path("schema/", SpectacularAPIView.as_view(permission_classes=[]), name="schema"),
    path("schema", SpectacularAPIView.as_view(permission_classes=[])),
    path("docs/", docs_view, name="docs"),
    path("docs", docs_view),
    *router.urls,
    *without_slash(router.urls),
]
