"""`regen recover` on a `--turns all` job: turns committed after the copy Redis came back
from are neither lost nor generated again, and the turns after them build on them."""

from __future__ import annotations

import re
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import keys
from regen.common.celery_app import make_app
from regen.common.ledger.places import text
from regen.common.results import GeneratedResult
from regen.consumers.generate.turns import CRASHPOINT
from regen.consumers.tokenize.shard_files import shard_paths
from regen.producer.enqueue import Enqueuer
from tests.generate.test_lost_chunk import regen
from tests.generate.test_turns_stage import (
    TURNS,
    by_turn,
    enqueue,
    kimi_standin,
    records,
    tokenize,
    verified,
    worker,
)
from tests.support.generate_harness import all_acked, result_ids, results
from tests.support.helpers import job_ids, wait_for
from tests.support.sglang_standin.process import StandinHandle
from tests.tokenize.test_redis_restore import dump_all, restore_all

pytestmark = pytest.mark.slow


def first_turn_committed(
    r: redis.Redis, url: str, tmp_path: Path, server: StandinHandle, out: Path, job: str
) -> tuple[GeneratedResult, dict[str, dict[str, Any]]]:
    """A worker that dies right after handing off a conversation's first turn, and that
    turn committed to a shard: (its result, the shard's records)."""
    doomed = worker(url, tmp_path, server, REGEN_CRASHPOINT=CRASHPOINT)
    assert doomed.process.wait(timeout=120) == -signal.SIGKILL, doomed.log()
    (first,) = results(r, job)  # a first turn handed off, then the worker died
    committed = tokenize(r, out, job, 1)  # ... and committed to a shard
    assert list(committed) == [first.id] and first.turn == 0
    return first, committed


def built_on_and_verified(
    url: str,
    out: Path,
    job: str,
    found: dict[str, dict[str, Any]],
    first: GeneratedResult,
    committed: dict[str, dict[str, Any]],
) -> None:
    """The next turn's history holds the committed turn's own answer, and `regen verify`
    and `regen shards verify` pass."""
    conversation = first.conversation_id
    assert conversation is not None
    next_turn = by_turn(found)[conversation, 1]
    assert next_turn["messages"][-3] == committed[first.id]["messages"][-1]
    assert verified(url, job, out)["ok"]
    files = regen(url, "shards", "verify", str(out / job))
    assert files.exit_code == 0, files.output


def test_recover_resumes_conversations_after_their_committed_turns(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, kimi_tokenizer: Any
) -> None:
    spec = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "k").spec
    copy = dump_all(r)  # the backup: the conversations' chunk queued, no turn generated
    out = tmp_path / "out"
    with kimi_standin(kimi_tokenizer_dir) as server:
        first, committed = first_turn_committed(r, redis_url, tmp_path, server, out, "k")

        restore_all(r, copy)  # Redis comes back from the backup: the turn is unknown to it
        recovered = regen(redis_url, "recover", "--job", "k", "--out", str(out))
        assert recovered.exit_code == 0, recovered.output
        assert "1 committed turn(s) of 1 conversation(s) in the chunks" in recovered.output
        assert r.sismember(keys.chunk_generated("k", first.chunk), first.id)

        def rest_generated() -> bool:  # every turn but the committed one
            return result_ids(r, "k") == job_ids(r, "k") - {first.id} and all_acked(r, spec)

        with worker(redis_url, tmp_path, server):
            wait_for(rest_generated, timeout=180, what="every other turn generated")
    after = {res.id for res in results(r, "k")}
    # The committed turn was not generated again; every other turn was, once.
    assert first.id not in after and len(after) == len(results(r, "k")) == TURNS - 1
    found = tokenize(r, out, "k", TURNS)
    assert len(found) == TURNS and len(shard_paths(out / "k")) >= 2
    assert found[first.id] == committed[first.id]
    built_on_and_verified(redis_url, out, "k", found, first, committed)
    assert set(records(out / "k")) == set(found)


def test_recover_resumes_a_conversation_whose_chunk_redis_lost(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, kimi_tokenizer: Any
) -> None:
    """The copy Redis comes back from holds the job's spec but none of its conversations:
    a first turn committed since is in a shard only, its conversation's later turns
    nowhere. Recover saves its answer; the job's enqueue resumes the conversation after it."""
    enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "l", rows=[])  # the spec, no row yet
    copy = dump_all(r)  # the backup: taken before the job's conversations were enqueued
    prepared = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "l")
    spec = prepared.spec
    every_turn = job_ids(r, "l")
    assert len(every_turn) == TURNS
    out = tmp_path / "out"
    with kimi_standin(kimi_tokenizer_dir) as server:
        first, committed = first_turn_committed(r, redis_url, tmp_path, server, out, "l")

        restore_all(r, copy)  # Redis comes back without the job's conversations
        recovered = regen(redis_url, "recover", "--job", "l", "--out", str(out))
        assert recovered.exit_code == 0, recovered.output
        assert "answers of 1 committed turn(s) of 1 conversation(s)" in recovered.output
        stats = Enqueuer(r, make_app(redis_url), prepared, high_water=100).run(
            [tmp_path / "l.jsonl"]
        )  # the job's enqueue, run again
        assert stats.conversations_resumed == 1
        # Every turn is in the job again; the committed one marked generated in its chunk.
        assert job_ids(r, "l") == every_turn
        assert not r.exists(keys.recovered_answers("l"))

        def rest_generated() -> bool:  # every turn but the committed one
            return result_ids(r, "l") == every_turn - {first.id} and all_acked(r, spec)

        with worker(redis_url, tmp_path, server):
            wait_for(rest_generated, timeout=180, what="every other turn generated")
    assert len(results(r, "l")) == TURNS - 1  # the committed turn not generated again
    found = tokenize(r, out, "l", TURNS)
    assert set(found) == every_turn and found[first.id] == committed[first.id]
    built_on_and_verified(redis_url, out, "l", found, first, committed)


def test_recover_resumes_a_conversation_whose_chunk_was_lost_in_kombus_window(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, kimi_tokenizer: Any
) -> None:
    """A redelivered chunk of conversations lost in kombu's window (popped, never in
    `unacked`, as when Redis dies mid-reply; the chaos harness's single seed 134 on the
    turn path) while a shard holds a first turn: `regen verify` names the other turns
    missing, `regen recover` takes them and the committed turn's conversation out of the
    job's ids with its answer saved, and the job's enqueue resumes that conversation after
    its committed turn and publishes the other one whole."""
    prepared = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "w")
    spec = prepared.spec
    every_turn = job_ids(r, "w")
    out = tmp_path / "out"
    with kimi_standin(kimi_tokenizer_dir) as server:
        first, committed = first_turn_committed(r, redis_url, tmp_path, server, out, "w")
        # The chunk goes back to its queue and is popped again; Redis dies before the
        # pop is recorded in `unacked`: the chunk is in no place.
        (tag,) = [text(t) for t in r.hkeys(keys.KOMBU_UNACKED)]
        r.hdel(keys.KOMBU_UNACKED, tag)
        r.zrem(keys.KOMBU_UNACKED_INDEX, tag)

        lost = every_turn - {first.id}
        found = regen(redis_url, "verify", "--job", "w", "--no-shards")
        assert found.exit_code == 1, found.output
        assert re.search(rf"missing +{len(lost)}\n", found.output), found.output
        recovered = regen(redis_url, "recover", "--job", "w", "--out", str(out))
        assert recovered.exit_code == 0, recovered.output
        # The lost turns, and the committed first turn of the conversation to resume.
        assert f"{len(lost) + 1} id(s) in no place" in recovered.output, recovered.output
        assert "answers of 1 committed turn(s) of 1 conversation(s)" in recovered.output
        stats = Enqueuer(r, make_app(redis_url), prepared, high_water=100).run(
            [tmp_path / "w.jsonl"]
        )  # the job's enqueue, run again
        assert stats.conversations_resumed == 1
        assert job_ids(r, "w") == every_turn

        earlier = [res.id for res in results(r, "w")]

        def rest_generated() -> bool:  # every turn but the committed one
            return result_ids(r, "w") | {first.id} == every_turn and all_acked(r, spec)

        with worker(redis_url, tmp_path, server):
            wait_for(rest_generated, timeout=180, what="every other turn generated")
    generated = Counter(res.id for res in results(r, "w")) - Counter(earlier)
    # Each lost turn generated once; the committed one not again.
    assert generated == Counter(lost)
    found_records = tokenize(r, out, "w", TURNS)
    assert set(found_records) == every_turn
    assert found_records[first.id] == committed[first.id]
    built_on_and_verified(redis_url, out, "w", found_records, first, committed)
