"""SSRF through the API: every outbound path (judge-endpoint and mcp-environment writes, the judge
behind POST /api/v1/graders/run, scenario generation, an MCP server over HTTP, a remote evaluation
reference) refuses every internal address form against a local listener, a DNS name that rebinds to
loopback between the input check and the call included; an allow-listed host works. The autouse
fixture in tests/conftest.py allow-lists loopback; these tests empty OUTBOUND_ALLOW again."""

from __future__ import annotations

import json

import pytest

from projects import services
from projects.jobs.evaluations import _reference_policy
from projects.services import judges
from tests.conftest import error_of
from tests.listener import FakeDNS, chat_completion, listening
from training.engines.base import SamplingParams
from training.environments import EnvironmentSpec

pytestmark = pytest.mark.django_db

SCORE = {
    "type": "score_model",
    "model": "judge-model",
    "input": [{"role": "user", "content": "Score 0..1: {{sample.output_text}}"}],
    "range": [0, 1],
}
# Forms of 127.0.0.1 (and other internal addresses) a team might try; {port} is the listener's.
FORMS = [
    "http://127.0.0.1:{port}/v1",
    "http://2130706433:{port}/v1",  # decimal
    "http://0x7f000001:{port}/v1",  # hex
    "http://0x7f.1:{port}/v1",  # hex, short
    "http://0177.0.0.1:{port}/v1",  # octal
    "http://127.1:{port}/v1",  # short
    "http://[::ffff:127.0.0.1]:{port}/v1",  # IPv6-mapped
    "http://[::1]:{port}/v1",
    "http://localhost:{port}/v1",
    "http://loopback.test:{port}/v1",  # a DNS name resolving to loopback (FakeDNS)
    "http://0.0.0.0:{port}/v1",
    "http://169.254.169.254/latest/meta-data",
    "http://[fe80::1]/v1",
    "http://10.0.0.8/v1",
    "http://metadata.google.internal/computeMetadata/v1",
]


@pytest.fixture
def dns(monkeypatch) -> FakeDNS:
    fake = FakeDNS(monkeypatch)
    fake.add("loopback.test", "127.0.0.1")
    fake.add("rebind.test", "93.184.216.34", "127.0.0.1")  # public at input, loopback when called
    return fake


@pytest.fixture
def public_only(settings):
    settings.OUTBOUND_ALLOW = ()


@pytest.mark.parametrize("form", FORMS)
def test_a_judge_endpoint_on_an_internal_address_is_400_on_base_url(form, alice_client, public_only, dns):
    url = form.format(port=8000)
    created = alice_client.post("/api/v1/judge-endpoints/", {"name": "j", "base_url": url}, format="json")
    assert created.status_code == 400, created.json()
    error = error_of(created)
    assert error["param"] == "base_url"
    assert any(
        word in error["message"] for word in ("loopback", "unspecified", "link-local", "private", "metadata")
    )


@pytest.mark.parametrize(
    ("url", "entry"),
    [
        ("http://127.0.0.1:8000/v1", "127.0.0.1:8000"),
        ("http://localhost:9/v1", "localhost:9"),
        ("http://[::1]:8000/v1", "[::1]:8000"),
        ("http://[::ffff:127.0.0.1]:8000/v1", "127.0.0.1:8000"),
        ("http://loopback.test:8000/v1", "loopback.test:8000"),
        ("http://10.0.0.8/v1", "10.0.0.8:80"),
    ],
)
def test_an_internal_address_refusal_names_the_outbound_allow_entry_that_admits_it(
    url, entry, alice_client, settings, public_only, dns
):
    refused = alice_client.post("/api/v1/judge-endpoints/", {"name": "j", "base_url": url}, format="json")
    assert refused.status_code == 400
    message = error_of(refused)["message"]
    assert f"adding {entry} to the OUTBOUND_ALLOW setting" in message, message
    # The entry it names is one that works.
    settings.OUTBOUND_ALLOW = (entry,)
    allowed = alice_client.post("/api/v1/judge-endpoints/", {"name": "j", "base_url": url}, format="json")
    assert allowed.status_code == 201, allowed.json()


@pytest.mark.parametrize(
    "url", ["http://169.254.169.254/latest/meta-data", "http://metadata.google.internal/v1"]
)
def test_a_cloud_metadata_refusal_suggests_no_allow_list_entry(url, alice_client, public_only, dns):
    refused = alice_client.post("/api/v1/judge-endpoints/", {"name": "j", "base_url": url}, format="json")
    assert refused.status_code == 400
    assert "OUTBOUND_ALLOW" not in error_of(refused)["message"]


def test_a_judge_endpoint_patched_to_an_internal_address_is_400(alice_client, cast, public_only, dns):
    endpoint = judges.judge_endpoint_create(team=cast.alpha, name="j", base_url="https://judge.invalid/v1")
    for form in FORMS:
        patched = alice_client.patch(
            f"/api/v1/judge-endpoints/{endpoint.pk}/",
            {"base_url": form.format(port=8000), "api_key": ""},
            format="json",
        )
        assert patched.status_code == 400 and error_of(patched)["param"] == "base_url", (form, patched.json())
    endpoint.refresh_from_db()
    assert endpoint.base_url == "https://judge.invalid/v1"


def test_an_allow_listed_host_can_be_configured(alice_client, settings, dns):
    settings.OUTBOUND_ALLOW = ("loopback.test", "10.0.0.0/8")
    for url in ("http://loopback.test:8000/v1", "http://10.0.0.8/v1"):
        response = alice_client.post(
            "/api/v1/judge-endpoints/", {"name": f"j{len(url)}", "base_url": url}, format="json"
        )
        assert response.status_code == 201, response.json()


def _mcp(client, project, url, name="tools"):
    return client.post(
        "/api/v1/environments/",
        {"project": project, "name": name, "kind": "mcp", "config": {"url": url}},
        format="json",
    )


@pytest.mark.parametrize("form", FORMS)
def test_an_mcp_environment_on_an_internal_address_is_400_on_config_url(
    form, alice_client, alpha_setup, public_only, dns
):
    created = _mcp(alice_client, alpha_setup.project.pk, form.format(port=8000).replace("/v1", "/mcp"))
    assert created.status_code == 400 and error_of(created)["param"] == "config.url", created.json()


def test_an_mcp_environment_patched_to_an_internal_address_is_400(
    alice_client, alpha_setup, public_only, dns
):
    created = _mcp(alice_client, alpha_setup.project.pk, "https://mcp.invalid/mcp")
    assert created.status_code == 201, created.json()
    for form in FORMS:
        patched = alice_client.patch(
            f"/api/v1/environments/{created.json()['id']}/",
            {"config": {"url": form.format(port=8000)}},
            format="json",
        )
        assert patched.status_code == 400 and error_of(patched)["param"] == "config.url", (
            form,
            patched.json(),
        )


def test_the_judge_behind_graders_run_is_refused_at_connect(alice_client, cast, settings, dns):
    with listening() as listener:
        listener.body = chat_completion("0.75")
        judges.judge_endpoint_create(  # stored while loopback was allowed (or before this policy)
            team=cast.alpha, name="default", base_url=listener.url + "/v1", api_key="sk-judge-secret"
        )
        settings.OUTBOUND_ALLOW = ()
        body = {"grader": SCORE, "model_sample": "hi"}
        refused = alice_client.post("/api/v1/graders/run", body, format="json").json()
        text = json.dumps(refused)
        assert refused["reward"] == 0.0 and refused["metadata"]["errors"]["model_grader_server_error"]
        assert "refused by the outbound policy" in text and "loopback" in text
        assert "sk-judge-secret" not in text
        assert listener.connections == 0
        settings.OUTBOUND_ALLOW = ("127.0.0.1",)
        allowed = alice_client.post("/api/v1/graders/run", body, format="json").json()
        assert allowed["reward"] == pytest.approx(0.75) and listener.connections == 1


def test_a_judge_name_that_rebinds_to_loopback_after_input_is_refused(alice_client, cast, public_only, dns):
    with listening() as listener:
        created = alice_client.post(
            "/api/v1/judge-endpoints/",
            {"name": "default", "base_url": f"http://rebind.test:{listener.port}/v1", "api_key": "sk-x"},
            format="json",
        )
        assert created.status_code == 201, created.json()  # rebind.test was public when checked
        result = alice_client.post(
            "/api/v1/graders/run", {"grader": SCORE, "model_sample": "hi"}, format="json"
        ).json()
        assert "rebind.test resolves to a loopback address" in json.dumps(result)
        assert listener.connections == 0


def test_scenario_generation_to_an_internal_address_is_refused(
    alice_client, cast, alpha_setup, settings, dns
):
    with listening() as listener:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="writer", base_url=listener.url + "/v1", default_model="writer-model"
        )
        settings.OUTBOUND_ALLOW = ()
        body = {
            "project": alpha_setup.project.id,
            "environment": alpha_setup.environment.id,
            "endpoint": endpoint.id,
            "n": 2,
            "instruction": "single-word answers",
            "name": "generated",
        }
        response = alice_client.post("/api/v1/task-sets/generate", body, format="json")
        assert response.status_code == 400
        error = error_of(response)
        assert error["param"] == "endpoint" and "refused by the outbound policy" in error["message"]
        assert listener.connections == 0
        settings.OUTBOUND_ALLOW = ("127.0.0.1",)
        listener.body = chat_completion(
            json.dumps(
                [{"prompt": "one", "item": {"answer": "a"}}, {"prompt": "two", "item": {"answer": "b"}}]
            )
        )
        generated = alice_client.post("/api/v1/task-sets/generate", body, format="json")
        assert generated.status_code == 201, generated.json()


def test_an_mcp_server_that_rebinds_to_loopback_is_refused_when_the_environment_opens(
    alpha_setup, public_only, dns
):
    with listening() as listener:
        environment = services.environment_create(
            project=alpha_setup.project,
            name="tools",
            kind="mcp",
            config={"url": f"http://rebind.test:{listener.port}/mcp", "connect_timeout_s": 5},
        )
        built = services.environment_build(environment=environment)
        with pytest.raises(RuntimeError, match="rebind.test resolves to a loopback address"):
            built.open()
        assert listener.connections == 0


def test_a_remote_evaluation_reference_on_an_internal_address_is_refused(cast, alpha_setup, settings, dns):
    with listening() as listener:
        listener.status = 500
        listener.body = "<html>internal admin page</html>"
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha,
            name="ref",
            base_url=listener.url + "/v1",
            api_key="sk-ref",
            default_model="gpt-x",
        )
        evaluation = services.evaluation_create(
            task_set=alpha_setup.task_set,
            environment=alpha_setup.environment,
            reward=alpha_setup.reward,
            base_model=alpha_setup.base,
            reference_endpoint=endpoint,
            reference_model="gpt-x",
        )
        row = {"prompt": "q0", "item": {"answer": "0"}}
        settings.OUTBOUND_ALLOW = ()
        reference = _reference_policy(evaluation, SamplingParams(max_new_tokens=4))
        refused = reference.episode(row, EnvironmentSpec())
        assert "refused by the outbound policy" in refused.metrics["policy_error"]
        assert listener.connections == 0
        settings.OUTBOUND_ALLOW = ("127.0.0.1",)
        reference = _reference_policy(evaluation, SamplingParams(max_new_tokens=4))
        failed = reference.episode(row, EnvironmentSpec())  # reached: the body is not echoed
        assert failed.metrics["policy_error"] == "endpoint answered HTTP 500: Internal Server Error"
        assert listener.connections == 2  # a 500 is retried once
