from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from projects.api import graders, schema, views  # noqa: F401  (schema registers the auth extension)
from projects.api.usage import UsageViewSet

router = DefaultRouter()
router.register("projects", views.ProjectViewSet, basename="project")
router.register("base-models", views.BaseModelViewSet, basename="base-model")
router.register("models", views.TrainableModelViewSet, basename="model")
router.register("reward-definitions", views.RewardDefinitionViewSet, basename="reward-definition")
router.register("task-sets", views.TaskSetViewSet, basename="task-set")
router.register("environments", views.EnvironmentViewSet, basename="environment")
router.register("runs", views.RunViewSet, basename="run")
router.register("api-keys", views.ApiKeyViewSet, basename="api-key")
router.register("judge-endpoints", graders.JudgeEndpointViewSet, basename="judge-endpoint")

urlpatterns = [
    path("hyperparameters", views.HyperparametersView.as_view(), name="hyperparameters"),
    path("graders/validate", graders.GraderValidateView.as_view(), name="graders-validate"),
    path("graders/run", graders.GraderRunView.as_view(), name="graders-run"),
    path("usage", UsageViewSet.as_view({"get": "list"}), name="usage"),
    path("schema/", SpectacularAPIView.as_view(permission_classes=[]), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[]), name="docs"),
    *router.urls,
]
