"""factory_boy factories for the domain objects.

Each factory creates its row through the service that owns it (``projects.services``), so a test
object is valid by the same rules as a user's and gets the same side rows (memberships, versions,
split task rows); ``build()`` is not offered for that reason. Defaults make a complete, unstarted
run's inputs in one project: ``RunFactory()`` alone builds team, project, model, task set,
environment and reward.
"""

from __future__ import annotations

from typing import Any

import factory
from django.contrib.auth import get_user_model

from projects import models, services
from tests.conftest import REWARD_SPEC


class _ServiceFactory(factory.django.DjangoModelFactory):
    """Creates through ``service(**kwargs)`` instead of ``Model.objects.create``."""

    class Meta:
        abstract = True

    @classmethod
    def service(cls, **kwargs: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def _create(cls, model_class: type, *args: Any, **kwargs: Any) -> Any:
        return cls.service(**kwargs)

    @classmethod
    def _build(cls, model_class: type, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{cls.__name__} creates through its service; use create()")


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("pw-test-123")


class TeamFactory(_ServiceFactory):
    class Meta:
        model = models.Team

    name = factory.Sequence(lambda n: f"team{n}")
    owner = factory.SubFactory(UserFactory)

    @classmethod
    def service(cls, **kwargs: Any) -> models.Team:
        return services.team_create(**kwargs)


class MembershipFactory(_ServiceFactory):
    class Meta:
        model = models.Membership

    team = factory.SubFactory(TeamFactory)
    user = factory.SubFactory(UserFactory)
    role = models.Role.MEMBER

    @classmethod
    def service(cls, **kwargs: Any) -> models.Membership:
        return services.membership_set(**kwargs)


class BaseModelFactory(_ServiceFactory):
    class Meta:
        model = models.BaseModel

    name = factory.Sequence(lambda n: f"base{n}")
    source = "/nonexistent/tiny"

    @classmethod
    def service(cls, **kwargs: Any) -> models.BaseModel:
        return services.base_model_register(**kwargs)


class ProjectFactory(_ServiceFactory):
    class Meta:
        model = models.Project

    team = factory.SubFactory(TeamFactory)
    name = factory.Sequence(lambda n: f"project{n}")

    @classmethod
    def service(cls, **kwargs: Any) -> models.Project:
        return services.project_create(**kwargs)


class TrainableModelFactory(_ServiceFactory):
    class Meta:
        model = models.TrainableModel

    project = factory.SubFactory(ProjectFactory)
    name = factory.Sequence(lambda n: f"model{n}")
    base_model = factory.SubFactory(BaseModelFactory)

    @classmethod
    def service(cls, **kwargs: Any) -> models.TrainableModel:
        return services.trainable_model_create(**kwargs)


class TaskSetFactory(_ServiceFactory):
    class Meta:
        model = models.TaskSet

    project = factory.SubFactory(ProjectFactory)
    name = factory.Sequence(lambda n: f"tasks{n}")
    rows = factory.LazyFunction(lambda: [{"prompt": f"q{i}", "item": {"answer": str(i)}} for i in range(6)])
    validation_fraction = 0.34

    @classmethod
    def service(cls, **kwargs: Any) -> models.TaskSet:
        return services.task_set_create(**kwargs)


class EnvironmentFactory(_ServiceFactory):
    class Meta:
        model = models.Environment

    project = factory.SubFactory(ProjectFactory)
    name = factory.Sequence(lambda n: f"env{n}")
    system_prompt = "Be brief."

    @classmethod
    def service(cls, **kwargs: Any) -> models.Environment:
        return services.environment_create(**kwargs)


class RewardDefinitionFactory(_ServiceFactory):
    class Meta:
        model = models.RewardDefinition

    project = factory.SubFactory(ProjectFactory)
    name = factory.Sequence(lambda n: f"reward{n}")
    spec = factory.LazyFunction(lambda: dict(REWARD_SPEC))

    @classmethod
    def service(cls, **kwargs: Any) -> models.RewardDefinition:
        return services.reward_definition_create(**kwargs)


class RunFactory(_ServiceFactory):
    """A queued run; its inputs share one project (the service refuses a mix)."""

    class Meta:
        model = models.Run

    model = factory.SubFactory(TrainableModelFactory)
    task_set = factory.SubFactory(TaskSetFactory, project=factory.SelfAttribute("..model.project"))
    environment = factory.SubFactory(EnvironmentFactory, project=factory.SelfAttribute("..model.project"))
    reward = factory.SubFactory(RewardDefinitionFactory, project=factory.SelfAttribute("..model.project"))
    config = factory.LazyFunction(lambda: {"steps": 2})
    created_by = None

    @classmethod
    def service(cls, **kwargs: Any) -> models.Run:
        return services.run_create(**kwargs)


class CheckpointFactory(_ServiceFactory):
    class Meta:
        model = models.Checkpoint

    model = factory.SubFactory(TrainableModelFactory)
    run = None
    step = factory.Sequence(lambda n: n)
    path = factory.LazyAttribute(lambda checkpoint: f"/nowhere/step-{checkpoint.step}")

    @classmethod
    def service(cls, **kwargs: Any) -> models.Checkpoint:
        return services.checkpoint_record(**kwargs)


class ApiKeyFactory(_ServiceFactory):
    """``create()`` returns the row; the plaintext is on ``.plaintext`` (shown once, as in the API)."""

    class Meta:
        model = models.ApiKey

    team = factory.SubFactory(TeamFactory)
    name = factory.Sequence(lambda n: f"key{n}")
    read_only = False

    @classmethod
    def service(cls, **kwargs: Any) -> models.ApiKey:
        created = services.api_key_create(**kwargs)
        created.api_key.plaintext = created.plaintext
        return created.api_key
