from django.contrib.auth import views as auth_views
from django.urls import path

from frontend import (
    checkpoint_pages,
    compare_pages,
    completion_pages,
    evaluation_pages,
    judge_pages,
    playground,
    reward_pages,
    run_pages,
    task_set_pages,
    views,
    webhook_pages,
)

app_name = "frontend"

urlpatterns = [
    path("", views.root, name="root"),
    path("login/", auth_views.LoginView.as_view(template_name="frontend/login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("team/switch", views.team_switch, name="team-switch"),
    path("team/members", views.members, name="members"),
    path("team/members/<int:membership_id>/remove", views.member_remove, name="member-remove"),
    path("team/members/<int:membership_id>/role", views.member_role, name="member-role"),
    path("team/invitations/<int:invitation_id>/revoke", views.invitation_revoke, name="invitation-revoke"),
    path("invitations/accept", views.invitation_accept, name="invitation-accept"),
    path("team/api-keys", views.api_keys, name="api-keys"),
    path("team/api-keys/<int:key_id>/revoke", views.api_key_revoke, name="api-key-revoke"),
    path("team/webhooks", webhook_pages.webhook_list, name="webhooks"),
    path("team/webhooks/<int:webhook_id>/", webhook_pages.webhook_detail, name="webhook"),
    path("team/webhooks/<int:webhook_id>/test", webhook_pages.webhook_test, name="webhook-test"),
    path("team/webhooks/<int:webhook_id>/rotate", webhook_pages.webhook_rotate, name="webhook-rotate"),
    path("team/webhooks/<int:webhook_id>/delete", webhook_pages.webhook_delete, name="webhook-delete"),
    path(
        "team/webhooks/<int:webhook_id>/deliveries/<int:delivery_id>/redeliver",
        webhook_pages.webhook_redeliver,
        name="webhook-redeliver",
    ),
    path("team/judge-endpoints", judge_pages.judge_endpoint_list, name="judge-endpoints"),
    path(
        "team/judge-endpoints/<int:endpoint_id>/test",
        judge_pages.judge_endpoint_test,
        name="judge-endpoint-test",
    ),
    path(
        "team/judge-endpoints/<int:endpoint_id>/rotate",
        judge_pages.judge_endpoint_rotate,
        name="judge-endpoint-rotate",
    ),
    path("projects/", views.projects, name="projects"),
    path("projects/<int:project_id>/", views.project, name="project"),
    path("projects/<int:project_id>/runs/new", run_pages.run_new, name="run-new"),
    path("projects/<int:project_id>/rewards/", reward_pages.rewards, name="rewards"),
    path(
        "projects/<int:project_id>/task-sets/generate",
        task_set_pages.task_set_generate,
        name="task-set-generate",
    ),
    path("task-sets/<int:task_set_id>/", task_set_pages.task_set, name="task-set"),
    path("scenario-jobs/<int:job_id>/", task_set_pages.scenario_job, name="scenario-job"),
    path("scenario-jobs/<int:job_id>/live", task_set_pages.scenario_job_live, name="scenario-job-live"),
    path("evaluations/", evaluation_pages.evaluation_list, name="evaluations"),
    path("evaluations/new", evaluation_pages.evaluation_new, name="evaluation-new"),
    path("evaluations/<int:evaluation_id>/", evaluation_pages.evaluation_detail, name="evaluation"),
    path("evaluations/<int:evaluation_id>/live", evaluation_pages.evaluation_live, name="evaluation-live"),
    path(
        "evaluations/<int:evaluation_id>/cancel", evaluation_pages.evaluation_cancel, name="evaluation-cancel"
    ),
    path("models/<int:model_id>/", views.model_detail, name="model"),
    path("models/<int:model_id>/checkpoints", checkpoint_pages.model_checkpoints, name="model-checkpoints"),
    path("runs/", run_pages.runs, name="runs"),
    path("runs/compare", compare_pages.runs_compare, name="runs-compare"),
    path("runs/<int:run_id>/", run_pages.run_detail, name="run"),
    path("runs/<int:run_id>/live", run_pages.run_live, name="run-live"),
    path("runs/<int:run_id>/metrics.json", run_pages.run_metrics, name="run-metrics"),
    path("runs/<int:run_id>/cancel", run_pages.run_cancel, name="run-cancel"),
    path("runs/<int:run_id>/pause", run_pages.run_pause, name="run-pause"),
    path("runs/<int:run_id>/resume", run_pages.run_resume, name="run-resume"),
    path("runs/<int:run_id>/fork", run_pages.run_fork, name="run-fork"),
    path("runs/<int:run_id>/trajectories", run_pages.trajectories, name="trajectories"),
    path("rewards/<int:reward_id>/", reward_pages.reward, name="reward"),
    path("rewards/validate", reward_pages.grader_validate, name="grader-validate"),
    path("checkpoints/<int:checkpoint_id>/", run_pages.checkpoint, name="checkpoint"),
    path(
        "checkpoints/<int:checkpoint_id>/delete", checkpoint_pages.checkpoint_delete, name="checkpoint-delete"
    ),
    path("playground/chat", playground.playground_chat, name="playground-chat"),
    path("completions/", completion_pages.completions, name="completions"),
    path("completions/task-set", completion_pages.completions_to_task_set, name="completions-task-set"),
    path("completions/<str:completion_id>/", completion_pages.completion, name="completion"),
]
