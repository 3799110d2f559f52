"""The engine loop's batches: a chunk's prompts start with one hand-over to the loop, and
each one's outcome comes back as it ends (consumers/generate/engine_loop.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from regen.consumers.generate.engine_loop import EngineRunner


class _NoEngine:
    async def close(self) -> None:
        pass


@pytest.fixture
def runner() -> Iterator[EngineRunner]:
    runner = EngineRunner(_NoEngine())  # type: ignore[arg-type]  # only close() is used
    yield runner
    runner.close()


async def _after(gate: asyncio.Event, value: int) -> int:
    await gate.wait()
    if value < 0:
        raise ValueError(f"bad {value}")
    return value


def test_outcomes_arrive_in_the_order_the_coroutines_end(runner: EngineRunner) -> None:
    gates: list[asyncio.Event] = runner.call(_make_events(3))
    batch = runner.start_batch(
        [_after(gate, v) for gate, v in zip(gates, (10, -1, 30), strict=True)]
    )
    for index in (2, 0, 1):  # ended out of submission order, one at a time
        runner._loop.call_soon_threadsafe(gates[index].set)
        outcome = batch.finished.get(timeout=5)
        assert outcome.index == index
        assert batch.finished.empty()  # the others still wait for their gates


def test_each_outcome_carries_its_result_or_its_error(runner: EngineRunner) -> None:
    gates: list[asyncio.Event] = runner.call(_make_events(3))
    batch = runner.start_batch(
        [_after(gate, v) for gate, v in zip(gates, (10, -1, 30), strict=True)]
    )
    for gate in gates:
        runner._loop.call_soon_threadsafe(gate.set)
    outcomes = sorted((batch.finished.get(timeout=5) for _ in gates), key=lambda o: o.index)
    assert [(o.result, type(o.error)) for o in outcomes] == [
        (10, type(None)),
        (None, ValueError),
        (30, type(None)),
    ]
    assert str(outcomes[1].error) == "bad -1"


def test_a_cancel_right_after_the_start_stops_every_coroutine(runner: EngineRunner) -> None:
    """cancel() is queued behind the start on the loop, so even one made before the loop
    ran the start finds every task, and each reports CancelledError."""
    never: asyncio.Event = runner.call(_make_events(1))[0]
    blocker = threading.Event()
    runner._loop.call_soon_threadsafe(blocker.wait, 5)  # the loop is busy meanwhile
    batch = runner.start_batch([_after(never, i) for i in range(4)])
    batch.cancel()
    blocker.set()
    outcomes = [batch.finished.get(timeout=5) for _ in range(4)]
    assert sorted(o.index for o in outcomes) == [0, 1, 2, 3]
    assert all(isinstance(o.error, asyncio.CancelledError) for o in outcomes)


def test_a_cancel_leaves_the_finished_outcomes_as_they_were(runner: EngineRunner) -> None:
    gates: list[asyncio.Event] = runner.call(_make_events(2))
    batch = runner.start_batch([_after(gates[0], 7), _after(gates[1], 8)])
    runner._loop.call_soon_threadsafe(gates[0].set)
    first = batch.finished.get(timeout=5)
    batch.cancel()
    second = batch.finished.get(timeout=5)
    assert (first.index, first.result, first.error) == (0, 7, None)
    assert second.index == 1 and isinstance(second.error, asyncio.CancelledError)


async def _make_events(n: int) -> list[asyncio.Event]:
    """Events made on the engine loop, which they then belong to."""
    return [asyncio.Event() for _ in range(n)]
