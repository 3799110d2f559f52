"""Conversation affinity in the SGLang server pool, the prefix-cache accounting, and the
stand-in's prefix cache, without processes: the pool's choice is a pure function of its
servers' states, set here directly."""

from __future__ import annotations

import asyncio
import random
import time

import orjson
import pytest
from rich.console import Console

from regen.common.backoff import Backoff
from regen.consumers.generate.engine import GenerateRequest
from regen.consumers.generate.engines.sglang_pool import ServerPool, ServerState
from regen.consumers.generate.engines.sglang_replies import parse_result
from regen.ops.status_view import workers_table
from tests.support.sglang_standin.prefix_cache import PrefixCache

URLS = ["http://a:30000", "http://b:30000", "http://c:30000"]


async def _never_probed(server: ServerState) -> bool:
    raise AssertionError("these tests set health by hand; no probe may run")


def pool(cap: int = 4, affinity_keys: int = 100) -> ServerPool:
    servers = ServerPool(
        URLS,
        cap,
        _never_probed,
        health_interval_s=10.0,
        overload_backoff=Backoff(1.0, 10.0, jitter=0),
        affinity_keys=affinity_keys,
    )
    for server in servers.servers:
        server.healthy = server.probed = True
    return servers


def pick(servers: ServerPool, key: str | None, *, keep: bool = False) -> ServerState:
    """The server `acquire` chooses now (never waiting); released unless `keep`."""
    server = asyncio.run(servers.acquire(time.monotonic(), key))
    if not keep:
        servers.release(server, ok=True)
    return server


def by_url(servers: ServerPool, url: str) -> ServerState:
    return next(s for s in servers.servers if s.url == url)


def test_a_key_returns_to_its_last_server_even_when_another_is_less_loaded() -> None:
    servers = pool()
    first = pick(servers, "conv-1")
    # Load it beyond the others: least-loaded routing would now pick elsewhere.
    for _ in range(2):
        first.inflight += 1
    assert pick(servers, None) is not first
    assert pick(servers, "conv-1") is first
    assert pick(servers, "conv-1") is first
    assert servers.affinity_stats() == {"kept": 2, "moved": 0, "keys": 1}


def test_keys_spread_by_load_and_each_sticks_to_its_own_server() -> None:
    servers = pool()
    homes = {key: pick(servers, key, keep=True) for key in ("k0", "k1", "k2")}
    assert len(set(map(id, homes.values()))) == 3  # first turns spread by load
    for server in servers.servers:
        servers.release(server, ok=True)
    for _ in range(3):
        for key, home in homes.items():
            assert pick(servers, key) is home


@pytest.mark.parametrize("why", ["down", "overloaded", "full"])
def test_a_key_moves_at_once_when_its_server_cannot_take_it(why: str) -> None:
    servers = pool(cap=2)
    home = pick(servers, "conv-1")
    if why == "down":
        servers.mark_down(home, "connect", "refused")
    elif why == "overloaded":
        servers.mark_overloaded(home, "queue full")
    else:
        home.inflight = home.cap
    started = time.monotonic()
    moved = pick(servers, "conv-1")
    assert moved is not home and time.monotonic() - started < 1.0  # soft: never waits
    assert servers.affinity_stats()["moved"] == 1
    # The key follows the new server, where the conversation's prefix now is, and stays
    # there after the old one comes back.
    home.healthy, home.overload_until, home.inflight = True, 0.0, 0
    assert pick(servers, "conv-1") is moved


def test_a_key_whose_server_is_busy_waits_only_when_every_server_is() -> None:
    servers = pool(cap=1)
    home = pick(servers, "conv-1", keep=True)
    others = [pick(servers, None, keep=True) for _ in range(2)]
    assert home not in others

    async def wait_then_free() -> ServerState:
        waiting = asyncio.ensure_future(servers.acquire(None, "conv-1"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # nothing routable: it waits, like any request
        servers.release(home, ok=True)
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(wait_then_free()) is home


def test_the_key_map_is_bounded_least_recently_used_first() -> None:
    servers = pool(affinity_keys=2)
    home0, home1 = pick(servers, "k0"), pick(servers, "k1")
    assert home0 is not home1
    pick(servers, "k0")  # used again: k1 is now the least recently used
    pick(servers, "k2")  # a third key: k1 is forgotten
    assert servers.affinity_stats()["keys"] == 2
    # Both old homes are the busiest now: a remembered key still goes home, a forgotten
    # one routes by load like a new key.
    home0.inflight = home1.inflight = 3
    assert pick(servers, "k0") is home0
    assert pick(servers, "k1") not in (home0, home1)


def test_the_hit_rate_counts_reported_tokens_and_unknown_is_not_a_miss() -> None:
    server = pool().servers[0]
    assert server.cache.hit_rate() is None
    server.cache.count(100, None)
    assert server.cache.hit_rate() is None and server.cache.unreported == 1
    server.cache.count(100, 0)
    server.cache.count(300, 200)
    assert server.cache.hit_rate() == pytest.approx(0.5)
    snapshot = server.snapshot()
    assert (snapshot["prompt_tokens"], snapshot["cached_tokens"]) == (400, 200)
    assert snapshot["cache_hit_rate"] == pytest.approx(0.5)


def _reply(**meta: object) -> bytes:
    meta = {"finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, **meta}
    return orjson.dumps({"text": "hi", "output_ids": [5, 6], "meta_info": meta})


def test_cached_tokens_is_parsed_and_absent_means_unknown() -> None:
    request = GenerateRequest("rid-1", [1, 2, 3], {"max_new_tokens": 2})
    assert parse_result(_reply(cached_tokens=2), request, "s", 0.0).cached_tokens == 2
    assert parse_result(_reply(cached_tokens=0), request, "s", 0.0).cached_tokens == 0
    assert parse_result(_reply(), request, "s", 0.0).cached_tokens is None
    assert parse_result(_reply(cached_tokens=None), request, "s", 0.0).cached_tokens is None


# --- the stand-in's prefix cache ---------------------------------------------------------


def test_the_prefix_cache_matches_the_longest_cached_prefix_but_never_the_last_token() -> None:
    cache = PrefixCache(1000)
    assert cache.match([1, 2, 3, 4]) == 0
    cache.insert([1, 2, 3, 4, 5, 6])  # a prompt and its output
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8]) == 6  # the next turn
    assert cache.match([1, 2, 9, 9]) == 2  # a shared system prompt
    assert cache.match([1, 2, 3]) == 2  # the last prompt token is always computed
    assert cache.match([7, 1, 2, 3]) == 0  # a prefix, not any substring


def test_the_prefix_cache_agrees_with_a_brute_force_longest_common_prefix() -> None:
    rng = random.Random(7)
    cache, held = PrefixCache(10**6), []
    for _ in range(300):
        # A small alphabet and shared heads make splits at every depth.
        head = rng.choice(held)[: rng.randrange(12)] if held and rng.random() < 0.7 else []
        ids = head + [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        want = max((_shared_head(ids[:-1], seq) for seq in held), default=0)
        assert cache.match(ids) == want, ids
        cache.insert(ids)
        held.append(ids)
    assert len(cache) <= sum(map(len, held))


def _shared_head(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_prefix_cache_holds_its_token_budget_evicting_the_least_recent_leaf() -> None:
    cache = PrefixCache(10)
    cache.insert([1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 7, 8])  # shares [1, 2]: 8 tokens cached in all
    assert len(cache) == 8
    assert cache.match([1, 2, 3, 4, 5, 6, 0]) == 6  # used again: [7, 8] is now the oldest
    cache.insert([9, 10, 11])  # over budget: leaves go, oldest first, down to 90%
    assert len(cache) == 9
    assert cache.match([1, 2, 7, 8, 0]) == 2  # its tail went, the shared head stays
    assert cache.match([1, 2, 3, 4, 5, 6, 0]) == 6
    assert cache.match([9, 10, 11, 0]) == 3
    assert PrefixCache(0).match([1, 2, 3]) == 0


def test_status_shows_each_servers_hit_rate_and_nothing_while_it_is_unknown() -> None:
    servers = [
        {"url": "http://a:30000", "healthy": True, "inflight": 2, "cache_hit_rate": 0.43},
        {"url": "http://b:30000", "healthy": True, "inflight": 1, "cache_hit_rate": None},
    ]
    beat = {"name": "g", "kind": "generate", "stale": False, "age_s": 1.0,
            "engine_stats": {"engine": "sglang", "servers": servers}}  # fmt: skip
    console = Console(width=200, record=True)
    console.print(workers_table([beat]))
    text = console.export_text()
    assert "http://a:30000 up 2 cache 43%, http://b:30000 up 1 " in text
    assert text.count("cache") == 1
