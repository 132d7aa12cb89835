"""``{{ model|storage_bytes|filesizeformat }}``: the disk a trainable model's checkpoints and
exports use in the checkpoint store (projects.selectors.model_storage_bytes), for the model and
project pages; ``project|project_storage_bytes`` sums a project's models."""

from __future__ import annotations

from django import template

from projects import selectors
from projects.models import Project, TrainableModel

register = template.Library()


@register.filter(name="storage_bytes")
def storage_bytes(model: TrainableModel) -> int:
    return selectors.model_storage_bytes(model=model)


@register.filter(name="project_storage_bytes")
def project_storage_bytes(project: Project) -> int:
    return selectors.project_storage_bytes(project=project)
