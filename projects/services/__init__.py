"""Writes. Every change to the domain goes through a function here (keyword-only, typed), one
module per subject; this package re-exports them all, so callers write ``services.run_create(...)``.

- ``teams``: teams, memberships (a team keeps an owner), the remembered team, API keys
- ``invitations``: joining a team only by accepting an owner's invitation (consent)
- ``projects``: projects, the base model catalogue, trainable models
- ``rewards``: reward definitions (versioned grader specs)
- ``task_sets``: task set upload (the row rules) and deletion
- ``environments``: environments, and building one for use (MCP headers decrypted)
- ``runs``: the run state machine, create, claim, heartbeat, fail, requeue
- ``run_control``: cancel, pause, resume, the runs a stopped ``manage.py up`` left running, and
  the end of client runs (stopped, or idle for ``CLIENT_RUN_IDLE_S``)
- ``run_forks``: a fork: a new model whose step 0 copies a run's checkpoint, and its run (and
  ``checkpoint_fork``, which a fine-tuning job continuing a checkpoint shares)
- ``aliases``: model aliases (``project/model:prod``), canaries, promotion and rollback
- ``completions``: stored completions (the gateway's captures), the team's storage settings, retention
- ``completion_training``: training a model on its rated stored completions, one step or a schedule
- ``fine_tuning``: OpenAI's fine-tuning API on these objects (a file is a task set, a job a run)
- ``fine_tuning_rows``: the fine-tuning files' rows (OpenAI's three formats) as task rows and back
- ``adapters``: a LoRA adapter trained elsewhere imported as a model's step 0
- ``transitions``: the one state-machine transition under runs, evaluations and training jobs
- ``steps``: a step's metrics, trajectories and checkpoint, recorded once
- ``checkpoints``: deleting and pruning checkpoints, retention after every step, their files
- ``exports``: exports of a checkpoint (merged weights), their job's claim and result
- ``evaluations``: the evaluation state machine and a run's own evaluations
- ``judges``: team judge endpoints and the python graders' sandbox limits
- ``scenarios``: task sets written by an LLM for an environment
- ``tinker``: the Tinker API's sessions, training clients, futures and samplers (projects.tinker)
- ``training_jobs``: client-driven training (``/v1/preview/``): models, jobs, checkpoint deletion
- ``_common``: helpers the modules share (slugs, unique names, NUL-free JSON)

Each module with a concurrency invariant states it at its top.
"""

from __future__ import annotations

from projects.services._common import (
    check_slug,
    json_text_read,
    jsonb_safe,
)
from projects.services.adapters import model_adapter_import
from projects.services.aliases import (
    alias_canary,
    alias_delete,
    alias_promote,
    alias_rollback,
    alias_set,
)
from projects.services.checkpoints import (
    PruneResult,
    checkpoint_delete,
    checkpoints_delete,
    checkpoints_prune,
    model_files_remove_on_commit,
    retention_after_step,
    retention_check,
    run_checkpoints_settle,
)
from projects.services.client_models import (
    client_model_delete,
    client_model_register,
    platform_run_active,
    training_job_active,
)
from projects.services.completion_training import (
    training_job_from_completions,
    training_schedule_from_completions,
)
from projects.services.completions import (
    api_key_storage_set,
    completion_grading_create,
    completion_storage_set,
    feedback_add,
    stored_completion_create,
    stored_completion_delete,
    stored_completion_update,
    stored_completions_expire,
    stored_completions_purge,
    task_set_from_completions,
)
from projects.services.conversations import conversation_tokens
from projects.services.environments import (
    environment_build,
    environment_create,
    environment_delete,
    environment_update,
)
from projects.services.evaluations import (
    EVALUATION_SETTINGS,
    EVALUATION_SPLITS,
    EVALUATION_TERMINAL_STATUSES,
    EVALUATION_TRANSITIONS,
    evaluation_cancel,
    evaluation_claim,
    evaluation_create,
    evaluation_event_add,
    evaluation_fail,
    evaluation_finish,
    evaluation_heartbeat,
    evaluation_transition,
    evaluations_requeue_orphaned,
    run_evaluation_record,
    run_pass_threshold,
)
from projects.services.exports import (
    export_claim,
    export_create,
    export_fail,
    export_finish,
    export_heartbeat,
    export_key,
    exports_requeue_orphaned,
)
from projects.services.invitations import (
    CreatedInvitation,
    invitation_accept,
    invitation_check,
    invitation_create,
    invitation_revoke,
)
from projects.services.judges import (
    DEFAULT_JUDGE,
    judge_client,
    judge_endpoint_create,
    judge_endpoint_update,
    sandbox_config,
)
from projects.services.projects import (
    base_model_register,
    project_create,
    project_delete,
    project_update,
    trainable_model_create,
    trainable_model_delete,
    trainable_model_update,
)
from projects.services.rewards import (
    grader_problems,
    reward_definition_create,
    reward_definition_delete,
    reward_definition_update,
)
from projects.services.run_control import (
    client_run_end,
    client_runs_close_idle,
    run_cancel,
    run_pause,
    run_pause_finish,
    run_resume,
    runs_pause_interrupted,
)
from projects.services.run_forks import model_checkpoint_root, run_fork
from projects.services.runs import (
    ACTIVE_STATUSES,
    ALLOWED_TRANSITIONS,
    START_FROM_BASE,
    START_FROM_LATEST,
    TERMINAL_STATUSES,
    run_claim,
    run_config_check,
    run_create,
    run_event_add,
    run_fail,
    run_heartbeat,
    run_platform_inputs,
    run_set_start_step,
    run_start_text,
    run_transition,
    runs_requeue_orphaned,
)
from projects.services.scenarios import (
    task_set_generate,
)
from projects.services.steps import (
    TrajectoryRecord,
    checkpoint_record,
    step_record,
)
from projects.services.task_sets import (
    parse_rows,
    task_set_create,
    task_set_delete,
    task_set_rows_check,
)
from projects.services.teams import (
    LAST_OWNER,
    CreatedApiKey,
    api_key_authenticate,
    api_key_create,
    api_key_revoke,
    membership_remove,
    membership_set,
    team_choose,
    team_create,
)
from projects.services.tinker import (
    lora_of,
    tinker_checkpoint_forget,
    tinker_checkpoint_publish,
    tinker_checkpoint_record,
    tinker_drain_claim,
    tinker_drain_release,
    tinker_export_ttl,
    tinker_future_cancel,
    tinker_future_done,
    tinker_future_finish,
    tinker_future_submit,
    tinker_loss_add,
    tinker_model_create,
    tinker_model_found,
    tinker_model_lost,
    tinker_model_opened,
    tinker_names_expire,
    tinker_request_id,
    tinker_sampler_create,
    tinker_session_create,
    tinker_session_finish,
    tinker_session_heartbeat,
    tinker_step_record,
    tinker_weights_copy,
)
from projects.services.training_jobs import (
    ART_OPTIONS,
    TRAINING_JOB_TRANSITIONS,
    client_log_record,
    training_job_claim,
    training_job_create,
    training_job_fail,
    training_job_finish,
    training_job_heartbeat,
    training_job_started,
    training_job_transition,
    training_jobs_requeue_orphaned,
)

__all__ = [
    "training_job_from_completions",
    "training_schedule_from_completions",
    "completion_grading_create",
    "stored_completions_purge",
    "alias_canary",
    "alias_delete",
    "alias_promote",
    "alias_rollback",
    "alias_set",
    "task_set_from_completions",
    "feedback_add",
    "api_key_storage_set",
    "completion_storage_set",
    "conversation_tokens",
    "stored_completion_create",
    "stored_completion_delete",
    "stored_completion_update",
    "stored_completions_expire",
    "lora_of",
    "tinker_checkpoint_forget",
    "tinker_checkpoint_publish",
    "tinker_export_ttl",
    "tinker_checkpoint_record",
    "tinker_drain_claim",
    "tinker_drain_release",
    "tinker_future_cancel",
    "tinker_future_finish",
    "tinker_future_submit",
    "tinker_loss_add",
    "tinker_model_create",
    "tinker_model_found",
    "tinker_model_lost",
    "tinker_names_expire",
    "tinker_model_opened",
    "tinker_request_id",
    "tinker_sampler_create",
    "tinker_weights_copy",
    "tinker_future_done",
    "tinker_session_create",
    "tinker_session_finish",
    "tinker_session_heartbeat",
    "tinker_step_record",
    "runs_pause_interrupted",
    "client_run_end",
    "client_runs_close_idle",
    "ART_OPTIONS",
    "check_slug",
    "json_text_read",
    "jsonb_safe",
    "LAST_OWNER",
    "CreatedApiKey",
    "team_create",
    "membership_set",
    "membership_remove",
    "team_choose",
    "CreatedInvitation",
    "invitation_create",
    "invitation_check",
    "invitation_accept",
    "invitation_revoke",
    "api_key_create",
    "api_key_authenticate",
    "api_key_revoke",
    "project_create",
    "project_update",
    "project_delete",
    "base_model_register",
    "trainable_model_create",
    "trainable_model_update",
    "trainable_model_delete",
    "grader_problems",
    "reward_definition_create",
    "reward_definition_update",
    "reward_definition_delete",
    "parse_rows",
    "task_set_create",
    "task_set_delete",
    "task_set_rows_check",
    "environment_create",
    "environment_update",
    "environment_delete",
    "environment_build",
    "ACTIVE_STATUSES",
    "TERMINAL_STATUSES",
    "ALLOWED_TRANSITIONS",
    "run_event_add",
    "run_transition",
    "run_config_check",
    "run_create",
    "run_cancel",
    "run_claim",
    "run_heartbeat",
    "run_platform_inputs",
    "run_set_start_step",
    "run_fail",
    "run_pause",
    "run_pause_finish",
    "run_resume",
    "run_fork",
    "run_start_text",
    "model_adapter_import",
    "model_checkpoint_root",
    "START_FROM_LATEST",
    "START_FROM_BASE",
    "runs_requeue_orphaned",
    "TrajectoryRecord",
    "checkpoint_record",
    "PruneResult",
    "checkpoint_delete",
    "checkpoints_prune",
    "model_files_remove_on_commit",
    "retention_after_step",
    "run_checkpoints_settle",
    "retention_check",
    "export_create",
    "export_claim",
    "export_heartbeat",
    "export_finish",
    "export_fail",
    "export_key",
    "exports_requeue_orphaned",
    "step_record",
    "EVALUATION_SETTINGS",
    "EVALUATION_SPLITS",
    "EVALUATION_TERMINAL_STATUSES",
    "EVALUATION_TRANSITIONS",
    "evaluation_event_add",
    "evaluation_transition",
    "evaluation_create",
    "run_pass_threshold",
    "evaluation_claim",
    "evaluation_heartbeat",
    "evaluations_requeue_orphaned",
    "evaluation_finish",
    "evaluation_fail",
    "evaluation_cancel",
    "run_evaluation_record",
    "DEFAULT_JUDGE",
    "judge_endpoint_create",
    "judge_endpoint_update",
    "judge_client",
    "sandbox_config",
    "task_set_generate",
    "TRAINING_JOB_TRANSITIONS",
    "client_model_register",
    "client_model_delete",
    "platform_run_active",
    "training_job_active",
    "checkpoints_delete",
    "training_job_create",
    "training_job_transition",
    "training_job_claim",
    "training_job_heartbeat",
    "training_job_started",
    "training_job_finish",
    "training_job_fail",
    "training_jobs_requeue_orphaned",
    "client_log_record",
]
