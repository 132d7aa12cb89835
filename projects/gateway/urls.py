from django.urls import path

from projects.api import preview
from projects.gateway import views

# Client-driven training, OpenPipe ART's ServerlessBackend protocol (projects.api.preview).
preview_urlpatterns = [
    path("preview/models", preview.ModelsView.as_view({"post": "create"}), name="preview-models"),
    path(
        "preview/models/<int:model_id>",
        preview.ModelsView.as_view({"get": "retrieve", "delete": "destroy"}),
        name="preview-model",
    ),
    path(
        "preview/models/<int:model_id>/checkpoints",
        preview.CheckpointsView.as_view({"get": "list", "delete": "remove"}),
        name="preview-checkpoints",
    ),
    path(
        "preview/models/<int:model_id>/log",
        preview.ModelLogView.as_view({"post": "create"}),
        name="preview-model-log",
    ),
    path(
        "preview/training-jobs",
        preview.TrainingJobsView.as_view({"post": "create"}),
        name="preview-training-jobs",
    ),
    path(
        "preview/training-jobs/<int:job_id>",
        preview.TrainingJobsView.as_view({"get": "retrieve"}),
        name="preview-training-job",
    ),
    path(
        "preview/training-jobs/<int:job_id>/events",
        preview.TrainingJobEventsView.as_view({"get": "list"}),
        name="preview-training-job-events",
    ),
]

urlpatterns = [
    *preview_urlpatterns,
    path("chat/completions", views.chat_completions, name="gateway-chat-completions"),
    path("models", views.models, name="gateway-models"),
    path("models/<path:model_id>", views.model_detail, name="gateway-model"),
]
