"""Internationalised host names in the outbound-URL policy (training.safety.outbound): ``ascii_url`` turns
``https://例え.テスト/v1`` into the IDNA 2008 name HTTP can carry, refuses names that are not valid
IDNA, and the policy's opener applies it to any URL it is given, so a URL stored before the writes
were normalised is called (or refused with a reason) instead of raising UnicodeEncodeError."""

from __future__ import annotations

import urllib.request

import pytest

from tests.listener import FakeDNS, listening
from training.config import ConfigError
from training.environments import validate_environment
from training.rewards import GradingError, JudgeClient
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy, OutboundRefused, ascii_url

IDN_URL = "https://例え.テスト/v1"
PUNYCODE_HOST = "xn--r8jz45g.xn--zckzah"
LOOPBACK_ONLY = OutboundPolicy(allow=("127.0.0.1",))


def test_a_non_ascii_host_becomes_its_exact_punycode():
    assert ascii_url(IDN_URL) == f"https://{PUNYCODE_HOST}/v1"
    # UTS 46 mapping: upper case folded, an ideographic full stop is a dot.
    assert ascii_url("https://例え。テスト/v1") == f"https://{PUNYCODE_HOST}/v1"
    assert ascii_url("https://Bücher.example/") == "https://xn--bcher-kva.example/"


def test_the_port_is_kept_and_other_non_ascii_characters_are_percent_encoded():
    assert ascii_url("https://例え.テスト:8443/v1/パス?q=値&r=%20#frag") == (
        f"https://{PUNYCODE_HOST}:8443/v1/%E3%83%91%E3%82%B9?q=%E5%80%A4&r=%20#frag"
    )


def test_an_ascii_url_comes_back_exactly_as_written():
    for url in ("https://api.openai.com/v1", "http://[::1]:8000/v1?x=%41", "HTTP://Judge.Example/v1"):
        assert ascii_url(url) == url


def test_idna_2008_is_used_not_the_idna_2003_codec():
    # IDNA 2003 (Python's "idna" codec) maps ß to "ss"; IDNA 2008 keeps it as its own letter.
    assert "faß.de".encode("idna") == b"fass.de"
    assert ascii_url("https://faß.de/") == "https://xn--fa-hia.de/"
    # A snowman is valid IDNA 2003, disallowed in IDNA 2008.
    assert "☃.example".encode("idna") == b"xn--n3h.example"
    with pytest.raises(OutboundRefused, match="not a valid name"):
        ascii_url("https://☃.example/v1")


@pytest.mark.parametrize(
    "url",
    [
        "https://" + "ü" * 60 + ".example/v1",  # a label over 63 characters once encoded
        "https://☃.example/v1",  # a disallowed code point
        "https://例え..テスト/v1",  # an empty label
    ],
)
def test_a_host_that_is_not_valid_idna_is_refused_with_the_reason(url):
    with pytest.raises(OutboundRefused, match=r"the host is not a valid name \(IDNA: "):
        ascii_url(url)
    with pytest.raises(OutboundRefused, match="not a valid name"):
        PUBLIC_ONLY.check_url(url, resolve=False)


def test_the_check_and_the_stored_url_agree_on_the_name():
    assert PUBLIC_ONLY.check_url(IDN_URL, resolve=False).host == PUNYCODE_HOST
    assert PUBLIC_ONLY.check_url("https://faß.de/", resolve=False).host == "xn--fa-hia.de"


def test_a_judge_on_a_non_ascii_host_is_called_by_its_idna_name(monkeypatch):
    """A row stored before writes were normalised: the opener encodes the name; no
    UnicodeEncodeError from http.client (it writes the Host header in Latin-1)."""
    FakeDNS(monkeypatch).add(PUNYCODE_HOST, "127.0.0.1")
    with listening() as listener:
        client = JudgeClient(
            base_url=f"http://例え.テスト:{listener.port}/v1", outbound=LOOPBACK_ONLY, retries=0
        )
        assert client.complete(model="m", messages=[{"role": "user", "content": "x"}]).content == "1"
        assert listener.hosts == [f"{PUNYCODE_HOST}:{listener.port}"]


def test_the_policy_opener_refuses_an_invalid_idna_host_without_connecting():
    with listening() as listener:
        request = urllib.request.Request(f"http://☃.example:{listener.port}/hook", data=b"{}", method="POST")
        with pytest.raises(OutboundRefused, match="not a valid name"):
            LOOPBACK_ONLY.opener().open(request, timeout=5)
        client = JudgeClient(base_url="https://☃.example/v1", outbound=LOOPBACK_ONLY, retries=0)
        with pytest.raises(
            GradingError, match="refused by the outbound policy: the host is not a valid name"
        ):
            client.complete(model="m", messages=[{"role": "user", "content": "x"}])
        assert listener.connections == 0


def test_an_mcp_config_url_is_kept_as_its_idna_name_or_refused():
    checked = validate_environment("mcp", config={"url": "https://例え.テスト/mcp"}, tools=[], max_turns=None)
    assert checked["config"]["url"] == f"https://{PUNYCODE_HOST}/mcp"
    with pytest.raises(ConfigError) as refused:
        validate_environment("mcp", config={"url": "https://☃.example/mcp"}, tools=[], max_turns=None)
    assert refused.value.field == "config.url" and "not a valid name" in refused.value.message
