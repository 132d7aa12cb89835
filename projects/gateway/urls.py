from django.urls import path

from projects.api import completions, fine_tuning, graders, preview
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

# OpenAI's fine-tuning API on runs, task sets and graders (projects.api.fine_tuning).
files, jobs = fine_tuning.FilesView.as_view, fine_tuning.JobsView.as_view
fine_tuning_urlpatterns = [
    path("files", files({"get": "list", "post": "create"}), name="openai-files"),
    path("files/<str:file_id>", files({"get": "retrieve", "delete": "destroy"}), name="openai-file"),
    path("files/<str:file_id>/content", files({"get": "content"}), name="openai-file-content"),
    path("fine_tuning/jobs", jobs({"get": "list", "post": "create"}), name="openai-jobs"),
    path("fine_tuning/jobs/<str:job_id>", jobs({"get": "retrieve"}), name="openai-job"),
    *(
        path(f"fine_tuning/jobs/<str:job_id>/{action}", jobs({method: action}), name=f"openai-job-{action}")
        for method, action in (
            ("post", "cancel"),
            ("post", "pause"),
            ("post", "resume"),
            ("get", "events"),
            ("get", "checkpoints"),
        )
    ),  # fmt: skip
    path(
        "fine_tuning/alpha/graders/run",
        graders.GraderRunView.as_view({"post": "create"}),
        name="openai-graders-run",
    ),
    path(
        "fine_tuning/alpha/graders/validate",
        graders.GraderValidateView.as_view({"post": "create"}),
        name="openai-graders-validate",
    ),
]

urlpatterns = [
    *preview_urlpatterns,
    *fine_tuning_urlpatterns,
    path("chat/completions", views.chat_completions, name="gateway-chat-completions"),
    # Stored completions (projects.api.completions); the list is GET on the path above.
    path(
        "chat/completions/<str:completion_id>",
        completions.StoredCompletionsView.as_view(
            {"get": "retrieve", "post": "update_metadata", "delete": "destroy"}
        ),
        name="stored-completion",
    ),
    path(
        "chat/completions/<str:completion_id>/messages",
        completions.StoredCompletionsView.as_view({"get": "messages"}),
        name="stored-completion-messages",
    ),
    path("models", views.models, name="gateway-models"),
    path("models/<path:model_id>", views.model_detail, name="gateway-model"),
]
