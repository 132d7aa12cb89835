"""``/tinker/api/v1/``: the routes the ``tinker`` SDK calls (``base_url=<artweb>/tinker``)."""

from __future__ import annotations

from django.urls import path

from projects.tinker import views

urlpatterns = [
    path("healthz", views.healthz),
    path("client/config", views.client_config),
    path("telemetry", views.telemetry),
    path("get_server_capabilities", views.server_capabilities),
    path("create_session", views.create_session),
    path("session_heartbeat", views.session_heartbeat),
    path("sessions/<str:session_id>", views.session_detail),
    path("sessions/<str:session_id>/finish", views.session_finish),
    path("create_model", views.create_model),
    path("get_info", views.get_info),
    path("forward_backward", views.forward_backward),
    path("optim_step", views.optim_step),
    path("save_weights", views.save_weights),
    path("save_weights_for_sampler", views.save_weights_for_sampler),
    path("load_weights", views.load_weights),
    path("create_sampling_session", views.create_sampling_session),
    path("samplers/<str:sampler_id>", views.sampler_detail),
    path("asample", views.asample),
    path("retrieve_future", views.retrieve_future),
    path("training_runs", views.training_runs),
    path("training_runs/<str:model_id>", views.training_run_detail),
    path("training_runs/<str:model_id>/checkpoints", views.training_run_checkpoints),
    path("save_weights_external", views.save_weights_external),
    path(
        "training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/external_weights_urls",
        views.external_weights_urls,
    ),
    path("training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/ttl", views.checkpoint_ttl),
    path(
        "training_runs/<str:model_id>/checkpoints/<path:checkpoint_id>", views.training_run_checkpoint_delete
    ),
]
