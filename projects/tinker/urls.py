"""``/tinker/api/v1/``: the routes the ``tinker`` SDK calls (``base_url=<artweb>/tinker``)."""

from __future__ import annotations

from django.urls import path

from projects.tinker import rest, views

urlpatterns = [
    # Routes of the SDK artweb does not offer: a clear 400, never an HTML 404 or a retried 5xx.
    *[
        path(route, rest.not_offered, {"what": what})
        for route, what in (
            ("retrieve_futures", "retrieve_futures"),
            ("join_sampling_session", "join_sampling_session"),
            ("create_custom_loss", "create_custom_loss"),
            ("sessions", "sessions"),
            ("sessions/search", "sessions"),
            ("sessions/<str:session_id>/trace_export", "trace_export"),
            ("sessions/<str:session_id>/project", "project"),
            ("audit", "audit"),
            ("billing/<path:rest>", "billing"),
            ("auth/<path:rest>", "auth"),
        )
    ],  # fmt: skip
    path("healthz", views.healthz),
    path("client/config", views.client_config),
    path("client/dynamic_config", views.client_dynamic_config),
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
    path("cancel_future", views.cancel_future),
    path("copy_weights", rest.copy_weights),
    path("training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/publish", rest.checkpoint_publish),
    path("training_runs", rest.training_runs),
    path("training_runs/<str:model_id>", rest.training_run_detail),
    path("training_runs/<str:model_id>/checkpoints", rest.training_run_checkpoints),
    path("save_weights_external", rest.save_weights_external),
    path(
        "training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/external_weights_urls",
        rest.external_weights_urls,
    ),
    path("training_runs/<str:model_id>/checkpoints/<str:kind>/<str:name>/ttl", rest.checkpoint_ttl),
    path("checkpoints", rest.user_checkpoints),
    path("weights_info", rest.weights_info),
    path(
        "training_runs/<str:model_id>/checkpoints/<path:checkpoint_id>", rest.training_run_checkpoint_delete
    ),
]
