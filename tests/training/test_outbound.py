"""The outbound-URL policy (training.safety.outbound): every forbidden address form refused with its reason,
the operator's allow-list, connections pinned to the checked address (urllib and httpx, no
DNS-rebinding window), and upstream error bodies summarised, never echoed."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request

import pytest

from tests.listener import FakeDNS, listening
from training.environments import build_environment
from training.rewards import GradingError, JudgeClient
from training.rollouts.remote import ChatEndpoint, EndpointError
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy, OutboundRefused, redact, upstream_reason

# Every form of an internal address a URL can take, and the reason the policy gives.
FORBIDDEN = {
    "http://127.0.0.1/v1": "loopback",
    "http://2130706433/v1": "loopback",  # decimal
    "http://0x7f000001/v1": "loopback",  # hex
    "http://0x7f.1/v1": "loopback",  # hex, short
    "http://0177.0.0.1/v1": "loopback",  # octal
    "http://127.1/v1": "loopback",  # short
    "http://[::1]/v1": "loopback",
    "http://[::ffff:127.0.0.1]/v1": "loopback",  # IPv4-mapped IPv6
    "http://[::ffff:7f00:1]/v1": "loopback",
    "http://[::ffff:169.254.169.254]/": "link-local",
    "http://[64:ff9b::7f00:1]/v1": "loopback",  # NAT64
    "http://[2002:7f00:1::]/v1": "loopback",  # 6to4
    "http://[::127.0.0.1]/v1": "reserved",  # IPv4-compatible IPv6
    "http://0/v1": "unspecified",
    "http://0.0.0.0:8000/v1": "unspecified",
    "http://[::]/v1": "unspecified",
    "http://169.254.169.254/latest/meta-data/": "cloud metadata",
    "http://[fe80::1]/v1": "link-local",
    "http://10.1.2.3/v1": "private",
    "http://172.16.0.1/v1": "private",
    "http://192.168.0.1/v1": "private",
    "http://100.64.0.1/v1": "carrier-grade NAT",
    "http://[fc00::1]/v1": "unique-local",
    "http://[fd12:3456::1]/v1": "unique-local",
    "http://224.0.0.1/v1": "multicast",
    "http://[ff02::1]/v1": "multicast",
    "http://240.0.0.1/v1": "reserved",
    "http://metadata.google.internal/computeMetadata/v1/": "cloud metadata",
    "http://metadata.google.internal./computeMetadata/v1/": "cloud metadata",  # trailing dot
    "http://METADATA.Google.Internal/": "cloud metadata",
    "http://localhost:8000/v1": "loopback",
    "http://app.localhost/v1": "loopback",
}


@pytest.mark.parametrize(("url", "reason"), list(FORBIDDEN.items()))
def test_every_internal_address_form_is_refused_with_its_reason(url, reason):
    with pytest.raises(OutboundRefused, match=reason):
        PUBLIC_ONLY.check_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://8.8.8.8/v1",
        "http://[2606:4700:4700::1111]:8443/v1",
        "http://[::ffff:8.8.8.8]/v1",  # IPv4-mapped public
        "http://[64:ff9b::808:808]/v1",  # a DNS64 network's name for a public IPv4 host
        "https://judge.invalid/v1",  # does not resolve now: checked again at connect
    ],
)
def test_public_addresses_and_unresolved_names_pass(url):
    target = PUBLIC_ONLY.check_url(url)
    assert target.scheme in ("http", "https") and target.port in (80, 443, 8443)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://8.8.8.8/", "http:// or https://"),
        ("file:///etc/passwd", "http:// or https://"),
        ("gopher://8.8.8.8:70/", "http:// or https://"),
        ("http://8.8.8.8:99999/", "valid host and port"),
        ("http://8.8.8.8:0/", "port"),
        ("http:///v1", "no host"),
        ("not a url", "http:// or https://"),
        ("http://127.0.0.1\x00.evil.example/", "not a valid name"),
        ("http://" + "a" * 64 + ".example/", "not a valid name"),
    ],
)
def test_only_http_urls_with_a_host_and_port(url, reason):
    with pytest.raises(OutboundRefused, match=reason):
        PUBLIC_ONLY.check_url(url)


def test_a_name_resolving_to_an_internal_address_is_refused(monkeypatch):
    dns = FakeDNS(monkeypatch)
    dns.add("judge.internal.test", "10.0.0.5")
    dns.add("mixed.test", ["93.184.216.34", "127.0.0.1"])  # one internal answer is enough
    dns.add("public.test", "93.184.216.34")
    with pytest.raises(OutboundRefused, match="judge.internal.test resolves to a private address"):
        PUBLIC_ONLY.check_url("https://judge.internal.test/v1")
    with pytest.raises(OutboundRefused, match="loopback"):
        PUBLIC_ONLY.check_url("https://mixed.test/v1")
    assert PUBLIC_ONLY.check_url("https://public.test/v1").addresses == ("93.184.216.34",)


def test_the_operator_allow_list_takes_hosts_addresses_networks_and_ports(monkeypatch):
    dns = FakeDNS(monkeypatch)
    dns.add("judge.corp.test", "10.20.0.7")
    dns.add("other.corp.test", "10.30.0.1")
    policy = OutboundPolicy(allow=("judge.corp.test", "192.168.0.0/16", "127.0.0.1:8000", "[::1]:9000"))
    assert policy.check_url("http://judge.corp.test/v1").addresses == ("10.20.0.7",)
    assert policy.check_url("http://192.168.3.4/v1").host == "192.168.3.4"
    assert policy.check_url("http://127.0.0.1:8000/v1").port == 8000
    assert policy.check_url("http://2130706433:8000/v1").addresses == ("127.0.0.1",)  # same address
    assert policy.check_url("http://[::ffff:127.0.0.1]:8000/v1")  # the IPv4 address it stands for
    assert policy.check_url("http://[::1]:9000/v1")
    for refused in (
        "http://127.0.0.1:6379/",
        "http://other.corp.test/",
        "http://[::1]:8000/",
        "http://10.0.0.1/",
    ):
        with pytest.raises(OutboundRefused):
            policy.check_url(refused)
    network = OutboundPolicy(allow=("10.0.0.0/8",))
    assert network.check_url("http://other.corp.test/").addresses == ("10.30.0.1",)


@pytest.mark.parametrize("entry", ["not a host", "10.0.0.0/33", "host:99999", "http://x/", "[::1"])
def test_a_bad_allow_list_entry_is_an_error(entry):
    with pytest.raises(ValueError, match="allow-list entry"):
        OutboundPolicy(allow=(entry,))


def _post(policy: OutboundPolicy, url: str) -> int:
    request = urllib.request.Request(url, data=b"{}", method="POST")
    with policy.opener().open(request, timeout=5) as response:
        return response.status


def test_a_refused_address_is_never_connected_to_and_an_allowed_one_is():
    with listening() as listener:
        with pytest.raises(OutboundRefused, match="loopback"):
            _post(PUBLIC_ONLY, listener.url + "/v1/chat/completions")
        assert listener.connections == 0
        assert _post(OutboundPolicy(allow=("127.0.0.1",)), listener.url + "/v1/chat/completions") == 200
        assert listener.connections == 1


def test_ipv6_loopback_is_refused_and_reached_when_allowed():
    with listening(socket.AF_INET6) as listener:
        url = f"http://[::1]:{listener.port}/"
        with pytest.raises(OutboundRefused):
            _post(PUBLIC_ONLY, url)
        assert _post(OutboundPolicy(allow=("::1",)), url) == 200
        assert listener.connections == 1


def test_a_name_that_rebinds_to_loopback_after_the_check_is_refused_at_connect(monkeypatch):
    dns = FakeDNS(monkeypatch)
    dns.add("rebind.test", "93.184.216.34", "127.0.0.1")  # public when checked, loopback after
    with listening() as listener:
        url = f"http://rebind.test:{listener.port}/v1"
        assert PUBLIC_ONLY.check_url(url).addresses == ("93.184.216.34",)  # the input check passes
        with pytest.raises(OutboundRefused, match="rebind.test resolves to a loopback address"):
            _post(PUBLIC_ONLY, url + "/chat/completions")
        judge = JudgeClient(base_url=url, api_key="sk-secret", retries=2, retry_backoff=0.01)
        with pytest.raises(GradingError, match="refused by the outbound policy") as refused:
            judge.complete(model="m", messages=[{"role": "user", "content": "x"}])
        assert "sk-secret" not in str(refused.value)
        assert dns.lookups["rebind.test"] == 3  # not retried: a refusal is final
        with pytest.raises(EndpointError, match="refused by the outbound policy"):
            ChatEndpoint(url).chat(model="m", messages=[])
    assert listener.connections == 0


def test_the_connection_goes_to_the_checked_address_with_the_name_as_host(monkeypatch):
    dns = FakeDNS(monkeypatch)
    # The first answer is checked and used; a second lookup (there is none) would get 10.9.9.9.
    dns.add("pinned.test", "127.0.0.1", "10.9.9.9")
    with listening() as listener:
        policy = OutboundPolicy(allow=("127.0.0.1",))
        reply = JudgeClient(base_url=f"http://pinned.test:{listener.port}/v1", outbound=policy, retries=0)
        assert reply.complete(model="m", messages=[{"role": "user", "content": "x"}]).content == "1"
    assert dns.lookups["pinned.test"] == 1
    assert listener.hosts == [f"pinned.test:{listener.port}"]
    assert listener.paths == ["/v1/chat/completions"]


def test_redirects_and_proxies_are_not_followed(monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # would swallow every request if used
    with listening() as listener:
        listener.status, listener.body = 307, "{}"
        policy = OutboundPolicy(allow=("127.0.0.1",))
        with pytest.raises(urllib.error.HTTPError) as redirect:
            _post(policy, listener.url + "/v1/chat/completions")
        assert redirect.value.code == 307 and listener.connections == 1


def _httpx_post(policy: OutboundPolicy, url: str) -> tuple[int, str]:
    import httpx

    async def post() -> tuple[int, str]:
        async with httpx.AsyncClient(transport=policy.httpx_transport()) as client:
            response = await client.post(url, json={})
            return response.status_code, response.text

    return asyncio.run(post())


def test_the_httpx_transport_is_pinned_the_same_way(monkeypatch):
    dns = FakeDNS(monkeypatch)
    dns.add("rebind.test", "93.184.216.34", "127.0.0.1")
    dns.add("pinned.test", "127.0.0.1", "10.9.9.9")
    with listening() as listener:
        with pytest.raises(OutboundRefused, match="loopback"):
            _httpx_post(PUBLIC_ONLY, listener.url + "/mcp")
        PUBLIC_ONLY.check_url(f"http://rebind.test:{listener.port}/mcp")
        with pytest.raises(OutboundRefused, match="rebind.test resolves to a loopback address"):
            _httpx_post(PUBLIC_ONLY, f"http://rebind.test:{listener.port}/mcp")
        assert listener.connections == 0
        status, _ = _httpx_post(
            OutboundPolicy(allow=("127.0.0.1",)), f"http://pinned.test:{listener.port}/mcp"
        )
        assert status == 200 and listener.hosts == [f"pinned.test:{listener.port}"]
    assert dns.lookups["pinned.test"] == 1


def test_an_mcp_server_on_an_internal_address_is_refused_before_connecting(monkeypatch):
    dns = FakeDNS(monkeypatch)
    dns.add("mcp.rebind.test", "93.184.216.34", "127.0.0.1")
    with listening() as listener:
        for url in (f"{listener.url}/mcp", f"http://2130706433:{listener.port}/mcp"):
            environment = build_environment("mcp", config={"url": url, "connect_timeout_s": 5})
            with pytest.raises(
                RuntimeError, match="cannot connect to the MCP server: OutboundRefused.*loopback"
            ):
                environment.open()
        PUBLIC_ONLY.check_url(f"http://mcp.rebind.test:{listener.port}/mcp")  # what the input saw
        environment = build_environment(
            "mcp", config={"url": f"http://mcp.rebind.test:{listener.port}/mcp", "connect_timeout_s": 5}
        )
        with pytest.raises(RuntimeError, match="loopback"):
            environment.open()
    assert listener.connections == 0


# -- upstream error bodies ------------------------------------------------------------------------


def test_an_openai_error_object_gives_its_message_redacted_and_short():
    body = {
        "error": {"message": "Incorrect API key provided: sk-proj-abc123********xyz. See docs.", "type": "x"}
    }
    assert upstream_reason(json.dumps(body).encode()) == "Incorrect API key provided: [redacted]. See docs."
    long = json.dumps({"error": {"message": "overloaded " * 100}}).encode()
    assert len(upstream_reason(long)) <= 200
    assert upstream_reason(b'{"detail": "token=abcdef123 is wrong"}') == "token=[redacted] is wrong"
    assert upstream_reason(b'{"message": "Bearer eyJhbGciOi.x.y rejected"}') == "[redacted] rejected"


@pytest.mark.parametrize(
    "body",
    [
        b"<html><body>Internal admin console: db password hunter2</body></html>",
        b"redis_version:7.2.4\r\nrole:master",
        b'{"unexpected": "shape", "password": "hunter2"}',
        b"\xff\xfe not text",
    ],
)
def test_any_other_body_is_never_echoed(body):
    assert upstream_reason(body) == ""


def test_redact_removes_the_given_secret_and_key_shapes():
    text = "key my-own-secret-value, AKIAABCDEFGHIJKLMNOP, https://user:pw@host/, x" + "a" * 40
    redacted = redact(text, secrets=("my-own-secret-value",))
    assert "my-own-secret-value" not in redacted and "AKIA" not in redacted
    assert "user:pw" not in redacted and "a" * 40 not in redacted


def test_judge_errors_hold_the_status_and_a_short_reason_only():
    policy = OutboundPolicy(allow=("127.0.0.1",))
    with listening() as listener:
        judge = JudgeClient(
            base_url=listener.url + "/v1", api_key="sk-team-key-1234567", outbound=policy, retries=0
        )
        listener.status = 401
        listener.body = json.dumps({"error": {"message": "Incorrect API key provided: sk-team-key-1234567."}})
        with pytest.raises(GradingError) as unauthorised:
            judge.complete(model="m", messages=[])
        assert str(unauthorised.value).endswith(
            "judge endpoint answered HTTP 401: Incorrect API key provided: [redacted]."
        )
        listener.status, listener.body = 500, "<html>stack trace with DATABASE_URL=postgres://u:p@db</html>"
        with pytest.raises(GradingError) as failed:
            judge.complete(model="m", messages=[])
        assert "HTTP 500: Internal Server Error" in str(failed.value) and "DATABASE_URL" not in str(
            failed.value
        )
        listener.status, listener.body = 200, "<html>not json: internal page</html>"
        with pytest.raises(GradingError) as garbled:
            judge.complete(model="m", messages=[])
        assert "not JSON" in str(garbled.value) and "internal page" not in str(garbled.value)
