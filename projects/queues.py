"""Celery queue names, in one place (STYLE.md: queue named from one enum)."""

from enum import StrEnum


class Queue(StrEnum):
    TRAIN = "train"
    DEFAULT = "default"
