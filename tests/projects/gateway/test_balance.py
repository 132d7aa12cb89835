"""Spreading completions among one base model's servers: least outstanding, adapter holders
preferred, a server that refused a connection tried last (projects.gateway.balance)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from projects import services
from projects.gateway import balance
from projects.gateway.services import inference_server_heartbeat
from projects.selectors.serving import resolve_model


@pytest.fixture(autouse=True)
def fresh_counts():
    balance.reset()
    yield
    balance.reset()


@pytest.fixture
def setup(alpha_setup, settings):
    settings.GATEWAY_ADAPTER_LOAD_COST = 4
    model = alpha_setup.model
    checkpoint = services.checkpoint_record(
        model=model, run=None, step=1, path=f"/host-a/model-{model.pk}/step-000001"
    )
    checkpoint.storage_key = f"model-{model.pk}/step-000001"
    checkpoint.save(update_fields=["storage_key"])
    servers = [
        inference_server_heartbeat(url=f"http://host{i}:8100", base_model_name="tiny") for i in range(3)
    ]
    target = resolve_model(team=alpha_setup.project.team, model_id="math/agent:1")
    base = resolve_model(team=alpha_setup.project.team, model_id="tiny")
    return type("Setup", (), {"servers": servers, "target": target, "base": base, "checkpoint": checkpoint})


def urls(servers) -> list[str]:
    return [server.url for server in servers]


def test_without_load_the_rendezvous_order_stands(setup):
    assert urls(balance.order(setup.servers, setup.base)) == urls(setup.servers)
    assert urls(balance.order(setup.servers, setup.target)) == urls(setup.servers)


def test_the_server_with_fewest_requests_in_flight_goes_first(setup):
    first, second, third = urls(setup.servers)
    releases = [balance.begin(first), balance.begin(first), balance.begin(second)]
    assert urls(balance.order(setup.servers, setup.base)) == [third, second, first]
    for release in releases:
        release()
        release()  # a second call counts nothing more
    assert balance.outstanding(first) == balance.outstanding(second) == 0
    assert urls(balance.order(setup.servers, setup.base)) == [first, second, third]


def test_a_server_holding_the_adapter_is_preferred_until_it_is_busier_than_a_load(setup):
    """The adapter is named by store key (our servers), by path, or by vLLM's name (gateway's record)."""
    first, second, third = setup.servers
    third.loaded_adapters = [setup.checkpoint.storage_key]
    assert urls(balance.order(setup.servers, setup.target))[0] == third.url
    assert urls(balance.order(setup.servers, setup.base))[0] == first.url  # a base model needs none
    for _ in range(4):
        balance.begin(third.url)
    # 4 in flight there = the cost of loading it elsewhere: a tie, so the rendezvous order decides.
    assert urls(balance.order(setup.servers, setup.target))[0] == first.url
    from projects.gateway.vllm import adapter_name

    for names in ([setup.checkpoint.path], [adapter_name(setup.checkpoint)]):
        second.loaded_adapters = names
        assert balance.holds_adapter(second, setup.target)
    second.loaded_adapters = ["model-999/step-000001"]
    assert not balance.holds_adapter(second, setup.target)


def test_a_server_that_refused_a_connection_is_tried_last_for_a_while(setup, settings):
    first = setup.servers[0].url
    settings.GATEWAY_SERVER_DOWN_S = 60
    balance.mark_down(first)
    assert urls(balance.order(setup.servers, setup.base))[-1] == first
    settings.GATEWAY_SERVER_DOWN_S = 0
    balance.mark_down(first)
    assert urls(balance.order(setup.servers, setup.base))[0] == first


def test_a_stream_is_counted_until_it_ends_or_is_abandoned(setup):
    url = setup.servers[0].url
    gauge = lambda: REGISTRY.get_sample_value(  # noqa: E731
        "artweb_gateway_upstream_outstanding_requests", {"server": url}
    )

    async def chunks():
        yield b"a"
        yield b"b"

    async def read(count: int) -> None:
        release = balance.begin(url)
        assert balance.outstanding(url) == 1 and gauge() == 1
        stream = balance.released_at_end(chunks(), release)
        taken = [chunk async for chunk, _ in zip_count(stream, count)]
        assert len(taken) == count
        await stream.aclose()

    asyncio.run(read(2))
    assert balance.outstanding(url) == 0 and gauge() == 0
    asyncio.run(read(1))  # the client left after one chunk
    assert balance.outstanding(url) == 0 and gauge() == 0


async def zip_count(stream, count):
    taken = 0
    async for chunk in stream:
        yield chunk, taken
        taken += 1
        if taken == count:
            return


def test_a_stream_the_handler_never_starts_is_counted_out_when_closed(setup):
    url = setup.servers[0].url

    async def chunks():
        yield b"never read"

    response = balance.CountedStream(chunks(), release=balance.begin(url), status=200)
    assert balance.outstanding(url) == 1
    response.close()
    assert balance.outstanding(url) == 0
