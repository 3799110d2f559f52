"""`regen enqueue --follow` (producer/healer.py) on a fake clock: ids in no place in two
readings a grace apart are queued again, once; never while Redis is behind the disk."""

from __future__ import annotations

from pathlib import Path

import orjson
import redis
from click.testing import CliRunner

from regen.cli import main
from regen.common import jobspec, keys
from regen.common.ledger.job_ids import JobIds
from regen.common.queues import queue_lists
from regen.producer.healer import Follower
from tests.producer.test_enqueue import enqueue, queued_prompts
from tests.support.helpers import decode_message, write_jsonl

GRACE_S = 90.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lose_a_chunk(r: redis.Redis) -> set[str]:
    """Pop a chunk as a worker killed inside kombu's window would: gone from the queue,
    never in `unacked`; its ids."""
    (queue,) = [name for name in queue_lists(jobspec.load(r, "j").queue) if r.llen(name)]
    return {p["id"] for p in decode_message(r.rpop(queue))["prompts"]}


def follower(redis_url: str, r: redis.Redis, dataset: Path, clock: FakeClock) -> Follower:
    def publish() -> None:
        enqueue(redis_url, [dataset], chunk_size=2)

    def store_spec() -> None:
        raise AssertionError("the spec is there")

    following = Follower(r, "j", publish, store_spec, clock=clock, sleep=lambda s: None,
                         poll_s=30.0, grace_s=GRACE_S)  # fmt: skip
    following._enqueue()  # the publishing pass of `run`
    return following


def test_ids_in_no_place_past_the_grace_are_queued_again_once(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    rows = [{"prompt": f"Question {i}: what is {i} times {i}?"} for i in range(6)]
    dataset = write_jsonl(tmp_path / "q.jsonl", rows)
    clock = FakeClock()
    following = follower(redis_url, r, dataset, clock)
    before = {p["id"] for p in queued_prompts(r)}
    assert following.step() is False and following.suspects is None  # all placed
    lost = lose_a_chunk(r)

    assert following.step() is False  # first reading
    assert following.suspects is not None and following.suspects[1] == lost
    clock.now += GRACE_S - 1
    assert following.step() is False  # within the grace: nothing queued
    assert following.requeued == 0 and {p["id"] for p in queued_prompts(r)} == before - lost
    clock.now += 1
    following.step()
    assert following.requeued == 2
    queued = [p["id"] for p in queued_prompts(r)]
    assert sorted(queued) == sorted(before), "each prompt queued once"
    assert r.exists(keys.job_follower("j")), "the follower beats"
    verified = CliRunner().invoke(main, ["verify", "--job", "j", "--no-shards",
                                         "--redis-url", redis_url])  # fmt: skip
    assert verified.exit_code == 0, verified.output
    clock.now += 2 * GRACE_S
    following.step()
    assert following.requeued == 2, "nothing more"


def test_a_chunk_delivered_between_two_readings_is_not_queued_again(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    rows = [{"prompt": f"Question {i}: what is {i} times {i}?"} for i in range(4)]
    dataset = write_jsonl(tmp_path / "q.jsonl", rows)
    clock = FakeClock()
    following = follower(redis_url, r, dataset, clock)
    (queue,) = [name for name in queue_lists(jobspec.load(r, "j").queue) if r.llen(name)]
    message = r.rpop(queue)  # being delivered: popped, not yet in unacked
    following.step()
    assert following.suspects is not None
    r.rpush(queue, message)  # the delivery went through (back in a place)
    clock.now += GRACE_S
    following.step()
    assert following.requeued == 0 and following.suspects is None
    assert len(queued_prompts(r)) == 4


def test_nothing_is_forgotten_or_queued_while_redis_is_behind_the_disk(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    rows = [{"prompt": f"Question {i}: what is {i} times {i}?"} for i in range(6)]
    dataset = write_jsonl(tmp_path / "q.jsonl", rows)
    clock = FakeClock()
    following = follower(redis_url, r, dataset, clock)
    r.set(keys.shard_seq("j"), 7)
    r.set(keys.job_epoch("j"), 1)
    following.step()  # seen: shard 7, epoch 1
    lost = lose_a_chunk(r)
    ids = set(JobIds(r, "j"))

    # Rolled back: the counter went back, no recovery yet (same epoch).
    r.set(keys.shard_seq("j"), 3)
    for _ in range(4):
        following.step()
        clock.now += GRACE_S
    assert following.requeued == 0
    # The tokenize stage's flag alone holds it too, whatever the counters say.
    r.set(keys.shard_seq("j"), 9)
    r.set(keys.job_behind("j"), "tokenize@host:1")
    for _ in range(4):
        following.step()
        clock.now += GRACE_S
    assert following.requeued == 0
    assert set(JobIds(r, "j")) == ids, "no id forgotten"
    assert not lost & {p["id"] for p in queued_prompts(r)}

    # The recovery ran: flag gone, epoch raised (its counter may be below the one seen).
    r.delete(keys.job_behind("j"))
    r.set(keys.shard_seq("j"), 5)
    r.set(keys.job_epoch("j"), 2)
    following.step()
    clock.now += GRACE_S
    following.step()
    assert following.requeued == 2
    assert lost <= {p["id"] for p in queued_prompts(r)}


def test_a_one_shot_enqueue_returns_once_published(redis_url: str, tmp_path: Path) -> None:
    dataset = write_jsonl(tmp_path / "q.jsonl", [{"prompt": f"Q {i}?"} for i in range(3)])
    result = CliRunner().invoke(main, ["enqueue", str(dataset), "--job", "j", "--model",
                                       "smollm2", "--redis-url", redis_url])  # fmt: skip
    assert result.exit_code == 0, result.output
    r = redis.Redis.from_url(redis_url)
    assert len(queued_prompts(r)) == 3  # published, nothing generated: it returned anyway
    assert not r.exists(keys.job_follower("j")), "no follower left behind"


def test_status_names_the_follower_an_unfinished_job_lacks(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    enqueue(redis_url, [write_jsonl(tmp_path / "q.jsonl", [{"prompt": "Q?"}])])

    def flags() -> list[str]:
        shown = CliRunner().invoke(main, ["status", "--job", "j", "--json",
                                          "--redis-url", redis_url])  # fmt: skip
        assert shown.exit_code == 0, shown.output
        return list(orjson.loads(shown.output)["jobs"][0]["flags"])

    assert any("run the job's enqueue command with --follow" in flag for flag in flags())
    Follower(r, "j", lambda: None, lambda: None, poll_s=30.0).beat()
    assert not any("--follow" in flag for flag in flags())
