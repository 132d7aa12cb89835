"""Write-only MCP headers on the worker side (a run's spec gets them decrypted) and for rows stored
before header values were encrypted (still masked, still usable, encrypted on their next change)."""

from __future__ import annotations

import json

from projects import environment_config, services
from projects.models import Environment

URL = "http://mcp.internal:8000/mcp"


def test_a_runs_environment_gets_the_decrypted_headers(alpha_setup):
    from projects.jobs.runs import build_run_spec

    environment = services.environment_create(
        project=alpha_setup.project,
        name="shop",
        kind="mcp",
        config={"url": URL, "headers": {"Authorization": "Bearer abc"}},
    )
    assert "Bearer abc" not in json.dumps(Environment.objects.get(pk=environment.pk).config)
    run = services.run_create(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=environment,
        reward=alpha_setup.reward,
    )
    spec = build_run_spec(run)
    try:
        assert spec.environment.config == {"url": URL, "headers": {"Authorization": "Bearer abc"}}
    finally:
        spec.environment.close()


def test_plaintext_headers_stored_earlier_are_masked_kept_and_encrypted_on_change(alpha_setup):
    environment = services.environment_create(
        project=alpha_setup.project, name="shop", kind="mcp", config={"url": URL}
    )
    Environment.objects.filter(pk=environment.pk).update(
        config={"url": URL, "headers": {"Authorization": "legacy-plain-value"}}
    )
    environment.refresh_from_db()
    assert environment_config.config_public(environment.config) == {
        "url": URL,
        "headers": {"Authorization": "********"},
    }
    assert environment_config.config_for_build(environment.config)["headers"] == {
        "Authorization": "legacy-plain-value"
    }
    services.environment_update(environment=environment, system_prompt="Use the tools.")
    environment.refresh_from_db()
    assert "legacy-plain-value" not in json.dumps(environment.config) and "headers" not in environment.config
    assert environment_config.config_for_build(environment.config)["headers"] == {
        "Authorization": "legacy-plain-value"
    }


def test_the_allow_list_is_the_setting(settings):
    settings.MCP_STDIO_PROGRAMS = ("/opt/mcp/bin/warehouse",)
    assert environment_config.mcp_allowed_programs() == ("/opt/mcp/bin/warehouse",)
