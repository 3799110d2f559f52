"""The job's ids and its committed index in bucketed hashes (common/ledger/id_buckets.py): the
stored form round-trips, the buckets stay compact, and counts, dedupe, the ledger and
verify's findings are exactly what they were with one set and one hash."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest
import redis
from click.testing import CliRunner

from regen.cli_status import status, verify
from regen.common import jobspec, keys
from regen.common.celery_app import make_app
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.jobspec import JobSpec, JobSpecError
from regen.common.ledger import id_buckets
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.ledger.job_ids import JobIds
from regen.common.ledger.places import count_places
from regen.common.ledger.shard_names import shard_name
from regen.consumers.tokenize.recover import recover
from regen.consumers.tokenize.shard_files import OpenShard, append_manifest
from regen.ops.reconcile import reconcile
from regen.producer.publish import ChunkPublisher
from regen.producer.spec import JobOptions, prepare_job
from tests.common.test_record import make_spec
from tests.support.helpers import drop_job_id

JOB = "b"
# Ids of every kind a job holds: prompt ids, turn ids, and any other string.
PLAIN = [f"{i:016x}" for i in range(0, 2**64, 2**64 // 300)][:300]
TURNS = [f"{PLAIN[0]}-0", f"{PLAIN[0]}-1", f"{PLAIN[1]}-12"]
OTHER = ["p1", "ABCDEF0123456789", "0123456789abcdef-01", "x" * 80, "é-ü"]


def save_spec(r: redis.Redis, buckets: int) -> JobSpec:
    spec = make_spec(name=JOB, queue=keys.generate_queue(JOB), id_buckets=buckets)
    return jobspec.save(r, spec)


def test_every_kind_of_id_round_trips_and_a_prompt_id_takes_nine_bytes() -> None:
    for pid in PLAIN + TURNS + OTHER:
        assert id_buckets.decode(id_buckets.encode(pid)) == pid
    assert len(id_buckets.encode(PLAIN[5])) == 9
    assert len(id_buckets.encode(TURNS[2])) == 11
    # The turns of a conversation share their conversation's bucket.
    assert len({id_buckets.bucket_of(id_buckets.encode(t), 1024) for t in TURNS[:2]}) == 1
    assert len({id_buckets.encode(pid) for pid in PLAIN + TURNS + OTHER}) == 308


def test_the_bucket_count_keeps_about_64_ids_a_bucket() -> None:
    assert id_buckets.bucket_count(1) == 1
    assert id_buckets.bucket_count(64) == 1
    assert id_buckets.bucket_count(65) == 2
    assert id_buckets.bucket_count(1_000_000) == 16_384
    assert id_buckets.bucket_count(100_000_000) == 2**21
    assert id_buckets.bucket_count(10**12) == id_buckets.MAX_BUCKETS


def test_buckets_stay_compact_and_hold_every_id_once(r: redis.Redis) -> None:
    save_spec(r, 4)  # ~77 ids a bucket: within the listpack's 128
    ids = JobIds(r, JOB)
    ids.add(PLAIN + TURNS)
    ids.add(PLAIN[:10] + OTHER[:2])  # ten again: not counted twice
    everything = set(PLAIN + TURNS + OTHER[:2])
    assert ids.count() == len(everything) == 305
    assert set(ids) == everything
    assert ids.contains([PLAIN[3], TURNS[2], "p1", "p2", f"{PLAIN[3]}-0"]) == [
        True, True, True, False, False,
    ]  # fmt: skip
    for bucket in range(4):
        assert r.object("encoding", keys.job_ids(JOB, bucket)) in (b"listpack", b"ziplist")
    drop_job_id(r, JOB, PLAIN[0])
    assert ids.count() == 304 and not ids.contains([PLAIN[0]])[0]


def _chunk(pids: list[str]) -> Chunk:
    prompts = [ChunkPrompt(id=p, prompt_ids=[1], messages=[], source={}) for p in pids]
    return Chunk(JOB, Chunk.make_id(JOB, pids), prompts)


def test_the_publish_script_dedupes_and_counts_in_one_step(r: redis.Redis, redis_url: str) -> None:
    spec = save_spec(r, 2)
    publisher = ChunkPublisher(make_app(redis_url), r, spec)
    try:
        first = _chunk(PLAIN[:4])
        assert publisher.publish(first.chunk_id, first.to_payload(), PLAIN[:4], {}).published
        again = publisher.publish(first.chunk_id, first.to_payload(), PLAIN[:4], {})
        assert (again.published, again.already_enqueued) == (False, [])
        overlapping = PLAIN[2:6] + TURNS[:1]
        chunk = _chunk(overlapping)
        outcome = publisher.publish(chunk.chunk_id, chunk.to_payload(), overlapping, {})
        assert (outcome.published, outcome.already_enqueued) == (False, PLAIN[2:4])
        rest = PLAIN[4:6] + TURNS[:1]
        chunk = _chunk(rest)
        assert publisher.publish(chunk.chunk_id, chunk.to_payload(), rest, {}).published
    finally:
        publisher.close()
    assert JobIds(r, JOB).count() == 7 == int(r.hget(keys.job_counters(JOB), "enqueued") or 0)
    assert count_places(r, spec).total == 7


def test_the_ledger_counts_claims_releases_and_restores(r: redis.Redis) -> None:
    save_spec(r, 2)
    ledger = CommitLedger(r, JOB)
    one, two, odd = shard_name(1), shard_name(2), "hand-made.jsonl.zst"
    taken, pending_one = ledger.claim(one, "w", PLAIN[:100])
    assert taken == [] and ledger.count() == (100, 100)
    assert ledger.claim(one, "w", PLAIN[:100])[0] == []  # its own ids again: no change
    taken, _ = ledger.claim(two, "w", [PLAIN[150], PLAIN[5], TURNS[0], PLAIN[99]])
    assert taken == [PLAIN[5], PLAIN[99]] and ledger.count() == (100, 100)
    assert ledger.finalize(one, b'{"completion_tokens": 1, "compressed_bytes": 1}', [], PLAIN[:100])
    assert ledger.count() == (100, 0)
    taken, pending_odd = ledger.claim(odd, "w", [*PLAIN[100:110], "p1"])
    assert taken == [] and ledger.count() == (111, 11)
    assert ledger.owner_of([PLAIN[0], PLAIN[105], "p1", PLAIN[200]]) == [one, odd, odd, None]
    assert sorted(ledger.iter_committed()) == sorted(
        [(pid, one) for pid in PLAIN[:100]] + [(pid, odd) for pid in [*PLAIN[100:110], "p1"]]
    )
    assert ledger.release(pending_odd)
    assert ledger.count() == (100, 0) and ledger.owner_of(["p1"]) == [None]
    assert not ledger.release(pending_one)  # finalized: not pending, nothing undone
    row = b'{"completion_tokens": 1, "compressed_bytes": 1}'
    assert ledger.restore(two, row, [PLAIN[150], PLAIN[5]], [PLAIN[150], PLAIN[5]])
    assert ledger.count() == (101, 0) and ledger.owner_of(PLAIN[5:6]) == [two]


def test_a_job_written_by_an_older_layout_is_refused_clearly(
    r: redis.Redis, redis_url: str
) -> None:
    stored = orjson.loads(save_spec(r, 2).to_json())
    del stored["id_buckets"]
    r.set(keys.job_spec(JOB), orjson.dumps({**stored, "version": 1}))
    for read in (lambda: jobspec.load(r, JOB), lambda: CommitLedger(r, JOB),
                 lambda: JobIds(r, JOB)):  # fmt: skip
        with pytest.raises(JobSpecError, match="enqueued by an older regen"):
            read()
    for command, job in ((status, ["--job", JOB]), (status, []), (verify, ["--job", JOB])):
        result = CliRunner().invoke(command, [*job, "--redis-url", redis_url])
        assert result.exit_code == 1 and "enqueued by an older regen" in result.output


def _place_shard(ledger: CommitLedger, folder: Path, name: str, ids: list[str]) -> None:
    """A shard written, claimed, placed and finalized as the tokenize stage does."""
    shard = OpenShard(folder, name, "w", epoch=ledger.epoch())
    for pid in ids:
        shard.add({"id": pid, "prompt_tokens": 1, "completion_tokens": 1})
    info = shard.close_durably()
    assert ledger.claim(name, "w", ids)[0] == []
    shard.path.rename(folder / name)
    append_manifest(folder, info)
    assert ledger.finalize(name, info.to_json(), [], ids)


def _write_file(folder: Path, name: str, ids: list[str]) -> None:
    shard = OpenShard(folder, name, "w")
    for pid in ids:
        shard.add({"id": pid, "prompt_tokens": 1, "completion_tokens": 1})
    shard.close_durably()
    shard.path.rename(folder / name)


def _problems(r: redis.Redis, spec: JobSpec, folder: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for kind, subject, _ in reconcile(r, spec, folder).problems:
        found.setdefault(kind, []).append(subject)
    return found


def test_verify_finds_what_it_found_before(r: redis.Redis, tmp_path: Path) -> None:
    spec = save_spec(r, 4)
    folder = tmp_path / JOB
    folder.mkdir()
    ids = PLAIN[:120] + TURNS
    JobIds(r, JOB).add(ids)
    ledger = CommitLedger(r, JOB)
    ledger.start_epoch()
    _place_shard(ledger, folder, shard_name(1), ids[:60])
    _place_shard(ledger, folder, shard_name(2), ids[60:])
    report = reconcile(r, spec, folder)
    assert report.ok and report.enqueued == 123 and report.places["done"] == 123
    assert report.shard_ids_read == 123

    JobIds(r, JOB).add(["00000000deadbeef"])  # enqueued, in no place
    _write_file(folder, shard_name(3), [ids[0]])  # an id in a second shard
    _write_file(folder, shard_name(2), ids[61:])  # a committed id gone from its shard
    found = _problems(r, spec, folder)
    assert found["missing"] == ["00000000deadbeef"]
    assert found["in_two_shards"] == [ids[0]]
    assert found["not_in_shard"] == [ids[60]]
    assert found["unlisted_shard"] == [shard_name(3)]

    # Each planted problem taken back: verify passes again.
    (folder / shard_name(3)).unlink()
    _write_file(folder, shard_name(2), ids[60:])
    drop_job_id(r, JOB, "00000000deadbeef")
    assert reconcile(r, spec, folder).ok


def test_recover_restores_a_lost_index_and_its_count(r: redis.Redis, tmp_path: Path) -> None:
    spec = save_spec(r, 2)
    folder = tmp_path / JOB
    folder.mkdir()
    ids = PLAIN[:50] + TURNS[:1]
    JobIds(r, JOB).add(ids)
    ledger = CommitLedger(r, JOB)
    ledger.start_epoch()
    _place_shard(ledger, folder, shard_name(1), ids)
    for bucket in range(spec.id_buckets):  # Redis lost the index and its count
        r.delete(keys.committed(JOB, bucket))
    r.hdel(keys.job_counters(JOB), keys.COMMITTED_INDEX)
    assert _problems(r, spec, folder)["in_shard_not_committed"][:1] == [ids[0]]
    report = recover(r, JOB, folder)
    assert report.ok and report.ids_restored == 51
    assert ledger.count() == (51, 0)
    assert reconcile(r, spec, folder).ok


def test_expected_prompts_sizes_a_new_job_and_an_existing_one_keeps_its_own(
    r: redis.Redis,
) -> None:
    spec = prepare_job(JobOptions(job=JOB, model="smollm2", expected_prompts=100_000)).spec
    assert spec.id_buckets == 2048
    assert jobspec.save(r, spec).id_buckets == 2048
    bigger = dataclasses.replace(spec, id_buckets=id_buckets.bucket_count(10**8))
    assert jobspec.save(r, bigger).id_buckets == 2048  # the stored spec wins, no mismatch
