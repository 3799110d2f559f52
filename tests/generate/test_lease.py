"""Chunk leases against a real Redis: who may write for a chunk, and what renewal does."""

from __future__ import annotations

import time

import pytest
import redis

from regen.common import defaults, keys
from regen.consumers.generate.chunk_life import ChunkLease, HandOff, LeaseBook, LeaseLost
from tests.tokenize.test_redis_restore import dump_all, restore_all

TAG = "delivery-tag-1"


def deliver(r: redis.Redis, tag: str = TAG, at: float | None = None) -> None:
    """What kombu writes when it delivers a message: its index score and its body."""
    r.zadd(keys.KOMBU_UNACKED_INDEX, {tag: time.time() if at is None else at})
    r.hset(keys.KOMBU_UNACKED, tag, b"[message, exchange, routing key]")


def note(pipe: redis.client.Pipeline, what: str) -> None:
    pipe.rpush("written", what)


def written(r: redis.Redis) -> list[bytes]:
    return r.lrange("written", 0, -1)


def test_renewal_moves_only_the_held_deliveries_to_now(r: redis.Redis) -> None:
    old = time.time() - 50
    deliver(r, at=old)
    deliver(r, "someone-elses", at=old)
    book = LeaseBook(r)
    book.start("j", "c1", TAG, "w1")
    book.renew()
    assert r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) == pytest.approx(time.time(), abs=5)
    assert r.zscore(keys.KOMBU_UNACKED_INDEX, "someone-elses") == pytest.approx(old)


def test_a_later_delivery_takes_the_chunk_from_the_earlier_one(r: redis.Redis) -> None:
    deliver(r)
    frozen_book, live_book = LeaseBook(r), LeaseBook(r)
    frozen, _ = frozen_book.start("j", "c1", TAG, "frozen")
    live, history = live_book.start("j", "c1", TAG, "live")  # redelivered: same tag
    assert [h["worker"] for h in history] == ["frozen", "live"]

    with pytest.raises(LeaseLost):
        frozen.write(r, lambda pipe: note(pipe, "stale"))
    assert live.write(r, lambda pipe: note(pipe, "fresh"))
    assert written(r) == [b"fresh"]
    # Celery must leave the frozen delivery alone once, and only it.
    assert frozen_book.take_settled(TAG) and not frozen_book.take_settled(TAG)
    assert not live_book.take_settled(TAG)


def test_renewal_finds_a_lost_lease_and_stops_the_chunk(r: redis.Redis) -> None:
    deliver(r)
    book = LeaseBook(r)
    lease, _ = book.start("j", "c1", TAG, "w1")
    stopped = []
    lease.on_lost(lambda: stopped.append(True))
    LeaseBook(r).start("j", "c1", TAG, "w2")
    book.renew()
    assert lease.lost.is_set() and stopped == [True] and book.held == 0


def test_a_delivery_restored_to_the_queue_is_no_longer_held(r: redis.Redis) -> None:
    deliver(r)
    lease, _ = LeaseBook(r).start("j", "c1", TAG, "w1")
    r.zrem(keys.KOMBU_UNACKED_INDEX, TAG)  # kombu's sweep restored it
    with pytest.raises(LeaseLost):
        lease.write(r, lambda pipe: note(pipe, "stale"))
    assert written(r) == []


def test_a_prompt_already_settled_is_not_written_twice(r: redis.Redis) -> None:
    deliver(r)
    lease, _ = LeaseBook(r).start("j", "c1", TAG, "w1")

    def hand_off(pipe: redis.client.Pipeline) -> None:
        note(pipe, "p1")
        pipe.sadd(keys.chunk_generated("j", "c1"), "p1")

    assert lease.write(r, hand_off, prompt_id="p1")
    assert not lease.write(r, hand_off, prompt_id="p1")  # a retry after a lost reply
    assert written(r) == [b"p1"]


def test_an_ack_racing_the_sweep_keeps_the_chunk_state_for_the_redelivery(
    r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    deliver(r)
    lease, _ = LeaseBook(r).start("j", "c1", TAG, "w1")
    lease.write(r, lambda pipe: pipe.sadd(lease.generated_key, "p1"))
    # kombu's sweep restores the delivery between the lease check and the ack's EXEC.
    check = ChunkLease._check

    def check_then_restore(self: ChunkLease, pipe: redis.client.Pipeline) -> None:
        check(self, pipe)
        r.zrem(keys.KOMBU_UNACKED_INDEX, TAG)

    monkeypatch.setattr(ChunkLease, "_check", check_then_restore)
    lease.finish(r, "w1")
    # The chunk is queued again: its next delivery must find p1 settled.
    assert r.smembers(lease.generated_key) == {b"p1"}
    assert b'"done"' in r.lindex(lease.attempts_key, 0)


def test_finishing_acknowledges_and_giving_back_expires_the_lease(r: redis.Redis) -> None:
    deliver(r)
    deliver(r, "other")
    book = LeaseBook(r)
    done, _ = book.start("j", "c1", TAG, "w1")
    returned, _ = book.start("j", "c2", "other", "w1")
    for lease in (done, returned):  # a prompt of each handed off
        lease.write(r, lambda pipe, key=lease.generated_key: pipe.sadd(key, "p1"))
    done.finish(r, "w1")
    returned.give_back(r, "w1", "returned")
    assert r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) is None
    assert not r.hexists(keys.KOMBU_UNACKED, TAG)
    # Score 0: the next sweep, whoever runs it, puts the chunk back on its queue.
    assert r.zscore(keys.KOMBU_UNACKED_INDEX, "other") == 0
    statuses = [r.lindex(lease.attempts_key, 0) for lease in (done, returned)]
    assert b'"done"' in statuses[0] and b'"returned"' in statuses[1]
    # The acked chunk's `generated` set goes with its ack; the returned one's waits for
    # its next delivery.
    assert not r.exists(done.generated_key) and r.exists(returned.generated_key)
    assert not r.exists(done.writes_key) and r.exists(returned.writes_key)
    assert book.take_settled(TAG) and book.take_settled("other")


def test_a_batch_hand_off_writes_each_result_with_its_mark_once(r: redis.Redis) -> None:
    deliver(r)
    lease, _ = LeaseBook(r).start("j", "c1", TAG, "w1")
    stream = keys.results_stream("j")
    assert lease.hand_off(r, stream, [HandOff("p1", b"one"), HandOff("p2", b"two")]) == [True, True]
    # A retry after a lost reply, with one more result: only the new one is written.
    assert lease.hand_off(r, stream, [HandOff("p2", b"two"), HandOff("p3", b"three")]) == [
        False,
        True,
    ]
    assert [fields[b"r"] for _, fields in r.xrange(stream)] == [b"one", b"two", b"three"]
    assert r.smembers(lease.generated_key) == {b"p1", b"p2", b"p3"}
    assert r.ttl(lease.generated_key) > 0


@pytest.mark.parametrize("how", ["redelivered", "restored"])
def test_a_lost_lease_hands_off_nothing(r: redis.Redis, how: str) -> None:
    deliver(r)
    lease, _ = LeaseBook(r).start("j", "c1", TAG, "w1")
    if how == "redelivered":
        LeaseBook(r).start("j", "c1", TAG, "w2")
    else:
        r.zrem(keys.KOMBU_UNACKED_INDEX, TAG)  # kombu's sweep restored it
    with pytest.raises(LeaseLost):
        lease.hand_off(r, keys.results_stream("j"), [HandOff("p1", b"one")])
    assert lease.lost.is_set()
    assert r.xlen(keys.results_stream("j")) == 0 and not r.exists(lease.generated_key)


@pytest.mark.parametrize("lost", [True, False])
def test_a_rollback_that_lost_a_write_of_the_delivery_refuses_its_ack(
    r: redis.Redis, lost: bool
) -> None:
    """Redis goes back to a copy taken mid-delivery. If the copy lacks a hand-off of
    this delivery, the ack is refused and the delivery stays in kombu's keys for the
    sweep to bring back; if it lacks nothing of it, the delivery goes on."""
    deliver(r)
    lease, _ = LeaseBook(r).start("j", "c1", TAG, "w1")
    stream = keys.results_stream("j")
    lease.hand_off(r, stream, [HandOff("p1", b"one")])
    copy = dump_all(r)
    if lost:
        lease.hand_off(r, stream, [HandOff("p2", b"two")])
    restore_all(r, copy)
    if not lost:
        lease.finish(r, "w1")
        assert r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) is None
        return
    with pytest.raises(LeaseLost, match="Redis lost writes"):
        lease.finish(r, "w1")
    assert r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) is not None and r.hexists(
        keys.KOMBU_UNACKED, TAG
    )
    assert r.smembers(lease.generated_key) == {b"p1"}, "the next delivery redoes p2"
    with pytest.raises(LeaseLost):
        lease.hand_off(r, stream, [HandOff("p3", b"three")])
    assert r.xlen(stream) == 1


def test_a_write_found_landed_after_its_reply_was_lost_counts_for_the_rollback_check(
    r: redis.Redis,
) -> None:
    deliver(r)
    lease, _ = LeaseBook(r).start("j", "c1", TAG, "w1")
    copy = dump_all(r)
    # A dead letter lands but its reply is lost: Redis counts the write, the worker not.
    r.sadd(lease.generated_key, "p1")
    r.set(lease.writes_key, 1)
    assert not lease.write(r, lambda pipe: note(pipe, "p1"), prompt_id="p1")  # the retry
    restore_all(r, copy)  # Redis goes back to before that write
    with pytest.raises(LeaseLost, match="Redis lost writes"):
        lease.finish(r, "w1")


def test_a_worker_killed_mid_sweep_holds_the_restore_lock_for_seconds_not_minutes(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu takes `unacked_mutex` for each sweep with a 300 s expiry by default: a worker
    killed inside a sweep (the chaos harness, turns seed 29) stopped every restore for
    five minutes, its chunks with them. The lock a sweep takes now expires within
    UNACKED_MUTEX_EXPIRE_S, seen from inside a real sweep, where a kill would leave it."""
    from regen.common.celery_app import make_app

    message = b'[{"body": "", "properties": {"delivery_tag": "t"}}, "", "q"]'
    r.zadd(keys.KOMBU_UNACKED_INDEX, {"t": 1.0})  # its lease long gone
    r.hset(keys.KOMBU_UNACKED, "t", message)
    seen: list[int] = []
    with make_app(redis_url).connection_for_write() as connection:
        qos = connection.default_channel.qos
        key = qos.unacked_mutex_key
        assert key == keys.KOMBU_UNACKED_MUTEX
        monkeypatch.setattr(type(qos), "restore_by_tag", lambda self, tag, client=None,
                            leftmost=False: seen.append(r.pttl(key)))  # fmt: skip
        qos.restore_visible(interval=1)
    (held_ms,) = seen
    assert 0 < held_ms <= defaults.UNACKED_MUTEX_EXPIRE_S * 1000
    assert defaults.UNACKED_MUTEX_EXPIRE_S < defaults.VISIBILITY_TIMEOUT_S
