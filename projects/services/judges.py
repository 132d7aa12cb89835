"""Team judge endpoints (writes, and the one read that decrypts the key for graders) and the
operator's sandbox limits for python graders."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.views.decorators.debug import sensitive_variables

from projects import secrets
from projects.environment_config import sandbox_slots
from projects.errors import ValidationFailed
from projects.models import JudgeEndpoint, Team
from projects.outbound import outbound_policy, outbound_url_checked
from projects.services._common import check_slug, check_text_length, create_unique
from training.rewards import GradingError, JudgeClient, SandboxConfig

DEFAULT_JUDGE = "default"
API_KEY_MAX_CHARS = 4_096  # a judge endpoint's API key: provider keys are tens to hundreds of characters


def _validate(name: str, base_url: str, timeout_s: float) -> str:
    """The checked ``base_url`` as it is stored and called (an internationalised host IDNA-encoded)."""
    from django.core.exceptions import ValidationError
    from django.core.validators import URLValidator

    check_slug(name, "name")
    max_length = JudgeEndpoint._meta.get_field("base_url").max_length
    # Internal addresses refused with the reason; a non-ASCII host stored as the IDNA name it calls.
    base_url = outbound_url_checked(base_url, field="base_url", max_length=max_length)
    try:
        URLValidator(schemes=["http", "https"])(base_url)
    except ValidationError as exc:
        raise ValidationFailed(
            "must be an http(s) URL ending before /chat/completions", field="base_url"
        ) from exc
    secrets.url_credentials_refused(base_url, field="base_url")
    if not 0 < timeout_s <= 600:
        raise ValidationFailed("must be in (0, 600] seconds", field="timeout_s")
    return base_url


def judge_endpoint_create(
    *,
    team: Team,
    name: str,
    base_url: str,
    api_key: str = "",
    default_model: str = "",
    timeout_s: float = 60.0,
) -> JudgeEndpoint:
    base_url = _validate(name, base_url, timeout_s)
    check_text_length(api_key, field="api_key", max_chars=API_KEY_MAX_CHARS)
    return create_unique(
        lambda: JudgeEndpoint.objects.create(
            team=team,
            name=name,
            base_url=base_url,
            api_key_encrypted=secrets.encrypt(api_key),
            default_model=default_model,
            timeout_s=timeout_s,
        ),
        field="name",
        message=f"a judge endpoint named {name!r} already exists",
    )


def judge_endpoint_update(*, endpoint: JudgeEndpoint, **changes: Any) -> JudgeEndpoint:
    name = changes.get("name", endpoint.name)
    base_url = changes.get("base_url", endpoint.base_url)
    timeout_s = changes.get("timeout_s", endpoint.timeout_s)
    base_url = _validate(name, base_url, timeout_s)  # compared in the form it is stored
    secrets.secret_follows_url(
        stored_url=endpoint.base_url,
        url=base_url,
        has_stored_secret=bool(endpoint.api_key_encrypted),
        secret_given="api_key" in changes,
        url_field="base_url",
        secret_field="api_key",
    )
    endpoint.name, endpoint.base_url, endpoint.timeout_s = name, base_url, timeout_s
    if "default_model" in changes:
        endpoint.default_model = changes["default_model"]
    if "api_key" in changes:
        check_text_length(changes["api_key"], field="api_key", max_chars=API_KEY_MAX_CHARS)
        endpoint.api_key_encrypted = secrets.encrypt(changes["api_key"])
    # A rename onto another endpoint's name is a 400 on name, not an IntegrityError.
    create_unique(endpoint.save, field="name", message=f"a judge endpoint named {name!r} already exists")
    return endpoint


def judge_client(*, team: Team, name: str | None = None) -> JudgeClient | None:
    """The JudgeClient for the team's endpoint ``name`` (default: the one named "default");
    None when the team has none. Raises ValidationFailed for an unknown explicit name."""
    endpoint = JudgeEndpoint.objects.filter(team=team, name=name or DEFAULT_JUDGE).first()
    if endpoint is None:
        if name:
            raise ValidationFailed(f"no judge endpoint named {name!r} in your team", field="judge_endpoint")
        return None
    return _client_of(endpoint)


@sensitive_variables("settings_of_endpoint")  # the decrypted key
def _client_of(endpoint: JudgeEndpoint, **overrides: Any) -> JudgeClient:
    settings_of_endpoint: dict[str, Any] = {
        "base_url": endpoint.base_url,
        "api_key": secrets.decrypt(endpoint.api_key_encrypted),
        "model": endpoint.default_model or None,
        "timeout": endpoint.timeout_s,
        "outbound": outbound_policy(),
    }
    return JudgeClient(**{**settings_of_endpoint, **overrides})


@dataclass(frozen=True)
class JudgeEndpointCheck:
    """What "Test connection" found: ``ok`` with the round trip's latency and the reply's start,
    or the error (which, as every judge error, names no key, header or URL)."""

    ok: bool
    latency_ms: int
    model: str
    detail: str


CHECK_MESSAGES = [{"role": "user", "content": "Reply with the word OK."}]


def judge_endpoint_test(*, endpoint: JudgeEndpoint, model: str = "") -> JudgeEndpointCheck:
    """One short chat completion through the client the graders use (the outbound policy, the
    stored key, the endpoint's timeout), without retries: the answer is about this attempt."""
    model = model or endpoint.default_model
    if not model:
        raise ValidationFailed("the endpoint has no default model: name one to test with", field="model")
    client = _client_of(endpoint, retries=0, model=model)  # the model asked for, not the default
    started = time.monotonic()
    try:
        reply = client.complete(model=model, messages=CHECK_MESSAGES, sampling_params={"max_tokens": 8})
    except GradingError as error:
        latency = round((time.monotonic() - started) * 1000)
        return JudgeEndpointCheck(ok=False, latency_ms=latency, model=model, detail=error.detail)
    latency = round((time.monotonic() - started) * 1000)
    text = (reply.content or reply.refusal or "").strip()
    return JudgeEndpointCheck(ok=True, latency_ms=latency, model=reply.sampled_model_name, detail=text[:200])


def sandbox_config(*, team_id: Any = None, interactive: bool = False) -> SandboxConfig:
    """The operator's limits for python graders (settings, from the environment), taking a slot of
    `team_id`'s; a web request (`interactive`) waits only briefly for one (SlotsBusy: a 429). It
    carries the regex grader's match timeout too."""
    return SandboxConfig(
        regex_timeout_seconds=settings.GRADER_REGEX_TIMEOUT_S,
        timeout_seconds=settings.GRADER_SANDBOX_TIMEOUT_S,
        cpu_seconds=settings.GRADER_SANDBOX_CPU_S,
        memory_bytes=settings.GRADER_SANDBOX_MEMORY_MB * 1024 * 1024,
        allow_unsandboxed=settings.GRADER_SANDBOX_ALLOW_UNSANDBOXED,
        slots=sandbox_slots(interactive=interactive),
        team=str(team_id or ""),
    )
