"""A worker on a slow server leaves a job's last prompts to faster servers
(consumers/generate/placement/stand_down.py; docs/design/placement.md, "Faster servers
take the end")."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
import redis
from rich.console import Console

from regen.common import jobspec, keys
from regen.common.celery_app import make_app
from regen.common.chunk_message import ChunkMessages
from regen.common.queues import publishing
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_runner import run_chunk
from regen.consumers.generate.engine_loop import EngineRunner
from regen.consumers.generate.placement.answer_stats import MIN_ANSWERS, AnswerStats
from regen.consumers.generate.placement.peers import CACHE_S, PeerRoom, PeerView
from regen.consumers.generate.placement.stand_down import FASTER, StandDown, leave_below
from regen.ops.reconcile import reconcile
from regen.ops.status_snapshot import snapshot
from regen.ops.status_view import job_table
from regen.producer.enqueue import Enqueuer
from regen.producer.publishing_mark import RENEW_S, TTL_S, PublishingMark
from regen.producer.spec import JobOptions, prepare_job
from tests.generate.test_unstarted_give_back import deliver, queued_chunks
from tests.support.generate_harness import (
    Worker,
    all_generated,
    attempts,
    enqueue_prompts,
    enqueued_ids,
    job_on_a_small_server,
    results,
)
from tests.support.helpers import wait_for, write_jsonl

QUEUE = keys.generate_queue("j")


def room(slots: int, decode_tps: float) -> PeerRoom:
    return PeerRoom(idle=0, short=0, seen=0.0, slots=slots, decode_tps=decode_tps)


def test_the_bound_is_how_many_prompts_the_faster_peers_finish_in_a_long_answers_lead() -> None:
    # The bench's two-speed fleet: 32 slots at 20 ms per token against 80 ms here. The
    # fast server runs 32 x 50 = 1,600 tokens/s; a mean (2,000-token) answer ends
    # 120 s later here, in which the fast server runs 96 of them.
    assert leave_below([room(32, 50.0)], 12.5, 1.0) == pytest.approx(96.0)
    # A long answer (twice the mean) ends twice as late here: twice the prompts.
    assert leave_below([room(32, 50.0)], 12.5, 2.0) == pytest.approx(192.0)
    # Two faster peers: their throughput adds, their speed is slot-weighted.
    both = leave_below([room(32, 50.0), room(32, 25.0)], 12.5, 1.0)
    assert both == pytest.approx(2400 * (1 / 12.5 - 64 / 2400))
    # No faster peer, or none with slots: nothing to leave to.
    assert leave_below([], 12.5, 2.0) == 0.0
    assert leave_below([room(0, 50.0)], 12.5, 2.0) == 0.0


def test_answer_stats_wait_for_enough_answers_and_skip_short_ones_for_speed() -> None:
    stats = AnswerStats()
    for _ in range(MIN_ANSWERS - 1):
        stats.add(100, 2.0)
    assert stats.decode_tps() is None and stats.long_over_mean() is None
    stats.add(100, 2.0)
    assert stats.decode_tps() == pytest.approx(50.0)
    assert stats.long_over_mean() == pytest.approx(1.0)
    # A 4-token answer in 1 s is mostly overhead: not read as 4 tokens/s.
    for _ in range(MIN_ANSWERS):
        stats.add(4, 1.0)
    assert stats.decode_tps() == pytest.approx(50.0)
    # Nine answers of 100 tokens for every one of 1,000: the 90th percentile is 1,000.
    spread = AnswerStats()
    for i in range(100):
        spread.add(1000 if i % 10 == 0 else 100, 1.0)
    assert spread.long_over_mean() == pytest.approx(1000 / 190)


def beat(
    r: redis.Redis, name: str, decode_tps: float | None, slots: int = 32, queue: str = QUEUE
) -> None:
    """A fresh heartbeat of another generate worker on `queue`, its slots full."""
    record = {"kind": "generate", "healthy": True, "queues": [queue], "idle_slots": 0,
              "short": 0, "slots": slots, "decode_tps": decode_tps,
              "last_seen": time.time() + 3600}  # fmt: skip
    r.hset(keys.WORKERS, name, orjson.dumps(record))


def measured(decode_tps: float, tokens: int = 2000) -> AnswerStats:
    stats = AnswerStats()
    for _ in range(MIN_ANSWERS):
        stats.add(tokens, tokens / decode_tps)
    return stats


def queue_chunks(r: redis.Redis, count: int) -> None:
    """`count` chunks on QUEUE (what is on it does not matter: only how many)."""
    r.delete(QUEUE)
    if count:
        r.lpush(QUEUE, *[b"chunk"] * count)


def stand_down(r: redis.Redis, answers: AnswerStats, chunk_size: int = 8) -> StandDown:
    peers = PeerView(r, "generate@me:1")
    return StandDown(r, peers, answers, lambda: {QUEUE}, lambda job: chunk_size)


def test_a_slow_worker_leaves_a_queue_the_faster_peers_would_finish_sooner(
    r: redis.Redis,
) -> None:
    beat(r, "generate@fast:1", 50.0)  # bound: 96 prompts (12 chunks of 8)
    decision = stand_down(r, measured(12.5))
    queue_chunks(r, 13)  # 104 queued: the fast server would still be busy when ...
    decision.look()
    assert decision.left() == set() and not decision.leaves(QUEUE)
    queue_chunks(r, 11)  # ... 88 queued: a long answer here ends after it is done
    decision.look()
    assert decision.left() == {QUEUE} and decision.leaves(QUEUE)
    # It stays away however the queue grows (the prompts it gave back as it left come
    # back in chunks of at most 8, each read as a whole one) ...
    queue_chunks(r, 100)
    decision.look()
    assert decision.leaves(QUEUE)
    # ... until a producer publishes the job's rows again ...
    PublishingMark(r, "j").renew_if_due()
    decision.look()
    assert not decision.leaves(QUEUE)
    PublishingMark(r, "j").clear()
    queue_chunks(r, 11)
    decision.look()
    assert decision.leaves(QUEUE)
    # ... or no faster peer is left.
    r.hdel(keys.WORKERS, "generate@fast:1")
    time.sleep(CACHE_S)  # the peers' beats are read at most every CACHE_S
    decision.look()
    assert not decision.leaves(QUEUE)


def test_no_stand_down_without_a_faster_peer_or_a_speed_or_while_a_producer_publishes(
    r: redis.Redis,
) -> None:
    queue_chunks(r, 1)
    # A peer of the same kind (within FASTER of this one's speed): never.
    beat(r, "generate@twin:1", 12.5 * FASTER * 0.99)
    decision = stand_down(r, measured(12.5))
    decision.look()
    assert not decision.leaves(QUEUE)
    # This worker's speed not measured yet: nothing to compare.
    beat(r, "generate@fast:1", 50.0)
    unmeasured = stand_down(r, AnswerStats())
    unmeasured.look()
    assert not unmeasured.leaves(QUEUE)
    # A faster peer whose speed is not measured yet: not counted.
    r.hdel(keys.WORKERS, "generate@fast:1")
    beat(r, "generate@new:1", None)
    decision = stand_down(r, measured(12.5))
    decision.look()
    assert not decision.leaves(QUEUE)
    # A producer publishing the job's rows refills the queue: its length says nothing.
    beat(r, "generate@fast:1", 50.0)
    PublishingMark(r, "j").renew_if_due()
    decision = stand_down(r, measured(12.5))
    decision.look()
    assert not decision.leaves(QUEUE)
    PublishingMark(r, "j").clear()
    decision.look()
    assert decision.leaves(QUEUE)


def test_the_publishing_mark_is_renewed_by_the_producers_loop_and_expires(
    r: redis.Redis,
) -> None:
    now = [0.0]
    mark = PublishingMark(r, "j", clock=lambda: now[0])
    mark.renew_if_due()
    assert publishing(r, "j") and 0 < r.ttl(keys.job_publishing("j")) <= TTL_S
    r.expire(keys.job_publishing("j"), 5)
    now[0] += RENEW_S - 1
    mark.renew_if_due()  # not due: the key keeps its shorter expiry
    assert r.ttl(keys.job_publishing("j")) <= 5
    now[0] += 1
    mark.renew_if_due()
    assert r.ttl(keys.job_publishing("j")) > 5
    mark.clear()
    assert not publishing(r, "j")


def test_enqueue_marks_the_job_while_it_publishes_and_clears_it_after(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    seen: list[bool] = []

    def room_made(stats: object) -> None:
        # The producer waits for room (high water 1): it is publishing; make room.
        seen.append(publishing(r, "g"))
        r.delete(keys.generate_queue("g"))

    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt": f"p{i}"} for i in range(12)])
    prepared = prepare_job(JobOptions(job="g", model="smollm2", chunk_size=4))
    jobspec.save(r, prepared.spec)
    Enqueuer(r, make_app(redis_url), prepared, high_water=1, on_progress=room_made).run([path])
    # Marked at each wait for room; the last report comes once it is done and cleared.
    assert len(seen) >= 3 and all(seen[:-1]) and not seen[-1]
    assert not publishing(r, "g")


class UnusedEngine:
    """An engine a delivery that starts nothing must never call."""

    async def generate(self, request: object, **options: object) -> None:
        raise AssertionError("a worker leaving the job's end started a prompt")

    def capacity(self) -> int:
        return 8

    async def close(self) -> None:
        return None


def test_a_delivery_taken_while_leaving_starts_nothing_and_gives_every_prompt_back(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """A chunk kombu delivered just as the worker left the job's end: none of its
    prompts start (not even the one a delivery otherwise always starts); all go back to
    the queue in new chunks, and the chunk itself is done."""
    spec = enqueue_prompts(redis_url, tmp_path, [f"p{i}" for i in range(8)], chunk_size=8)
    chunk, tag = deliver(redis_url, spec)
    runner = EngineRunner(UnusedEngine())  # type: ignore[arg-type]
    try:
        messages = ChunkMessages(make_app(redis_url))
        ctx = ChunkContext(redis=r, runner=runner, messages=messages,
                           room=lambda used: 8 - used, leaving=lambda queue: True)  # fmt: skip
        outcome = run_chunk(ctx, chunk, tag)
    finally:
        runner.close()
    assert outcome.generated == 0 and outcome.dead_lettered == 0
    back = queued_chunks(r, spec.queue)
    assert sorted(p.id for c in back for p in c.prompts) == sorted(p.id for p in chunk.prompts)
    assert attempts(r, "g", chunk.chunk_id)[-1]["status"] == "done"
    assert ctx.inflight == 0 and ctx.waiting == 0


def test_a_slow_worker_gives_back_and_stops_taking_then_takes_again_when_alone(
    tmp_path: Path,
) -> None:
    """A real worker on a slow stand-in with a much faster peer in the heartbeats:
    once its own speed is measured, it starts nothing more of the job, gives back
    what it holds and takes no chunk; with the peer gone it takes the queue again,
    and every prompt is generated exactly once, none started twice."""
    prompts = [f"Tell me about mountain number {i}." for i in range(48)]
    with job_on_a_small_server(tmp_path, prompts, chunk_size=4) as (url, server, r, spec):
        # 20x faster, 1,000 slots: it would finish any queue before a long answer here.
        beat(r, "generate@fast:1", 1000.0, slots=1000, queue=spec.queue)
        common = ["--engine", "sglang", "--max-inflight", "4", "--jobs", "g"]
        with Worker(url, tmp_path, *common, "--server", server.url) as worker:
            wait_for(lambda: "leaving the last prompts of" in worker.log(), timeout=120,
                     what="the worker to leave the job's end to the faster peer")  # fmt: skip
            wait_for(lambda: orjson.loads(r.hget(keys.WORKERS, worker.name))["queues"] == [],
                     timeout=30, what="its heartbeat to drop the queue")  # fmt: skip
            wait_for(lambda: server.stats()["running"] == 0, timeout=30,
                     what="its running answers to finish")  # fmt: skip
            started = server.stats()["requests_total"]
            assert 8 <= started < len(prompts)
            # `regen status` counts it apart: the fast peer consumes the queue, it left.
            (job,) = snapshot(r, "g")["jobs"]
            assert job["workers"]["generate"] == 1 and job["workers"]["left_to_faster"] == 1
            shown = Console(width=200, record=True)
            shown.print(job_table(job))
            assert "1 generate (+1 left the end to faster servers)" in shown.export_text()
            # Standing down, it starts nothing: the rest stay on the queue.
            time.sleep(3)
            assert server.stats()["requests_total"] == started
            assert r.llen(spec.queue) > 0
            r.hdel(keys.WORKERS, "generate@fast:1")
            wait_for(lambda: all_generated(r, spec), timeout=120, what="the job")
            assert f"taking {spec.queue} again" in worker.log()
        ids = [res.id for res in results(r, "g")]
        assert sorted(ids) == sorted(enqueued_ids(r, "g"))
        assert server.stats()["requests_total"] == len(prompts)
        report = reconcile(r, spec, None, read_shards=False)
        assert report.places["in_flight"] == len(prompts) and not report.problem_counts
