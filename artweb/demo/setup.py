"""Create (or reuse) the demo team, user, key, project and inputs, then start a demo run."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.db import transaction

from artweb.demo import REWARD_SPEC, SYSTEM_PROMPT, TASKS_PATH
from projects import services
from projects.defaults import RUN_CONFIG
from projects.models import Environment, Project, RewardDefinition, Run, TaskSet, Team, TrainableModel
from training.model_files import BUNDLED_MODEL

DEMO_TEAM = "demo"
DEMO_USER = "demo"
DEMO_INPUTS = "one-word-answers"  # the task set's and the environment's name
DEMO_REWARD = "correct-and-exact"


@dataclass
class DemoSetup:
    team: Team
    run: Run
    api_key: str | None  # plaintext, only when created now
    password: str | None  # only when the user was created now


def demo_start(
    *, steps: int, base_model_source: str = BUNDLED_MODEL, config: dict[str, Any] | None = None
) -> DemoSetup:
    User = get_user_model()
    password = api_key = None
    with transaction.atomic():
        team = Team.objects.filter(name=DEMO_TEAM).first()
        user = User.objects.filter(username=DEMO_USER).first()
        if user is None:
            password = secrets.token_urlsafe(12)
            user = User.objects.create_user(username=DEMO_USER, password=password)
        if team is None:
            team = services.team_create(name=DEMO_TEAM, owner=user)
            api_key = services.api_key_create(team=team, name="demo key", created_by=user).plaintext
        base_name = "smollm2-135m-instruct" if base_model_source == BUNDLED_MODEL else "demo-local-model"
        base = services.base_model_register(name=base_name, source=base_model_source)
        project = Project.objects.filter(team=team, name="demo").first() or services.project_create(
            team=team, name="demo", description="The demo run started by `make up` / `manage.py demo`."
        )
        # Named for this version of the demo: a data dir from an earlier demo (its "short-answers"
        # rows and "brief-and-correct" reward) gets the new inputs, not its old ones.
        task_set = TaskSet.objects.filter(project=project, name=DEMO_INPUTS).first() or (
            services.task_set_create(project=project, name=DEMO_INPUTS, jsonl=TASKS_PATH.read_text())
        )
        environment = Environment.objects.filter(project=project, name=DEMO_INPUTS).first() or (
            services.environment_create(project=project, name=DEMO_INPUTS, system_prompt=SYSTEM_PROMPT)
        )
        reward = _demo_reward(project)
        # A fresh model per demo run, so an earlier demo's run never blocks this one.
        number = TrainableModel.objects.filter(project=project).count() + 1
        while TrainableModel.objects.filter(project=project, name=f"agent-{number}").exists():
            number += 1
        model = services.trainable_model_create(project=project, name=f"agent-{number}", base_model=base)
        merged = {**RUN_CONFIG, **(config or {}), "steps": steps}
        if "length_penalty_buffer" not in (config or {}):  # at most the reply budget, if that is smaller
            merged["length_penalty_buffer"] = min(merged["length_penalty_buffer"], merged["max_new_tokens"])
        run = services.run_create(
            model=model, task_set=task_set, environment=environment, reward=reward, config=merged
        )
    return DemoSetup(team=team, run=run, api_key=api_key, password=password)


def _demo_reward(project: Project) -> RewardDefinition:
    """The demo reward's newest version, or a new version when this release's demo reward differs
    (a data dir from an earlier release keeps its old versions; its next demo run grades as this
    release's README says)."""
    latest = RewardDefinition.objects.filter(project=project, name=DEMO_REWARD).order_by("-version").first()
    if latest is None:
        return services.reward_definition_create(project=project, name=DEMO_REWARD, spec=REWARD_SPEC)
    if latest.spec != services.grader_problems(REWARD_SPEC, field="spec"):
        return services.reward_definition_update(definition=latest, spec=REWARD_SPEC)
    return latest
