from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from projects.api import evaluations, graders, invitations, scenarios, schema, views  # noqa: F401  (schema registers the auth extension)
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

urlpatterns = [
    path("hyperparameters", views.HyperparametersView.as_view({"get": "list"}), name="hyperparameters"),
    path("environment-kinds", views.EnvironmentKindsView.as_view({"get": "list"}), name="environment-kinds"),
    path("graders/validate", graders.GraderValidateView.as_view({"post": "create"}), name="graders-validate"),
    path("graders/run", graders.GraderRunView.as_view({"post": "create"}), name="graders-run"),
    path("usage", UsageViewSet.as_view({"get": "list"}), name="usage"),
    # POST /api/v1/evaluations without the router's trailing slash, as the docs write it.
    path(
        "evaluations",
        evaluations.EvaluationViewSet.as_view({"get": "list", "post": "create"}, schema=None),
        name="evaluation-list-noslash",
    ),
    path(
        "runs/<int:run_id>/evaluations/",
        evaluations.RunEvaluationsView.as_view({"get": "list"}),
        name="run-evaluations",
    ),
    path(
        "runs/<int:run_id>/evaluations", evaluations.RunEvaluationsView.as_view({"get": "list"}, schema=None)
    ),
    path(
        "checkpoints/<int:checkpoint_id>/evaluations/",
        evaluations.CheckpointEvaluationsView.as_view({"get": "list"}),
        name="checkpoint-evaluations",
    ),
    path(
        "checkpoints/<int:checkpoint_id>/evaluations",
        evaluations.CheckpointEvaluationsView.as_view({"get": "list"}, schema=None),
    ),
    # Not team-scoped: the signed-in person accepting is not a member yet (projects.api.base).
    path(
        "invitations/accept",
        invitations.InvitationAcceptView.as_view({"post": "create"}),
        name="invitation-accept",
    ),
    path("invitations/accept/", invitations.InvitationAcceptView.as_view({"post": "create"}, schema=None)),
    # Before the router: "generate" is not a task-set id.
    path(
        "task-sets/generate",
        scenarios.TaskSetGenerateView.as_view({"post": "create"}),
        name="task-sets-generate",
    ),
    path("task-sets/generate/", scenarios.TaskSetGenerateView.as_view({"post": "create"}, schema=None)),
    path("schema/", SpectacularAPIView.as_view(permission_classes=[]), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[]), name="docs"),
    *router.urls,
]
