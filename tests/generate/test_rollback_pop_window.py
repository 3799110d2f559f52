"""Redis restored from a copy taken between kombu's pop of a chunk and its record in
`unacked` (issue #27; the chaos harness's single seeds 217 and 218 and turns seed 225,
which needed `regen recover` after a rollback with no kill): the copy has the chunk
neither queued nor delivered, and the worker holding it, its lease lost to the rollback,
puts it back on its queue instead of dropping it for good."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
import redis

from regen.common import jobspec, keys
from regen.common.queues import queue_lists, queued_chunks
from regen.consumers.generate.chunk_life import ChunkLease, LeaseBook, LeaseLost
from tests.support.generate_harness import (
    PROMPTS,
    Worker,
    all_generated,
    attempts,
    enqueue_prompts,
    results,
)
from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import run_standin
from tests.tokenize.test_redis_restore import dump_all, restore_all


def the_queue(r: redis.Redis, spec: jobspec.JobSpec) -> str:
    (queue,) = [name for name in queue_lists(spec.queue) if r.llen(name)]
    return queue


def test_a_copy_taken_inside_kombus_pop_window_loses_no_chunk(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS[:4], chunk_size=4)  # one chunk
    (chunk_id,) = [c.decode() for c in r.hkeys(keys.job_chunks(spec.name))]
    queue = the_queue(r, spec)
    # The backup (or lagging replica) as it is right after a worker's BRPOP took the
    # chunk and before kombu recorded the delivery: the chunk in neither place.
    raw = r.rpop(queue)
    copy = dump_all(r)
    r.rpush(queue, raw)  # the pop goes on: a worker takes the chunk from here
    # Answers of 4 s: the delivery is still running when Redis goes back.
    with (
        run_standin(output_len_dist="fixed:n=40", decode_tokens_per_s=10) as server,
        Worker(redis_url, tmp_path, "--engine", "sglang", "--server", server.url,
               "--jobs", spec.name) as worker,
    ):  # fmt: skip
        wait_for(
            lambda: [a["status"] for a in attempts(r, spec.name, chunk_id)] == ["started"],
            timeout=60,
            what="the worker to start the chunk",
        )
        restore_all(r, copy)  # Redis rolled back under the running worker
        assert queued_chunks(r, spec.queue) == 0 and r.hlen(keys.KOMBU_UNACKED) == 0
        assert not r.exists(keys.chunk_attempts(spec.name, chunk_id))
        # Its lease is lost (the copy lacks its attempt); before, the chunk was then in no
        # place for good: ids missing until `regen recover` and the job's enqueue.
        wait_for(lambda: all_generated(r, spec), timeout=45, what="the chunk to be generated")
        log = worker.log()
    assert "put back on its queue" in log, log[-3000:]
    # all_generated: a result for every id; and each once (the rollback took the
    # first delivery's, which then wrote nothing more).
    assert len(results(r, spec.name)) == 4


# --- the check itself, against a real Redis --------------------------------------------

TAG = "6f5ce9ef-2cf0-4339-81d6-a7d45838a547"
LIST = b"regen.generate.j"
RAW = orjson.dumps({"body": "...", "properties": {"delivery_tag": TAG}})


def held_delivery(r: redis.Redis) -> tuple[LeaseBook, ChunkLease]:
    """A worker's delivery of chunk c1 (tag TAG), popped from LIST as RAW, whose lease a
    rollback to a copy from before its start has just ended."""
    r.hset(keys.job_chunks("j"), "c1", 4)  # published before the copy
    book = LeaseBook(r)
    book.popped(TAG, LIST, RAW)
    r.zadd(keys.KOMBU_UNACKED_INDEX, {TAG: time.time()})
    r.hset(keys.KOMBU_UNACKED, TAG, b"[message, exchange, routing key]")
    lease, _ = book.start("j", "c1", TAG, "w1")
    return book, lease


def roll_back_to(r: redis.Redis, state: str) -> None:
    """Redis as a copy taken before the delivery started holds it."""
    r.delete(keys.chunk_attempts("j", "c1"), keys.chunk_writes("j", "c1"))
    r.zrem(keys.KOMBU_UNACKED_INDEX, TAG)
    r.hdel(keys.KOMBU_UNACKED, TAG)
    if state == "queued":  # the copy was taken before the pop
        r.rpush(LIST, RAW)
    elif state == "queued, redelivered":  # ... and kombu's sweep had restored it
        r.rpush(LIST, orjson.dumps({"body": "...", "redelivered": True, "tag": TAG}))
    elif state == "delivered":  # taken after kombu recorded the delivery
        r.zadd(keys.KOMBU_UNACKED_INDEX, {TAG: time.time() - 50})
        r.hset(keys.KOMBU_UNACKED, TAG, b"[message, exchange, routing key]")
    elif state == "unpublished":  # taken before the producer published the chunk
        r.hdel(keys.job_chunks("j"), "c1")


def test_a_lost_delivery_redis_holds_nowhere_is_put_back_at_its_tail(r: redis.Redis) -> None:
    r.rpush(LIST, b"another chunk")
    _, lease = held_delivery(r)
    roll_back_to(r, "in the pop window")
    with pytest.raises(LeaseLost):
        lease.finish(r, "w1")  # the loss, found here, puts it back at once
    assert r.lrange(LIST, 0, -1) == [b"another chunk", RAW], "next for BRPOP, as popped"
    assert not lease.hand_back_if_forgotten(r), "once"


def test_the_renewal_that_finds_the_loss_puts_it_back_at_once(r: redis.Redis) -> None:
    """From the heartbeat, not when the chunk's thread unwinds: a worker killed in
    between (chaos turns seed 225 with the pop window widened: a crash point a second
    after the loss) lost the chunk."""
    book, lease = held_delivery(r)
    roll_back_to(r, "in the pop window")
    book.renew()
    assert lease.lost.is_set() and r.lrange(LIST, 0, -1) == [RAW]


@pytest.mark.parametrize("state", ["queued", "queued, redelivered", "delivered", "unpublished"])
def test_a_lost_delivery_redis_still_holds_is_not_put_back(r: redis.Redis, state: str) -> None:
    _, lease = held_delivery(r)
    roll_back_to(r, state)
    before = r.lrange(LIST, 0, -1)
    assert not lease.hand_back_if_forgotten(r)
    assert r.lrange(LIST, 0, -1) == before


def test_a_delivery_redis_saw_start_is_not_put_back(r: redis.Redis) -> None:
    """Not a rollback: acked by a later delivery, or restored by the sweep and taken."""
    _, lease = held_delivery(r)
    r.zrem(keys.KOMBU_UNACKED_INDEX, TAG)
    r.hdel(keys.KOMBU_UNACKED, TAG)
    assert not lease.hand_back_if_forgotten(r)
    assert r.llen(LIST) == 0


def test_a_settled_delivery_leaves_nothing_to_put_back(r: redis.Redis) -> None:
    book, lease = held_delivery(r)
    book.forget_popped(TAG)  # Celery acknowledged it
    roll_back_to(r, "in the pop window")
    assert not lease.hand_back_if_forgotten(r)
    assert r.llen(LIST) == 0
