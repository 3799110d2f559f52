"""Several answers per prompt (`regen enqueue --samples K`): ids, seeds, exactly-once
publishing across a crash between a buffer's chunks, and held-out splits by prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import jobspec
from regen.common.chunk import ChunkPrompt
from regen.common.conversation import turn_id
from regen.common.samples import SEED_PARAM, prompt_unit, sample_id, sample_seed
from regen.consumers.tokenize.shard_files import iter_records, shard_paths
from regen.producer.publish import ChunkPublisher
from regen.producer.rows import prompt_id
from tests.producer.test_enqueue import enqueue
from tests.producer.test_turns import ROW
from tests.support.generate_harness import PROMPTS, Worker, enqueue_prompts
from tests.support.helpers import job_ids, queued_chunks, user_rows, wait_for, write_jsonl
from tests.support.sglang_standin.process import run_standin
from tests.support.tokenize_harness import InProcess, options, settled


def test_each_prompt_is_k_prompts_one_chunk_per_sample_with_its_seed(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    rows = user_rows(5)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    stats = enqueue(redis_url, [path], samples=3, chunk_size=8)
    spec = jobspec.load(r, "j")
    assert spec.samples == 3 and stats.enqueued == 15 and stats.chunks == 3

    bases = [prompt_id([{"role": "user", "content": row["prompt"]}]) for row in rows]
    assert job_ids(r, "j") == {sample_id(b, k) for b in bases for k in range(3)}
    chunks = queued_chunks(r, spec.queue)
    seeds = [chunk["sampling"][SEED_PARAM] for chunk in chunks]
    assert seeds == [sample_seed("j", k) for k in range(3)] and len(set(seeds)) == 3
    for k, chunk in enumerate(chunks):
        prompts = [ChunkPrompt.from_payload(p) for p in chunk["prompts"]]
        assert [p.id for p in prompts] == [sample_id(b, k) for b in bases]
        assert {p.source["sample"] for p in prompts} == {k}
    first = [ChunkPrompt.from_payload(c["prompts"][0]) for c in chunks]
    assert first[0].prompt_ids == first[1].prompt_ids == first[2].prompt_ids  # rendered once

    assert enqueue(redis_url, [path], samples=3, chunk_size=8).enqueued == 0
    with pytest.raises(jobspec.JobSpecMismatch, match="samples"):
        enqueue(redis_url, [path], samples=2, chunk_size=8)


def test_a_crash_between_a_buffers_chunks_publishes_only_the_missing_samples(
    redis_url: str, r: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", user_rows(4))
    real = ChunkPublisher.publish
    calls = 0

    def dies_at_the_second(self: ChunkPublisher, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise SystemExit("killed between two chunks of one buffer")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ChunkPublisher, "publish", dies_at_the_second)
    with pytest.raises(SystemExit):
        enqueue(redis_url, [path], samples=3, chunk_size=8)
    assert len(job_ids(r, "j")) == 4  # sample 0 only; the file's cursor has not moved
    monkeypatch.setattr(ChunkPublisher, "publish", real)

    again = enqueue(redis_url, [path], samples=3, chunk_size=8)
    assert again.enqueued == 8 and again.duplicates == 4
    spec = jobspec.load(r, "j")
    ids = [p["id"] for chunk in queued_chunks(r, spec.queue) for p in chunk["prompts"]]
    assert len(ids) == len(set(ids)) == 12 == len(job_ids(r, "j"))


def test_samples_of_a_conversation_are_conversations_of_their_own(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [ROW])
    stats = enqueue(redis_url, [path], turns="all", samples=2, chunk_size=4)
    assert stats.enqueued == 6 and stats.chunks == 2  # 3 turns x 2 samples
    spec = jobspec.load(r, "j")
    conversations = [
        ChunkPrompt.from_payload(chunk["prompts"][0]).conversation
        for chunk in queued_chunks(r, spec.queue)
    ]
    assert conversations[0] is not None and conversations[1] is not None
    base = conversations[0].id.removesuffix("-s0")
    assert conversations[1].id == sample_id(base, 1)
    assert turn_id(sample_id(base, 1), 2) in job_ids(r, "j")


def test_a_held_out_split_keeps_every_sample_of_a_prompt_together() -> None:
    record = {"id": "abc-s2", "conversation_id": None, "source": {"sample": 2}}
    assert prompt_unit(record) == "abc"
    turn = {"id": "c1-s1-3", "conversation_id": "c1-s1", "source": {"sample": 1}}
    assert prompt_unit(turn) == "c1"
    assert prompt_unit({"id": "abc-s2", "source": {"file": "f"}}) == "abc-s2"


@pytest.mark.slow
def test_samples_end_in_records_with_their_seeds(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS[:4], samples=2)
    out = tmp_path / "out"
    with (
        run_standin() as server,
        Worker(redis_url, tmp_path, "--engine", "sglang", "--server", server.url, "--jobs", "g"),
        InProcess(r, options(out), "c1"),
    ):
        wait_for(lambda: settled(r, "g", 8), timeout=120, what="every sample in a shard")
    records = {rec["id"]: rec for shard in shard_paths(out / "g") for rec in iter_records(shard)}
    assert len(records) == 8
    for rid, record in records.items():
        k = record["source"]["sample"]
        assert rid.endswith(f"-s{k}")
        assert record["sampling"][SEED_PARAM] == sample_seed(spec.name, k)
    by_prompt: dict[str, list[str]] = {}
    for record in records.values():
        by_prompt.setdefault(prompt_unit(record), []).append(record["messages"][-1]["content"])
    assert len(by_prompt) == 4
    assert all(len(set(answers)) == 2 for answers in by_prompt.values())  # seeds differ
