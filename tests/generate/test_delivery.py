"""One delivery from its receipt to its end (consumers/generate/chunk_life/delivery.py):
each end recorded once in the chunk's attempts, announced to the worker's hooks, and
counted by the worker's metrics as it is (a lost lease is a drop, not an ack)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry

from regen.common import keys
from regen.common.chunk import Chunk, ChunkPrompt
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import (
    Attempt,
    ChunkDeferred,
    ChunkLease,
    DeliveryEnd,
    DeliveryEvent,
    LeaseBook,
    deliver,
)
from regen.consumers.generate.metrics import ChunkOutcomes
from tests.generate.test_lease import TAG
from tests.generate.test_lease import deliver as kombu_delivers

CHUNK = Chunk("j", "c1", [ChunkPrompt("p1", [1, 2], [], {}), ChunkPrompt("p2", [3], [], {})])

Run = Callable[[ChunkLease], tuple[int, int]]


class Work:
    """A ChunkWork that runs `run` on the delivery's lease."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self.dead_lettered: list[str] = []

    def run(self, lease: ChunkLease, todo: list[ChunkPrompt], done: set[str]) -> tuple[int, int]:
        return self._run(lease)

    def dead_letter_all(
        self, lease: ChunkLease, todo: list[ChunkPrompt], done: set[str], history: list[Attempt]
    ) -> int:
        self.dead_lettered += [p.id for p in todo]
        return len(todo)


def settle_both(lease: ChunkLease) -> tuple[int, int]:
    return 2, 0


def give_back(lease: ChunkLease) -> tuple[int, int]:
    raise ChunkDeferred("the worker drains")


def engine_bug(lease: ChunkLease) -> tuple[int, int]:
    raise RuntimeError("engine bug")


def attempts(r: redis.Redis) -> list[str]:
    return [orjson.loads(a)["status"] for a in r.lrange(keys.chunk_attempts("j", "c1"), 0, -1)]


@pytest.fixture
def ctx(r: redis.Redis) -> ChunkContext:
    kombu_delivers(r)
    return ChunkContext(redis=r, runner=None)  # type: ignore[arg-type]


def counted(ctx: ChunkContext) -> ChunkOutcomes:
    outcomes = ChunkOutcomes(CollectorRegistry())
    ctx.hooks.subscribe(DeliveryEvent.AFTER_END, outcomes.on_end)
    return outcomes


def label_counts(outcomes: ChunkOutcomes) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for metric in outcomes.chunks.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


@pytest.mark.parametrize(
    ("run", "end", "status", "label"),
    [
        (settle_both, DeliveryEnd.ACKED, "done", "acked"),
        (give_back, DeliveryEnd.RETURNED, "returned", "returned"),
        (engine_bug, DeliveryEnd.FAILED, "failed", "returned"),
    ],
)
def test_a_delivery_ends_once_and_is_counted_as_it_ended(
    r: redis.Redis, ctx: ChunkContext, run: Run, end: DeliveryEnd, status: str, label: str
) -> None:
    outcomes = counted(ctx)
    ended: list[Any] = []
    ctx.hooks.subscribe(DeliveryEvent.AFTER_END, lambda **details: ended.append(details))
    delivery = deliver(ctx, CHUNK, TAG, Work(run))
    assert delivery.end is end
    assert attempts(r) == [status]
    assert [d["delivery"] for d in ended] == [delivery] and ended[0]["chunk"] is CHUNK
    assert label_counts(outcomes) == {"acked": 0, "returned": 0, "dropped": 0, label: 1}
    assert ctx.chunks_held == 0 and ctx.leases.held == 0
    acked = r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) is None
    assert acked == (end is DeliveryEnd.ACKED)


def test_a_delivery_that_lost_its_lease_is_counted_dropped_not_acked(
    r: redis.Redis, ctx: ChunkContext
) -> None:
    """The Celery task returns normally for a dropped delivery (nothing to requeue: the
    chunk is another delivery's), so a count taken from Celery's task_postrun called
    it acked."""
    outcomes = counted(ctx)

    def redelivered_meanwhile(lease: ChunkLease) -> tuple[int, int]:
        LeaseBook(r).start("j", "c1", TAG, "the other worker")
        lease.write(r, lambda pipe: pipe.rpush("written", "stale"))
        raise AssertionError("a write under a lost lease went through")

    delivery = deliver(ctx, CHUNK, TAG, Work(redelivered_meanwhile))
    assert delivery.end is DeliveryEnd.DROPPED
    assert r.lrange("written", 0, -1) == []
    assert attempts(r) == ["lost", "started"]  # the other delivery still runs
    assert label_counts(outcomes) == {"acked": 0, "returned": 0, "dropped": 1}
    assert r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) is not None, "not acknowledged"


def test_a_chunk_past_its_attempts_is_dead_lettered_and_acked(
    r: redis.Redis, ctx: ChunkContext
) -> None:
    died = orjson.dumps({"worker": "w", "time": 0.0, "status": "started"})
    r.rpush(keys.chunk_attempts("j", "c1"), *[died] * ctx.max_attempts)
    work = Work(settle_both)
    delivery = deliver(ctx, CHUNK, TAG, work)
    assert (delivery.end, delivery.dead_lettered) == (DeliveryEnd.ACKED, 2)
    assert work.dead_lettered == ["p1", "p2"]
    assert attempts(r)[-1] == "dead_lettered"


def test_a_crash_point_is_a_subscriber_of_its_step(
    ctx: ChunkContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """REGEN_CRASHPOINT=generate.before_ack stops a delivery after every prompt is
    settled and before the ack: the crash point is asked at that step, and only there
    (no hand-off ran here)."""
    hits: list[str] = []
    monkeypatch.setattr("regen.common.crashpoints.hit", lambda name: hits.append(name))
    delivery = deliver(ctx, CHUNK, TAG, Work(settle_both))
    assert delivery.end is DeliveryEnd.ACKED
    assert hits == ["generate.before_ack"]


def test_an_error_outside_the_work_fails_the_delivery_rather_than_escaping_it(
    r: redis.Redis, ctx: ChunkContext
) -> None:
    """The dead letters of a chunk past its attempts failing (here: a bug in them) end
    the delivery failed, as an error of the work does, so the task gives the chunk back;
    an exception out of the task would let Celery ack a failed task."""
    died = orjson.dumps({"worker": "w", "time": 0.0, "status": "started"})
    r.rpush(keys.chunk_attempts("j", "c1"), *[died] * ctx.max_attempts)
    outcomes = counted(ctx)

    class BrokenDeadLetters(Work):
        def dead_letter_all(
            self, lease: ChunkLease, todo: list[ChunkPrompt], done: set[str],
            history: list[Attempt],
        ) -> int:  # fmt: skip
            raise RuntimeError("dead letters bug")

    delivery = deliver(ctx, CHUNK, TAG, BrokenDeadLetters(settle_both))
    assert delivery.end is DeliveryEnd.FAILED and "dead letters bug" in delivery.reason
    assert isinstance(delivery.error, RuntimeError)
    assert label_counts(outcomes)["returned"] == 1
    assert ctx.chunks_held == 0 and ctx.leases.held == 0
