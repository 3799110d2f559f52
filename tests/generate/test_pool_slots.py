"""Requests waiting for a slot in the SGLang server pool: a freed slot wakes one waiter,
oldest first, and a slot is never lost to a waiter that was cancelled after its wake-up
(consumers/generate/engines/sglang_pool.py). No processes: health is set by hand."""

from __future__ import annotations

import asyncio

import pytest

from regen.common.backoff import Backoff
from regen.consumers.generate.engines import sglang_pool
from regen.consumers.generate.engines.sglang_pool import ServerPool, ServerState


async def _never_probed(server: ServerState) -> bool:
    raise AssertionError("these tests set health by hand; no probe may run")


def _pool(cap: int) -> ServerPool:
    pool = ServerPool(
        ["http://a:30000"],
        cap,
        _never_probed,
        health_interval_s=10.0,
        overload_backoff=Backoff(1.0, 10.0, jitter=0),
    )
    for server in pool.servers:
        server.healthy = server.probed = True
    return pool


async def _settle() -> None:
    for _ in range(5):  # a few loop turns: woken waiters run and take their slots
        await asyncio.sleep(0)


def test_each_release_wakes_one_waiter_oldest_first() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        pool = _pool(cap=1)
        held = await pool.acquire(None)
        order: list[int] = []
        wakeups: list[int] = []

        async def wait_for_a_slot(i: int) -> None:
            server = await pool.acquire(None)
            order.append(i)
            wakeups.append(len(pool._slot_waiters))
            pool.release(server, ok=True)

        tasks = [asyncio.create_task(wait_for_a_slot(i)) for i in range(50)]
        await _settle()
        assert not order and len(pool._slot_waiters) == 50  # all wait on one full server
        pool.release(held, ok=True)
        await asyncio.gather(*tasks)
        return order, wakeups

    order, wakeups = asyncio.run(scenario())
    assert order == list(range(50))
    # Each release woke exactly one waiter: the others stayed queued, none re-queued.
    assert wakeups == list(range(49, -1, -1))


def test_a_waiter_cancelled_after_its_wake_up_passes_the_slot_on() -> None:
    async def scenario() -> bool:
        pool = _pool(cap=1)
        held = await pool.acquire(None)
        first = asyncio.create_task(pool.acquire(None))
        second = asyncio.create_task(pool.acquire(None))
        await _settle()
        pool.release(held, ok=True)  # wakes `first`...
        first.cancel()  # ...which is cancelled before it runs
        server = await asyncio.wait_for(second, timeout=5)
        return server.inflight == 1 and first.cancelled()

    assert asyncio.run(scenario())


def test_a_raised_limit_wakes_every_waiter_it_makes_room_for() -> None:
    async def scenario() -> int:
        pool = _pool(cap=1)
        await pool.acquire(None)
        tasks = [asyncio.create_task(pool.acquire(None)) for _ in range(3)]
        await _settle()
        pool.set_limit(pool.servers[0], 4, "test")
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        return pool.servers[0].inflight

    assert asyncio.run(scenario()) == 4


def test_a_waiter_gives_up_after_an_outage_and_leaves_no_live_waiter() -> None:
    async def scenario() -> tuple[bool, int]:
        pool = _pool(cap=1)
        pool.servers[0].healthy = False
        try:
            await pool.acquire(0.05)
        except TimeoutError:
            timed_out = True
        else:
            timed_out = False
        return timed_out, sum(not w.done() for w in pool._slot_waiters)

    assert asyncio.run(scenario()) == (True, 0)


class FakeClock:
    """time.monotonic for the pool and for the event loop's timers alike: a timer fires
    only once the test has moved the time past it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_healthy_server_is_waited_out_however_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full server for hours is no reason to give up: only an outage is (fake clock;
    each step wakes the waiter, which looks at the time again)."""
    clock = FakeClock()
    monkeypatch.setattr(sglang_pool.time, "monotonic", clock)

    async def scenario() -> bool:
        pool = _pool(cap=1)
        held = await pool.acquire(75.0)
        waiting = asyncio.create_task(pool.acquire(75.0))
        for _ in range(10):  # ten 15-minute answers' worth of waiting
            clock.now += 900.0
            pool._notify()
            await _settle()
            assert not waiting.done()
        pool.release(held, ok=True)
        server = await asyncio.wait_for(waiting, timeout=5)
        return server is held

    assert asyncio.run(scenario())


def test_the_outage_clock_starts_when_the_last_server_goes_down_and_resets_on_recovery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(sglang_pool.time, "monotonic", clock)

    async def scenario() -> None:
        pool = _pool(cap=1)
        await pool.acquire(75.0)  # full
        server = pool.servers[0]
        waiting = asyncio.create_task(pool.acquire(75.0))
        await _settle()
        clock.now += 500.0  # busy: no clock runs
        server.healthy = False
        pool._notify()  # down now: the outage starts here, not at the first request
        assert pool.outage_since() == clock.now
        clock.now += 74.0
        pool._notify()
        await _settle()
        assert not waiting.done()
        server.healthy = True  # back within the outage limit: the clock resets
        pool._notify()
        assert pool.outage_since() is None
        await _settle()
        clock.now += 10.0
        server.healthy = False
        pool._notify()
        clock.now += 74.0
        pool._notify()
        await _settle()
        assert not waiting.done()  # 74 s of the new outage, not 158 s
        clock.now += 2.0
        pool._notify()
        await _settle()
        assert waiting.done()
        with pytest.raises(TimeoutError):
            waiting.result()

    asyncio.run(scenario())


def test_a_next_turn_takes_the_freed_slot_before_first_turns() -> None:
    async def scenario() -> list[str]:
        pool = _pool(cap=1)
        held = await pool.acquire(None)
        order: list[str] = []

        async def wait(name: str, urgent: bool) -> None:
            server = await pool.acquire(None, urgent=urgent)
            order.append(name)
            pool.release(server, ok=True)

        tasks = [asyncio.create_task(wait(f"first-{i}", False)) for i in range(3)]
        await _settle()
        tasks.append(asyncio.create_task(wait("next-turn", True)))
        await _settle()
        pool.release(held, ok=True)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["next-turn", "first-0", "first-1", "first-2"]
