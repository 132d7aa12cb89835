"""The worker process's one SessionHost (training.hosting.resident): every kind of work this worker
does — platform runs, ART training jobs, Tinker training and sampling clients, fine-tuning jobs
(runs and ART jobs underneath) — opens its sessions through the object ``session_host`` returns,
and none asks which it got.

Which host it is follows training.hosting.placement's rule: the trainer service of this machine
when ``TRAINER_SERVICE_URL`` names one (its sessions share one copy of each base model), else this
process (``RESIDENT_SESSIONS`` client sessions on a pool; a run's own policy). The same rule then
says which runs may leave the worker (``service_refusal``: overlapped, data-parallel and vLLM runs
stay).
"""

from __future__ import annotations

import os
import socket

from django.conf import settings

from training.base_models import load_tokenizer
from training.hosting.client import TrainerServiceClient
from training.hosting.placement import SERVICE, place
from training.hosting.resident import ResidentSessions, ServiceSessions, SessionHost
from training.model_files import context_length as base_context_length
from training.session.policy import load_policy_model

# A step's rollouts sampled on the service are one call: on a CPU host a large batch may take many
# minutes, so the host's client waits up to an hour for an answer (a lost service is SessionLost).
SERVICE_TIMEOUT_S = 3600

_resident: ResidentSessions | None = None
_service: ServiceSessions | None = None


def session_host() -> SessionHost:
    """This worker's SessionHost (see the module docstring), built once per process and rebuilt
    when the settings name another trainer service."""
    global _resident, _service
    if place("client", service=bool(settings.TRAINER_SERVICE_URL)).host == SERVICE:
        if _service is None or _service.client.url != settings.TRAINER_SERVICE_URL.rstrip("/"):
            client = TrainerServiceClient(
                settings.TRAINER_SERVICE_URL,
                token=settings.TRAINER_SERVICE_TOKEN,
                timeout_s=SERVICE_TIMEOUT_S,
            )

            def tokenizer_of(source: str) -> tuple[object, int | None]:
                cache = settings.MODEL_CACHE_DIR
                return load_tokenizer(source, cache), base_context_length(source, cache)

            holder = f"{socket.gethostname()}:{os.getpid()}"
            _service = ServiceSessions(client, holder=holder, load_tokenizer=tokenizer_of)
        return _service
    if _resident is None:

        def load(source: str) -> tuple[object, object]:
            model, tokenizer, _ = load_policy_model(source, settings.MODEL_CACHE_DIR,
                                                    device=settings.TRAINING_DEVICE, unsloth=settings.TRAINING_UNSLOTH)  # fmt: skip
            return model, tokenizer

        _resident = ResidentSessions(load, capacity=settings.RESIDENT_SESSIONS,
                                     spill_dir=settings.DATA_DIR / "trainer-spill" / f"worker-{os.getpid()}",
                                     device=settings.TRAINING_DEVICE, model_cache_dir=settings.MODEL_CACHE_DIR,
                                     unsloth=settings.TRAINING_UNSLOTH)  # fmt: skip
    _resident.capacity = settings.RESIDENT_SESSIONS
    return _resident


def run_session_host() -> SessionHost | None:
    """The host a platform run opens its session through: this worker's (``session_host``), unless
    ``TRAINER_SERVICE_RUNS`` is off, which keeps runs in the worker (None) while client work still
    goes to the service."""
    if settings.TRAINER_SERVICE_URL and not settings.TRAINER_SERVICE_RUNS:
        return None
    return session_host()
