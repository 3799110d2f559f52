"""`--turns all` end to end: real generate and tokenize workers, the SGLang stand-in
serving the Kimi-format tokenizer with thinking on, and kill -9 between turns."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner

from regen.cli_dlq import dlq_group
from regen.cli_status import verify
from regen.common import dlq, jobspec
from regen.common.celery_app import make_app
from regen.common.chat_family import render_prompt_ids
from regen.common.ledger.places import count_places
from regen.common.results import GeneratedResult
from regen.consumers.generate.turns import CRASHPOINT
from regen.consumers.tokenize.shard_files import iter_records, shard_paths
from regen.producer.enqueue import Enqueuer
from regen.producer.spec import JobOptions, PreparedJob, prepare_job
from tests.producer.test_turns import ROW, USER_TURNS, conversation_row
from tests.support.generate_harness import (
    Worker,
    all_acked,
    all_generated,
    attempts,
    chunks_held_by,
    results,
)
from tests.support.helpers import job_ids, wait_for, write_jsonl
from tests.support.sglang_standin.process import StandinHandle, run_standin
from tests.support.tokenize_harness import (
    InProcess,
    options,
    settled,
    stop_worker,
    tokenize_worker,
)

pytestmark = pytest.mark.slow

# A second conversation, of two turns, runs beside ROW's three in the same chunk.
ROWS = [ROW, conversation_row("old one", "old two", users=USER_TURNS[1:])]
TURNS = 5
# Enough tokens for a few sentences: the stand-in's reasoning ends within them.
ANSWER = "fixed:n=60"


def enqueue(url: str, tmp_path: Path, kimi_dir: Path, job: str, **options: Any) -> PreparedJob:
    path = write_jsonl(tmp_path / f"{job}.jsonl", options.pop("rows", ROWS))
    prepared = prepare_job(JobOptions(job=job, model=str(kimi_dir), trust_remote_code=True,
                                      turns="all", thinking=True, max_new_tokens=400,
                                      **options))  # fmt: skip
    r = redis.Redis.from_url(url)
    jobspec.save(r, prepared.spec)
    Enqueuer(r, make_app(url), prepared, high_water=100).run([path])
    return prepared


def kimi_standin(kimi_dir: Path) -> Any:
    return run_standin(tokenizer=str(kimi_dir), trust_remote_code=True, think=True,
                       output_len_dist=ANSWER)  # fmt: skip


def worker(url: str, tmp_path: Path, server: StandinHandle, *args: str, **env: str) -> Worker:
    return Worker(url, tmp_path, "--engine", "sglang", "--server", server.url, *args, env=env)


def records(folder: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for shard in shard_paths(folder):
        for record in iter_records(shard):
            assert record["id"] not in out, f"{record['id']} twice"
            out[record["id"]] = record
    return out


def tokenize(r: redis.Redis, out: Path, job: str, expected: int) -> dict[str, dict[str, Any]]:
    with InProcess(r, options(out, jobs=[job]), f"tok-{job}"):
        wait_for(lambda: settled(r, job, expected), timeout=120, what=f"{job} in shards")
    return records(out / job)


def verified(url: str, job: str, out: Path) -> dict[str, Any]:
    result = CliRunner().invoke(
        verify, ["--job", job, "--json", "--shards-dir", str(out / job), "--redis-url", url]
    )
    assert result.exit_code == 0, result.output
    return orjson.loads(result.output)  # type: ignore[no-any-return]


def by_turn(found: dict[str, dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(rec["conversation_id"], rec["turn"]): rec for rec in found.values()}


def test_every_turn_is_regenerated_in_order_on_the_targets_own_answers(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, kimi_tokenizer: Any
) -> None:
    prepared = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "a")
    spec = prepared.spec
    with kimi_standin(kimi_tokenizer_dir) as server, worker(redis_url, tmp_path, server):
        wait_for(lambda: all_generated(r, spec), timeout=120, what="every turn generated")
    sent = {res.id: res for res in results(r, "a")}
    assert len(sent) == TURNS == len(results(r, "a"))
    found = tokenize(r, tmp_path / "out", "a", TURNS)

    assert set(found) == set(sent)
    turns = by_turn(found)
    kwargs = spec.chat_template_kwargs
    assert kwargs == {"thinking": True}
    for record in found.values():
        result = sent[record["id"]]
        assert record["id"] == f"{record['conversation_id']}-{record['turn']}"
        # Token-exact: the ids sent, which are the messages rendered as serving renders
        # them, then the ids generated; never re-tokenized.
        assert record["input_ids"] == result.prompt_ids + result.output_ids
        assert result.prompt_ids == render_prompt_ids(kimi_tokenizer, record["messages"][:-1],
                                                      kwargs)  # fmt: skip
        assert record["loss_mask"] == [0] * len(result.prompt_ids) + [1] * len(result.output_ids)
        assert record["drift"] is False
        prompt = kimi_tokenizer.decode(result.prompt_ids)
        assert "DATASET" not in prompt and "old one" not in prompt and "old two" not in prompt

    (conversation,) = {cid for cid, turn in turns if turn == 2}
    for turn in (1, 2):
        earlier, record = turns[conversation, turn - 1], turns[conversation, turn]
        answer = earlier["messages"][-1]
        assert answer["reasoning_content"] and answer["content"].strip()
        # The history holds the target's own answer, its thinking dropped as Kimi does.
        assert record["messages"][-3] == answer
        assert record["messages"][-2] == USER_TURNS[turn]
        prompt = kimi_tokenizer.decode(record["input_ids"][: record["prompt_tokens"]])
        assert f"<think></think>{answer['content']}<|im_end|>" in prompt
    report = verified(redis_url, "a", tmp_path / "out")
    assert report["ok"] and report["enqueued"] == TURNS and report["places"]["done"] == TURNS


def test_kills_between_turns_change_no_record(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    ref = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "ref").spec
    spec = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "k").spec
    with kimi_standin(kimi_tokenizer_dir) as server:
        doomed = worker(redis_url, tmp_path, server, "--jobs", "k",
                        REGEN_CRASHPOINT=CRASHPOINT)  # fmt: skip
        assert doomed.process.wait(timeout=120) == -signal.SIGKILL, doomed.log()
        (first,) = results(r, "k")  # handed off, then killed before the next turn
        # The chunk comes back after the visibility timeout; this worker serves both jobs.
        with worker(redis_url, tmp_path, server):
            wait_for(lambda: all_generated(r, spec) and all_generated(r, ref), timeout=180,
                     what="both jobs generated")  # fmt: skip
    handed_off = results(r, "k")
    assert handed_off[0] == first
    # Each turn handed off once: the one before the kill was not generated again.
    assert len({res.id for res in handed_off}) == len(handed_off) == TURNS

    out = tmp_path / "out"
    # The tokenize worker dies with a shard in place but not committed, then restarts.
    doomed_tokenizer = tokenize_worker(redis_url, out, crashpoint="tokenize.after_place",
                               extra=("--jobs", "k", "--shard-rows", "2"))  # fmt: skip
    assert doomed_tokenizer.wait(timeout=120) == -signal.SIGKILL
    assert len(shard_paths(out / "k")) == 1
    survivor = tokenize_worker(redis_url, out, extra=("--jobs", "k", "--shard-rows", "2"))
    try:
        wait_for(lambda: settled(r, "k", TURNS), timeout=120, what="the rest committed")
    finally:
        stop_worker(survivor)
    crashed, reference = records(out / "k"), tokenize(r, out, "ref", TURNS)
    assert set(crashed) == set(reference) and len(crashed) == TURNS
    same = ("input_ids", "loss_mask", "messages", "conversation_id", "turn", "finish_reason")
    for pid, record in crashed.items():
        assert {f: record[f] for f in same} == {f: reference[pid][f] for f in same}, pid
    assert verified(redis_url, "k", out)["ok"]


def test_a_frozen_worker_that_comes_back_writes_no_turn_of_the_chunk_it_lost(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    """SIGSTOP of a worker mid-conversation past its lease; another worker takes the
    chunk and finishes it; SIGCONT: the answer the frozen worker gets back for the turn
    it had sent is not handed off, and every turn ends exactly once."""
    spec = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "f").spec
    # 60 tokens at 20 a second: each turn takes 3 s, a chunk of three turns in a row
    # longer than the test's lease (8 s).
    slow = run_standin(tokenizer=str(kimi_tokenizer_dir), trust_remote_code=True, think=True,
                       output_len_dist=ANSWER, decode_tokens_per_s=20)  # fmt: skip
    with slow as server:
        frozen = worker(redis_url, tmp_path, server)
        try:
            wait_for(lambda: bool(results(r, "f")), timeout=120, what="a first turn")
            frozen.signal_group(signal.SIGSTOP)
            held = chunks_held_by(r, "f", frozen.name)
            before = {res.id for res in results(r, "f")}
            assert held and len(before) < TURNS
            with worker(redis_url, tmp_path, server) as other:

                def taken_over() -> bool:
                    return all(attempts(r, "f", c)[-1]["worker"] == other.name for c in held)

                def over() -> bool:  # the job done, and nothing left in the frozen worker
                    return all_generated(r, spec) and not chunks_held_by(r, "f", frozen.name)

                wait_for(taken_over, timeout=120, what="the chunk taken over")
                frozen.signal_group(signal.SIGCONT)
                wait_for(over, timeout=180, what="the job to finish")
        finally:
            frozen.signal_group(signal.SIGCONT)
            frozen.stop()
    sent = results(r, "f")
    stale = {res.id for res in sent if res.worker == frozen.name} - before
    assert not stale, "the frozen worker handed off turns of a chunk it had lost"
    assert set(Counter(res.id for res in sent).values()) == {1} and len(sent) == TURNS
    assert dlq.count(r, "f", "generate") == 0
    for chunk in held:
        statuses = [h["status"] for h in attempts(r, "f", chunk) if h["worker"] == frozen.name]
        assert statuses == ["lost"], statuses


def test_a_turn_too_long_blocks_the_later_turns_until_requeued(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, kimi_tokenizer: Any
) -> None:
    long_user = {"role": "user", "content": "Now list these words back:" + " tide" * 100}
    row = conversation_row("x", "y", "z", users=[USER_TURNS[0], long_user, USER_TURNS[2]])
    first_turn = [row["messages"][0], USER_TURNS[0]]
    length = len(render_prompt_ids(kimi_tokenizer, first_turn, {"thinking": True}))
    # The first turn fits with 400 new tokens; the second (100 more words) does not, and
    # every turn fits once a requeue asks for 100.
    prepared = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "d", rows=[row],
                       context_length=length + 420)  # fmt: skip
    spec = prepared.spec
    ids = _turn_ids(r, spec)
    with kimi_standin(kimi_tokenizer_dir) as server, worker(redis_url, tmp_path, server):
        wait_for(lambda: dlq.count(r, "d", "generate") == 2 and all_acked(r, spec),
                 timeout=120, what="the second turn dead-lettered")  # fmt: skip
        letters = {letter.entry_id: letter for letter in dlq.entries(r, "d", "generate")}
        assert set(letters) == set(ids[1:]) and [res.id for res in results(r, "d")] == ids[:1]
        assert letters[ids[1]].reason == "prompt_too_long"
        assert letters[ids[2]].reason == "blocked" and ids[1] in letters[ids[2]].message
        places = count_places(r, spec)
        assert places.dead_lettered == 2 and places.results_pending == 1
        assert places.unplaced == 0

        args = ["requeue", "--all", "--set", "max_new_tokens=100", "--redis-url", redis_url]
        requeued = CliRunner().invoke(dlq_group, args)
        assert "requeued 2 prompt(s) in 1 new chunk(s)" in requeued.output, requeued.output
        wait_for(lambda: len(results(r, "d")) == 3 and all_acked(r, spec), timeout=120,
                 what="the conversation resumed")  # fmt: skip
    assert dlq.count(r, "d", "generate") == 0
    sent: dict[str, GeneratedResult] = {res.id: res for res in results(r, "d")}
    found = tokenize(r, tmp_path / "out", "d", 3)
    assert set(found) == set(ids)
    answer = found[ids[0]]["messages"][-1]
    assert found[ids[1]]["messages"][:-1] == [*first_turn, answer, long_user]
    assert answer["content"] in kimi_tokenizer.decode(sent[ids[1]].prompt_ids)
    assert [found[i]["sampling"]["max_new_tokens"] for i in ids] == [400, 100, 100]
    assert verified(redis_url, "d", tmp_path / "out")["ok"]


def _turn_ids(r: redis.Redis, spec: jobspec.JobSpec) -> list[str]:
    """The job's turn ids in turn order (one conversation)."""
    return sorted(job_ids(r, spec.name),
                  key=lambda tid: int(tid.rsplit("-", 1)[1]))  # fmt: skip
