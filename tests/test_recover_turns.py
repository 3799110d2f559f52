"""`regen recover` on a `--turns all` job: turns committed after the copy Redis came back
from are neither lost nor generated again, and the turns after them build on them."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from regen.cli import main
from regen.common import keys
from regen.common.celery_app import make_app
from regen.consumers.generate.turns import CRASHPOINT
from regen.consumers.tokenize.shard_files import shard_paths
from regen.producer.enqueue import Enqueuer
from tests.generate_harness import all_acked, result_ids, results
from tests.helpers import job_ids, wait_for
from tests.test_redis_restore import dump_all, restore_all
from tests.test_turns_stage import (
    TURNS,
    by_turn,
    enqueue,
    kimi_standin,
    records,
    tokenize,
    verified,
    worker,
)

pytestmark = pytest.mark.slow


def test_recover_resumes_conversations_after_their_committed_turns(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, kimi_tokenizer: Any
) -> None:
    spec = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "k").spec
    copy = dump_all(r)  # the backup: the conversations' chunk queued, no turn generated
    out = tmp_path / "out"
    with kimi_standin(kimi_tokenizer_dir) as server:
        doomed = worker(redis_url, tmp_path, server, REGEN_CRASHPOINT=CRASHPOINT)
        assert doomed.process.wait(timeout=120) == -signal.SIGKILL, doomed.log()
        (first,) = results(r, "k")  # a first turn handed off, then the worker died
        assert first.turn == 0
        committed = tokenize(r, out, "k", 1)  # ... and committed to a shard
        assert list(committed) == [first.id]

        restore_all(r, copy)  # Redis comes back from the backup: the turn is unknown to it
        recovered = CliRunner().invoke(
            main, ["recover", "--job", "k", "--out", str(out), "--redis-url", redis_url]
        )
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
    turns = by_turn(found)
    conversation = first.conversation_id
    assert conversation is not None
    # The next turn's history holds the committed turn's own answer.
    assert turns[conversation, 1]["messages"][-3] == committed[first.id]["messages"][-1]
    assert found[first.id] == committed[first.id]
    assert verified(redis_url, "k", out)["ok"]
    files = CliRunner().invoke(main, ["shards", "verify", str(out / "k"), "--redis-url", redis_url])
    assert files.exit_code == 0, files.output
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
        doomed = worker(redis_url, tmp_path, server, REGEN_CRASHPOINT=CRASHPOINT)
        assert doomed.process.wait(timeout=120) == -signal.SIGKILL, doomed.log()
        (first,) = results(r, "l")  # a first turn handed off, then the worker died
        committed = tokenize(r, out, "l", 1)  # ... and committed to a shard
        assert list(committed) == [first.id] and first.turn == 0

        restore_all(r, copy)  # Redis comes back without the job's conversations
        recovered = CliRunner().invoke(
            main, ["recover", "--job", "l", "--out", str(out), "--redis-url", redis_url]
        )
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
    conversation = first.conversation_id
    assert conversation is not None
    # The next turn's history holds the committed turn's own answer.
    turns = by_turn(found)
    assert turns[conversation, 1]["messages"][-3] == committed[first.id]["messages"][-1]
    assert verified(redis_url, "l", out)["ok"]
    files = CliRunner().invoke(main, ["shards", "verify", str(out / "l"), "--redis-url", redis_url])
    assert files.exit_code == 0, files.output
