"""One upstream client per URL for a stateless era: sessions on a 2026-07-28 URL share the URL's common link
(one handshake and one listing for all), legacy-era sessions keep a client each, and one session's failed
request leaves the link to the others."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rlgate.mcpclient.errors import CallLost
from rlgate.mcpclient.pool import PoolSettings, UpstreamPool
from rlgate.mcpclient.session import SessionUpstreams
from tests.toolgateway.http_server import ERAS, HostileUpstream, hostile_upstream

HANDSHAKE = {"modern": "server/discover", "legacy": "initialize"}


@pytest.fixture(params=ERAS)
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[HostileUpstream]:
    async with hostile_upstream(str(request.param)) as up:
        yield up


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    pool = UpstreamPool(PoolSettings(upstream_timeout_s=10.0))
    yield pool
    await pool.close()


async def opened(pool: UpstreamPool, session_id: str, url: str) -> SessionUpstreams:
    ups = pool.session(session_id, [url])
    await ups.catalog(10.0)
    return ups


def add_result(result: object) -> str:
    return result.content[0].text  # type: ignore[attr-defined,no-any-return]


async def test_sessions_share_a_stateless_urls_client_once_its_era_is_known(
    upstream: HostileUpstream, pool: UpstreamPool
) -> None:
    url = upstream.url
    first = await opened(pool, "s1", url)  # learns the era on a link of its own
    handshakes, listings = upstream.methods[HANDSHAKE[upstream.era]], upstream.methods["tools/list"]
    others = [await opened(pool, f"s{i}", url) for i in range(2, 6)]
    for i, ups in enumerate(others):
        assert add_result(await ups.call(url, "add", {"n": i}, 10.0)) == str(i + 1)
    links = {id(ups.clients[url]._link) for ups in others}
    if upstream.era == "modern":
        assert len(links) == 1 and others[0].clients[url]._link is not first.clients[url]._link
        assert upstream.methods[HANDSHAKE["modern"]] - handshakes == 1  # one handshake for four sessions
        assert upstream.methods["tools/list"] - listings == 1  # and one listing
        assert pool.open_clients() == 2
    else:  # a legacy-era client carries its session's server state: never shared
        assert len(links) == 4
        assert upstream.methods[HANDSHAKE["legacy"]] - handshakes == 4
        assert pool.open_clients() == 5
    # The common link outlives a session that ends, and closes with its last user.
    await pool.close_session("s2")
    assert add_result(await others[1].call(url, "add", {"n": 7}, 10.0)) == "8"
    for i in range(3, 6):
        await pool.close_session(f"s{i}")
    assert pool.open_clients() == 1  # the first session's own link


async def test_one_sessions_lost_request_leaves_the_common_link_to_the_others() -> None:
    pool = UpstreamPool(PoolSettings(upstream_timeout_s=10.0))
    async with hostile_upstream("modern") as upstream:
        try:
            await opened(pool, "s1", upstream.url)
            a, b = await opened(pool, "a", upstream.url), await opened(pool, "b", upstream.url)
            link = a.clients[upstream.url]._link
            assert link is not None and link.common and b.clients[upstream.url]._link is link
            with pytest.raises(CallLost):
                await a.call(upstream.url, "drop", {"when": "json"}, 10.0)
            assert not link.dead  # the transport answered that one request; the client is unharmed
            assert add_result(await b.call(upstream.url, "add", {"n": 1}, 10.0)) == "2"
            assert b.clients[upstream.url]._link is link
            assert add_result(await a.call(upstream.url, "add", {"n": 2}, 10.0)) == "3"
            assert a.clients[upstream.url]._link is link  # back on the same client
            assert upstream.calls["drop"] == 1
        finally:
            await pool.close()


async def test_a_common_link_serves_at_most_its_share_of_sessions() -> None:
    pool = UpstreamPool(PoolSettings(upstream_timeout_s=10.0, common_link_sessions=2))
    async with hostile_upstream("modern") as upstream:
        try:
            await opened(pool, "s1", upstream.url)
            sessions = [await opened(pool, f"s{i}", upstream.url) for i in range(2, 7)]
            links = [ups.clients[upstream.url]._link for ups in sessions]
            assert all(link is not None and link.common for link in links)
            assert [links.count(link) for link in dict.fromkeys(links)] == [2, 2, 1]
            assert upstream.methods["server/discover"] == 1 + 3
        finally:
            await pool.close()
