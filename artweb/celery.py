"""The Celery application. Queues are named from one enum in projects.queues."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "artweb.settings")

app = Celery("artweb")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["projects.jobs"])  # projects/jobs/tasks.py
