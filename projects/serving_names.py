"""Adapter names no one can guess: the secret suffix of the names a checkpoint's LoRA adapter is
loaded under on an inference server (the gateway's ``model-<id>-step-<step>-<suffix>``,
projects.gateway.vllm; a run's and a Tinker sampler's own, projects.jobs), an HMAC under the
installation's INFERENCE_ADAPTER_NAME_KEY. Whoever reaches a server cannot name another team's
adapter from its id and step.
"""

from __future__ import annotations

import hmac

from django.conf import settings


def secret_suffix(identity: str) -> str:
    """16 hex characters no one without the installation's SECRET_KEY can compute for ``identity``."""
    key = settings.INFERENCE_ADAPTER_NAME_KEY.encode()
    return hmac.new(key, identity.encode(), "sha256").hexdigest()[:16]
