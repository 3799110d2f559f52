"""A delivery gives back the prompts its worker cannot start soon, as new chunks on the
queue, under its lease (consumers/generate/chunk_life/unstarted.py; docs/design/placement.md,
"Only what can start soon")."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import orjson
import pytest
import redis
from kombu import Connection, Queue

from regen.common import keys
from regen.common.celery_app import broker, make_app
from regen.common.chunk import Chunk
from regen.common.chunk_message import ChunkMessages
from regen.common.jobspec import JobSpec
from regen.common.ledger.places import count_places
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import (
    ChunkLease,
    LeaseBook,
    LeaseLost,
    give_back_unstarted,
    read_generated,
)
from regen.consumers.generate.placement.flow_control import HOLD_OFF_S, chunk_limit, keeps_slack
from regen.consumers.generate.placement.peers import CACHE_S, CLAIM_S, FRESH_S, TAKE_S, PeerView
from regen.ops.reconcile import reconcile
from tests.support.generate_harness import (
    Worker,
    all_generated,
    attempts,
    enqueue_prompts,
    enqueued_ids,
    job_on_a_small_server,
    result_ids,
    results,
)
from tests.support.helpers import wait_for
from tests.support.redis_server import running_redis
from tests.support.sglang_standin.process import run_standin

PROMPTS = [f"Question {i}: name a river of the world." for i in range(20)]


def deliver(url: str, spec: JobSpec) -> tuple[Chunk, str]:
    """Take the job's next chunk off its queue as a generate worker's kombu does: into
    `unacked`, under a delivery tag. Returns the chunk and the tag."""
    make_app(url)  # registers regen's chunk serializer with kombu
    broker_url, options = broker(url)
    with Connection(broker_url, transport_options=options) as connection:
        channel = connection.channel()
        message = Queue(spec.queue, channel=channel).get(no_ack=False)
        assert message is not None
        args, _, _ = message.decode()
        # Left unacked: the channel must not restore it when it closes.
        channel.do_restore = False
        return Chunk.from_payload(args[0]), message.delivery_tag


def queued_chunks(r: redis.Redis, queue: str) -> list[Chunk]:
    """The chunks on `queue`, in the order BRPOP takes them."""
    chunks = []
    for raw in reversed(r.lrange(queue, 0, -1)):
        body = orjson.loads(base64.b64decode(orjson.loads(raw)["body"]))
        chunks.append(Chunk.from_payload(body[0][0]))
    return chunks


def start(r: redis.Redis, chunk: Chunk, tag: str) -> ChunkLease:
    lease, _ = LeaseBook(r).start(chunk.job, chunk.chunk_id, tag, "test-worker")
    return lease


def test_prompts_given_back_are_open_in_new_chunks_alone(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS, chunk_size=20)
    chunk, tag = deliver(redis_url, spec)
    lease = start(r, chunk, tag)
    messages = ChunkMessages(make_app(redis_url))
    given = give_back_unstarted(r, messages, spec.queue, lease, chunk, chunk.prompts[8:])
    # 12 prompts in chunks of at most 8, queued at the end BRPOP takes first.
    assert given == 2
    back = queued_chunks(r, spec.queue)
    assert [len(c.prompts) for c in back] == [8, 4]
    assert [p.id for c in back for p in c.prompts] == [p.id for p in chunk.prompts[8:]]
    assert {c.chunk_id for c in back}.isdisjoint({chunk.chunk_id})
    assert read_generated(r, chunk) == {p.id for p in chunk.prompts[8:]}
    sizes = r.hgetall(keys.job_chunks(spec.name))
    assert {k.decode(): int(v) for k, v in sizes.items()} == {
        chunk.chunk_id: 20,
        **{c.chunk_id: len(c.prompts) for c in back},
    }
    # Every prompt in one place: the 8 kept in flight, the 12 waiting in the new chunks.
    places = count_places(r, spec)
    assert (places.generating, places.waiting, places.unplaced) == (8, 12, 0)
    report = reconcile(r, spec, None, read_shards=False)
    assert not report.problem_counts, report.problems
    assert report.places["in_flight"] == 8 and report.places["waiting"] == 12


def test_a_retried_give_back_queues_nothing_twice(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """The script landed but its reply was lost: the retry (same write count) finds its
    prompts settled and writes nothing more."""
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS, chunk_size=20)
    chunk, tag = deliver(redis_url, spec)
    lease = start(r, chunk, tag)
    messages = ChunkMessages(make_app(redis_url))
    give_back_unstarted(r, messages, spec.queue, lease, chunk, chunk.prompts[10:])
    lease.writes -= 1  # as if the reply never came
    give_back_unstarted(r, messages, spec.queue, lease, chunk, chunk.prompts[10:])
    assert r.llen(spec.queue) == 2
    assert r.hlen(keys.job_chunks(spec.name)) == 3


def test_a_delivery_that_lost_its_chunk_gives_nothing_back(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS, chunk_size=20)
    chunk, tag = deliver(redis_url, spec)
    lease = start(r, chunk, tag)
    start(r, chunk, tag)  # a later delivery of the chunk started: this one lost it
    with pytest.raises(LeaseLost):
        give_back_unstarted(
            r, ChunkMessages(make_app(redis_url)), spec.queue, lease, chunk, chunk.prompts[4:]
        )
    assert r.llen(spec.queue) == 0
    assert read_generated(r, chunk) == set()
    assert r.hlen(keys.job_chunks(spec.name)) == 1


def idle_peer(r: redis.Redis, queue: str, idle_slots: int = 4) -> None:
    """A heartbeat of another generate worker on `queue` with idle slots."""
    beat = {"kind": "generate", "healthy": True, "queues": [queue], "idle_slots": idle_slots,
            "last_seen": time.time()}  # fmt: skip
    r.hset(keys.WORKERS, "generate@peer:1", orjson.dumps(beat))


def test_a_peer_counts_when_fresh_healthy_on_the_queue_and_idle(r: redis.Redis) -> None:
    now = [1000.0]
    view = PeerView(r, "generate@me:1", clock=lambda: now[0])
    beat = {"kind": "generate", "healthy": True, "queues": ["q"], "idle_slots": 3,
            "last_seen": 1000.0}  # fmt: skip
    r.hset(keys.WORKERS, mapping={
        "generate@a:1": orjson.dumps(beat),
        "generate@me:1": orjson.dumps({**beat, "idle_slots": 50}),  # itself: not a peer
        "generate@b:1": orjson.dumps({**beat, "healthy": False}),
        "generate@c:1": orjson.dumps({**beat, "queues": ["other"]}),
        "tokenize@d:1": orjson.dumps({**beat, "kind": "tokenize"}),
        "generate@e:1": orjson.dumps({**beat, "last_seen": 1000.0 - FRESH_S - 1}),
    })  # fmt: skip
    assert view.idle_slots("q") == 3 and view.idle_slots("other") == 3
    r.hset(keys.WORKERS, "generate@a:1", orjson.dumps({**beat, "idle_slots": 0}))
    assert view.idle_slots("q") == 3  # read at most every CACHE_S
    now[0] += CACHE_S
    assert view.idle_slots("q") == 0
    now[0] += FRESH_S
    r.hset(keys.WORKERS, "generate@c:1", orjson.dumps({**beat, "queues": ["other"]}))
    assert view.idle_slots("other") == 0  # every heartbeat stale now


def test_slots_given_prompts_count_as_taken_until_the_peers_beat_again(
    r: redis.Redis,
) -> None:
    """A peer's heartbeat says 8 idle slots for up to 10 s after it filled them: prompts
    given back for 5 of them leave 3 to give for, not 8 again at the next look."""
    now = [1000.0]
    view = PeerView(r, "generate@me:1", clock=lambda: now[0])
    beat = {"kind": "generate", "healthy": True, "queues": ["q"], "idle_slots": 8,
            "last_seen": 1000.0}  # fmt: skip
    r.hset(keys.WORKERS, "generate@a:1", orjson.dumps(beat))
    assert view.idle_slots("q") == 8
    assert view.claim("q", 5) == 5
    assert view.idle_slots("q") == 3 and view.idle_slots("other") == 0
    assert view.claim("q", 5) == 3  # only what is left
    assert view.idle_slots("q") == 0 and view.claim("q", 5) == 0
    now[0] += CLAIM_S
    r.hset(keys.WORKERS, "generate@a:1", orjson.dumps({**beat, "last_seen": now[0]}))
    assert view.idle_slots("q") == 8  # a later beat tells again


def test_a_peer_short_of_its_slack_gets_only_prompts_beyond_the_givers_slack(
    r: redis.Redis,
) -> None:
    """A fast peer with every slot busy but no slack waiting says it is short 3: each
    slot that frees would idle for the give-back's round trip. A giver gives for that
    only what it holds beyond its own slack (so slack never comes back to it), and
    for idle slots any waiting prompt."""
    now = [1000.0]
    view = PeerView(r, "generate@me:1", clock=lambda: now[0])
    beat = {"kind": "generate", "healthy": True, "queues": ["q"], "idle_slots": 0,
            "short": 3, "last_seen": 1000.0}  # fmt: skip
    r.hset(keys.WORKERS, "generate@a:1", orjson.dumps(beat))
    assert view.idle_slots("q") == 0  # not idle: flow control keeps its slack
    assert view.claim("q", 10) == 0  # nothing beyond the giver's slack: none
    assert view.claim("q", 10, beyond_slack=2) == 2
    assert view.claim("q", 10, beyond_slack=5) == 1  # the 3 it is short, less 2 given
    r.hset(keys.WORKERS, "generate@b:1", orjson.dumps({**beat, "idle_slots": 4, "short": 0}))
    now[0] += CACHE_S
    assert view.claim("q", 10) == 4  # idle slots take any waiting prompt (b's short: 4)


def test_a_claim_ends_once_the_peers_beat_after_taking_the_prompts(r: redis.Redis) -> None:
    """A peer beats within a second or two of taking the given-back chunk (its idle
    slots changed): that beat counts them, so the claim no longer does, and slots that
    freed since are given for at once, not after CLAIM_S. A full peer (no room: its
    flow control takes nothing) beats only on its interval: it is not waited for."""
    now = [1000.0]
    view = PeerView(r, "generate@me:1", clock=lambda: now[0])
    beat = {"kind": "generate", "healthy": True, "queues": ["q"], "idle_slots": 4,
            "last_seen": 1000.0}  # fmt: skip
    r.hset(keys.WORKERS, "generate@a:1", orjson.dumps(beat))
    r.hset(keys.WORKERS, "generate@full:1",
           orjson.dumps({**beat, "idle_slots": 0, "short": 0}))  # fmt: skip
    assert view.claim("q", 4) == 4
    now[0] += 1.0  # a beat before it could have taken them: still claimed
    r.hset(keys.WORKERS, "generate@a:1", orjson.dumps({**beat, "last_seen": now[0]}))
    assert view.idle_slots("q") == 0
    now[0] += TAKE_S  # took the 4, and 2 more slots freed since
    r.hset(keys.WORKERS, "generate@a:1",
           orjson.dumps({**beat, "idle_slots": 2, "last_seen": now[0]}))  # fmt: skip
    assert view.idle_slots("q") == 2
    assert CLAIM_S > 2 * TAKE_S + CACHE_S


def test_a_delivery_starts_what_its_slots_take_and_at_least_one(r: redis.Redis) -> None:
    """32 free slots: a 64-prompt chunk starts 32 and 32 wait in it, whatever rate the
    slots finish at (prompts sent to the engine can no longer go to another worker); a
    second chunk arriving at once starts one (progress), not another 32. Flow control
    counts the waiting ones as held."""
    ctx = ChunkContext(redis=r, runner=None)  # type: ignore[arg-type]
    ctx.room = lambda running: 32 - running
    ctx.messages = object()  # type: ignore[assignment]
    ctx.count_waiting(64)
    assert ctx.reserve(64) == 32
    ctx.count_waiting(64)
    assert ctx.reserve(64) == 1
    assert ctx.reserve(63, at_least=0) == 0  # a running delivery waits for a free slot
    assert (ctx.inflight, ctx.waiting, ctx.outstanding) == (33, 95, 128)
    # Without a renderer (an engine run in a test, a tool) a delivery starts it all.
    plain = ChunkContext(redis=r, runner=None)  # type: ignore[arg-type]
    assert plain.reserve(64) == 64


def test_while_peers_idle_flow_control_takes_chunks_only_for_free_slots() -> None:
    """Slack (prompts waiting beyond the slots) is for a worker alone on its queue;
    while another worker has idle slots it would only keep prompts from it."""
    assert chunk_limit(30, 32, 1, 4.0, 64) == 2  # alone: room for slack, one more chunk
    assert chunk_limit(32, 32, 1, 4.0, 64, with_slack=False) == 1  # full: none more
    assert chunk_limit(30, 32, 1, 4.0, 64, with_slack=False) == 2  # 2 free slots: one


def test_a_worker_that_gave_back_keeps_no_slack_a_moment(r: redis.Redis) -> None:
    """32 slots, all running, just after a give-back: the give-back claimed the peer's
    idle slots, so no peer shows idle here, and with its slack the worker would take a
    chunk at once, perhaps the very one it gave. For HOLD_OFF_S only a slot of its own
    that frees takes a chunk; after, the slack again."""
    ctx = ChunkContext(redis=r, runner=None)  # type: ignore[arg-type]
    ctx.count_inflight(32)
    assert keeps_slack(ctx, peers_idle=False, now=100.0)  # never gave back
    ctx.gave_back_at = 100.0

    def limit(now: float) -> int:
        kept = keeps_slack(ctx, peers_idle=False, now=now)
        return chunk_limit(ctx.outstanding, 32, 1, 0.2, 64, with_slack=kept)

    assert limit(100.0 + HOLD_OFF_S / 2) == 1  # full: none taken
    assert limit(100.0 + HOLD_OFF_S) == 2  # its slack again: one more
    ctx.count_inflight(-1)  # a slot of its own frees during the hold-off: refilled
    assert limit(101.0) == 2
    assert not keeps_slack(ctx, peers_idle=True, now=200.0)  # an idle peer: none either


@pytest.mark.slow
def test_a_worker_that_started_first_leaves_a_second_server_work(tmp_path: Path) -> None:
    """Two servers of 4 slots, answers of ~10 s, one chunk of 32 prompts (the product's
    chunks are larger than many servers' free slots). The first worker takes the chunk
    alone: it starts what its slots start soon and holds the rest, giving nothing back
    while no other worker could take it (the one-server case). Once a second worker
    with idle slots joins, the prompts not started go back to the queue and its server
    serves them. Before, the first worker held all 32 to the end and the second server
    idled. Every prompt is generated once."""
    prompts = [f"Tell me about river number {i}." for i in range(32)]
    with (
        running_redis(tmp_path / "redis") as redis_server,
        run_standin(max_running_requests=4, decode_tokens_per_s=10,
                    output_len_dist="fixed:n=100") as first_server,
        run_standin(max_running_requests=4, decode_tokens_per_s=10,
                    output_len_dist="fixed:n=100") as second_server,
    ):  # fmt: skip
        r = redis.Redis.from_url(redis_server.url)
        spec = enqueue_prompts(redis_server.url, tmp_path, prompts, chunk_size=32)
        common = ["--engine", "sglang", "--max-inflight", "4", "--jobs", "g"]
        with Worker(redis_server.url, tmp_path, *common, "--server", first_server.url) as first:
            # A first round of answers done (~10 s): alone, it gave nothing back.
            wait_for(lambda: first_server.stats()["requests_total"] >= 5, timeout=120,
                     what="the first worker's first answers")  # fmt: skip
            assert r.hlen(keys.job_chunks("g")) == 1
            with Worker(redis_server.url, tmp_path, *common, "--server", second_server.url):
                wait_for(lambda: r.hlen(keys.job_chunks("g")) > 1, timeout=60,
                         what="prompts given back for the second worker")  # fmt: skip
                wait_for(lambda: all_generated(r, spec), timeout=180, what="the job")
        assert "back to the queue" in first.log()
        assert second_server.stats()["requests_total"] > 0
        ids = [res.id for res in results(r, "g")]
        assert sorted(ids) == sorted(enqueued_ids(r, "g")) == sorted(result_ids(r, "g"))
        assert (
            first_server.stats()["requests_total"] + second_server.stats()["requests_total"] == 32
        )  # nothing ran twice
        report = reconcile(r, spec, None, read_shards=False)
        assert report.places["in_flight"] == 32 and not report.problem_counts


@pytest.mark.slow
def test_a_worker_killed_right_after_giving_back_loses_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    """SIGKILL at the worst point: prompts given back, the kept ones not yet started
    (a peer with idle slots is in the heartbeats, so the worker gives back at once).
    The chunk comes back when its lease lapses; its next delivery skips what was given
    back, the new chunks run once, and every prompt is generated exactly once."""
    prompts = [f"Tell me about lake number {i}." for i in range(16)]
    with job_on_a_small_server(tmp_path, prompts, chunk_size=16) as (url, server, r, spec):
        (published,) = [k.decode() for k in r.hkeys(keys.job_chunks("g"))]
        common = ["--engine", "sglang", "--max-inflight", "4", "--jobs", "g"]
        common += ["--server", server.url]
        idle_peer(r, spec.queue)
        # One chunk at most (`--concurrency 1`): with room for a second, kombu waits on
        # the queue, pops a chunk the give-back just pushed, and the crash loses it in
        # kombu's window (only the job's follower heals that: test_heal_lost_chunk.py);
        # the job then never ended (twice under CI load).
        crashing = Worker(url, tmp_path, *common, "--concurrency", "1",
                          env={"REGEN_CRASHPOINT": "generate.after_give_back"})  # fmt: skip
        crashing.process.wait(timeout=120)
        crashing.kill()  # its process group
        # It started its 4 slots' prompts (some may not have reached the server), and
        # gave back as many of the 12 waiting as the peer has idle slots.
        started_before = server.stats()["requests_total"]
        assert started_before <= 4
        assert len(r.smembers(keys.chunk_generated("g", published))) == 4
        r.hdel(keys.WORKERS, "generate@peer:1")
        with Worker(url, tmp_path, *common):
            wait_for(lambda: all_generated(r, spec), timeout=180, what="the job")
        history = [a["status"] for a in attempts(r, "g", published)]
        assert history == ["started", "done"]  # the dead delivery, then the one that ran
        ids = [res.id for res in results(r, "g")]
        assert sorted(ids) == sorted(enqueued_ids(r, "g"))
        assert server.stats()["requests_total"] == 16 + started_before
        report = reconcile(r, spec, None, read_shards=False)
        assert report.places["in_flight"] == 16 and not report.problem_counts
