from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from projects.api import schema, views  # noqa: F401  (schema registers the auth extension)
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

urlpatterns = [
    path("hyperparameters", views.HyperparametersView.as_view(), name="hyperparameters"),
    path("usage", UsageViewSet.as_view({"get": "list"}), name="usage"),
    path("schema/", SpectacularAPIView.as_view(permission_classes=[]), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema", permission_classes=[]), name="docs"),
    *router.urls,
]
