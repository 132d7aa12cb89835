"""Reads. Every function takes the caller's team (or a row already read through it) and returns
only that team's rows, one module per subject; this package re-exports them all, so callers write
``selectors.run_get(...)``. ``_scoping.scoped`` is the one place a query is tied to a team.
"""

from __future__ import annotations

from projects.selectors._scoping import (
    scoped,
    scoped_reference,
)
from projects.selectors.checkpoints import (
    checkpoint_key,
    checkpoint_metric_values,
    checkpoint_storage_bytes,
    checkpoint_store,
    checkpoint_users,
    model_prefix,
    model_storage_bytes,
    project_storage_bytes,
)
from projects.selectors.costs import (
    Prices,
    cost_rows,
    rows_total,
    run_cost,
)
from projects.selectors.evaluations import (
    ModelChoice,
    checkpoint_evaluations,
    evaluation_get,
    evaluation_inputs_resolve,
    evaluation_is_active,
    evaluation_passes,
    evaluation_recent_events,
    evaluation_reference,
    evaluation_reference_label,
    evaluation_results_summary,
    evaluation_rows,
    evaluation_sample_row_indexes,
    evaluation_samples,
    evaluation_samples_of_rows,
    evaluations_list,
    model_id_resolve,
    model_label,
    run_evaluations,
    run_step_evaluated,
)
from projects.selectors.judges import (
    judge_endpoints,
)
from projects.selectors.rewards import (
    reward_definition_versions,
    reward_definitions_latest,
)
from projects.selectors.runs import (
    run_get,
    run_phase,
    run_recent_events,
    run_reward_range,
    run_signal_warnings,
    run_stop_reason,
    runs_search,
)
from projects.selectors.steps import (
    checkpoint_exists,
    checkpoint_latest,
    run_checkpoints,
    run_step_metrics,
    run_step_sample_means,
    run_task_row_items,
    run_trajectories,
    trajectory_group,
    trajectory_group_indexes,
    trajectory_group_indexes_with_variance,
    trajectory_steps,
)
from projects.selectors.task_sets import (
    task_set_rows,
)
from projects.selectors.teams import (
    api_keys,
    invitation_for_token,
    memberships_of,
    pending_invitations,
    team_members,
)
from projects.selectors.training_jobs import (
    client_run,
    model_checkpoints,
    training_job_events,
)

__all__ = [
    "checkpoint_key",
    "checkpoint_metric_values",
    "checkpoint_storage_bytes",
    "checkpoint_store",
    "checkpoint_users",
    "model_prefix",
    "model_storage_bytes",
    "project_storage_bytes",
    "scoped",
    "scoped_reference",
    "api_keys",
    "memberships_of",
    "team_members",
    "pending_invitations",
    "invitation_for_token",
    "run_get",
    "run_phase",
    "run_recent_events",
    "run_reward_range",
    "run_signal_warnings",
    "runs_search",
    "run_stop_reason",
    "run_step_metrics",
    "run_checkpoints",
    "run_trajectories",
    "trajectory_steps",
    "trajectory_group_indexes",
    "trajectory_group_indexes_with_variance",
    "run_step_sample_means",
    "run_task_row_items",
    "trajectory_group",
    "checkpoint_latest",
    "checkpoint_exists",
    "reward_definitions_latest",
    "reward_definition_versions",
    "task_set_rows",
    "judge_endpoints",
    "ModelChoice",
    "evaluations_list",
    "evaluation_get",
    "run_evaluations",
    "checkpoint_evaluations",
    "run_step_evaluated",
    "evaluation_is_active",
    "evaluation_passes",
    "evaluation_rows",
    "evaluation_samples",
    "evaluation_sample_row_indexes",
    "evaluation_samples_of_rows",
    "evaluation_recent_events",
    "model_id_resolve",
    "model_label",
    "evaluation_inputs_resolve",
    "evaluation_reference",
    "evaluation_reference_label",
    "evaluation_results_summary",
    "client_run",
    "model_checkpoints",
    "training_job_events",
    "Prices",
    "cost_rows",
    "rows_total",
    "run_cost",
]
