"""The ASGI entry point (uvicorn): ``/v1/`` (the OpenAI-compatible gateway) is served without
Django's middleware, everything else with the full stack; why, and what ``/v1/`` gives up, is in
``projects/gateway/asgi.py``."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "artweb.settings")

from projects.gateway import asgi as entry  # noqa: E402  (needs the settings module set)

application = entry.application
