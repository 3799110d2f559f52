"""stats and verify over real shards written by the shard writer, and the `regen shards`
commands that wrap them (export: test_export.py)."""

from __future__ import annotations

import os
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from regen.cli_shards import shards_group
from regen.common.ledger.shard_names import shard_name
from regen.common.record import RECORD_SCHEMA
from regen.consumers.tokenize.shard_files import (
    MANIFEST,
    MAX_MANIFEST_LINE,
    OpenShard,
    ShardInfo,
    iter_records,
    place,
    read_manifest,
    shard_paths,
)
from regen.ops.shards_inspect import stats, verify

USER = {"role": "user", "content": "What is 2+2?"}
OWNER = "host-1:123"


def make_record(
    rid: str,
    *,
    prompt: int = 5,
    completion: int = 3,
    finish: str = "stop",
    drift: bool | None = False,
    reasoning: str | None = None,
) -> dict[str, Any]:
    assistant: dict[str, Any] = {"role": "assistant", "content": "4"}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return {
        "schema": RECORD_SCHEMA, "id": rid, "job": "job-a", "model": "m",
        "messages": [USER, assistant],
        "input_ids": list(range(100, 100 + prompt + completion)),
        "loss_mask": [0] * prompt + [1] * completion,
        "prompt_tokens": prompt, "completion_tokens": completion, "finish_reason": finish,
        "sampling": {"max_new_tokens": 64}, "chat_template_kwargs": {},
        "source": {"file": "d.jsonl", "row": 0}, "drift": drift,
        "drift_at": (prompt + 1) if drift else None, "server": "s", "generated_by": "w",
        "conversation_id": None, "turn": None, "flags": [], "server_version": None,
    }  # fmt: skip


def write_shard(job: Path, seq: int, records: list[dict[str, Any]]) -> ShardInfo:
    job.mkdir(parents=True, exist_ok=True)
    shard = OpenShard(job, shard_name(seq), OWNER)
    for record in records:
        shard.add(record)
    info = shard.close_durably()
    place(job, info, OWNER)
    return info


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """Two shards, five records: finish reasons, drift and lengths all varied."""
    folder = tmp_path / "out" / "job-a"
    write_shard(folder, 1, [
        make_record("a", completion=1, reasoning="hm"),
        make_record("b", completion=3, drift=True),
        make_record("c", completion=1000, finish="length"),
    ])  # fmt: skip
    write_shard(folder, 2, [make_record("d", completion=0), make_record("e", drift=None)])
    return folder


def kinds(problems: list[Any]) -> set[str]:
    return {p.kind for p in problems}


# --- verify ------------------------------------------------------------------------------


def test_verify_passes_on_good_output(job: Path) -> None:
    assert verify(job) == []
    assert verify(job.parent) == []  # a folder of job folders


def test_verify_passes_on_real_records(tmp_path: Path, kimi_tokenizer: Any) -> None:
    from regen.common.record import build_record
    from tests.common.test_record import IM_END, THINK_END, ids, make_ctx, make_result

    ctx = make_ctx(kimi_tokenizer)
    output = ids(kimi_tokenizer, "Let me think.", THINK_END, "The answer is 4.", IM_END)
    write_shard(tmp_path / "job-1", 1, [build_record(make_result(ctx, output), ctx)])
    assert verify(tmp_path / "job-1") == []


def test_verify_takes_version_1_records_and_turn_records(tmp_path: Path) -> None:
    old = make_record("a")
    old["schema"] = "regen.record/1"
    del old["conversation_id"], old["turn"]
    turn = {**make_record("c0f1-2"), "conversation_id": "c0f1", "turn": 2}
    write_shard(tmp_path / "job", 1, [old, turn])
    assert verify(tmp_path / "job") == []
    current = make_record("b")
    del current["turn"]  # a version 2 record must say its turn (null if none)
    write_shard(tmp_path / "job", 2, [current])
    (problem,) = verify(tmp_path / "job")
    assert problem.kind == "schema" and "turn" in problem.message


def test_verify_catches_flipped_bytes(job: Path) -> None:
    path = job / shard_name(1)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    path.write_bytes(bytes(data))
    problems = verify(job)
    assert "checksum" in kinds(problems)
    assert all(p.path == shard_name(1) for p in problems)


def test_a_shard_cut_short_is_unreadable_not_read_short(job: Path) -> None:
    # zstandard's stream_reader ends quietly inside a cut frame: read through it, the
    # shard would only look short (checksum, size and counts), never unreadable.
    path = job / shard_name(1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    unreadable = [p for p in verify(job) if p.kind == "unreadable"]
    assert [p.path for p in unreadable] == [shard_name(1)]
    assert "truncated" in unreadable[0].message
    runner = CliRunner()
    checked = runner.invoke(shards_group, ["verify", str(job)])
    assert checked.exit_code == 1 and f"{shard_name(1)}: unreadable" in checked.output
    counted = runner.invoke(shards_group, ["stats", str(job)])
    assert counted.exit_code == 1 and "unreadable shard" in counted.output


def test_verify_catches_a_duplicate_id_across_shards(job: Path) -> None:
    write_shard(job, 3, [make_record("b")])
    problems = verify(job)
    assert kinds(problems) == {"duplicate_id"}
    assert problems[0].path == shard_name(3)
    assert f"1 id also in job-a/{shard_name(1)} (e.g. b)" in problems[0].message


def test_verify_catches_a_copied_job_folder(job: Path) -> None:
    shutil.copytree(job, job.parent / "job-a.bak")
    problems = verify(job.parent)
    assert [(p.job, p.path, p.kind) for p in problems] == [
        ("job-a.bak", shard_name(1), "duplicate_id"), ("job-a.bak", shard_name(2), "duplicate_id"),
    ]  # fmt: skip
    assert f"3 ids also in job-a/{shard_name(1)} (e.g. a)" in problems[0].message
    bad = CliRunner().invoke(shards_group, ["verify", str(job.parent), "--no-redis"])
    assert bad.exit_code == 1 and "duplicate_id" in bad.output


def test_verify_catches_an_id_twice_in_one_shard(tmp_path: Path) -> None:
    write_shard(tmp_path / "job", 1, [make_record("a"), make_record("b"), make_record("a")])
    problems = verify(tmp_path / "job")
    assert [(p.path, p.kind) for p in problems] == [(shard_name(1), "duplicate_id")]
    assert f"1 id also in job/{shard_name(1)} (e.g. a)" in problems[0].message


def test_verify_catches_mask_and_count_errors(tmp_path: Path) -> None:
    short_mask = make_record("a")
    short_mask["loss_mask"] = short_mask["loss_mask"][:-1]
    shuffled = make_record("b")
    shuffled["loss_mask"] = [1, *shuffled["loss_mask"][1:]]
    miscounted = make_record("c")
    miscounted["completion_tokens"] += 1
    write_shard(tmp_path / "job", 1, [short_mask, shuffled, miscounted])
    problems = verify(tmp_path / "job")
    assert [p.kind for p in problems] == ["mask_length", "loss_mask", "token_count"]


def test_verify_catches_schema_errors(tmp_path: Path) -> None:
    missing = make_record("a")
    del missing["input_ids"]
    old = make_record("b")
    old["schema"] = "regen.record/0"
    boolean = make_record("c")
    boolean["prompt_tokens"] = True
    aborted = make_record("d", finish="abort")
    write_shard(tmp_path / "job", 1, [missing, old, boolean, aborted])
    problems = verify(tmp_path / "job")
    assert [p.kind for p in problems] == ["schema"] * 4
    assert "input_ids" in problems[0].message and "prompt_tokens" in problems[2].message


def test_verify_catches_missing_and_unlisted_shards_and_tmp(job: Path) -> None:
    (job / shard_name(2)).unlink()
    stray = OpenShard(job, shard_name(3), OWNER)
    stray.add(make_record("z"))
    stray.close_durably()
    os.replace(stray.path, job / shard_name(3))  # in place but never in the manifest
    leftover = OpenShard(job, shard_name(4), OWNER)  # a writer that died mid-shard
    problems = verify(job)
    leftover.abort()
    assert {(p.path, p.kind) for p in problems} == {
        (shard_name(2), "missing_shard"), (shard_name(3), "unlisted_shard"),
        (leftover.path.name, "leftover_tmp"),
    }  # fmt: skip


def test_verify_catches_manifest_disagreements(job: Path) -> None:
    lines = (job / MANIFEST).read_bytes().splitlines()
    first = orjson.loads(lines[0])
    first["rows"] += 1
    (job / MANIFEST).write_bytes(b"\n".join([orjson.dumps(first), lines[1], b'{"shard": "x'])
                                 + b"\n")  # fmt: skip
    problems = verify(job)
    assert {(p.path, p.kind) for p in problems} == {
        (MANIFEST, "manifest_line"), (shard_name(1), "manifest_mismatch"),
    }  # fmt: skip


# A crash mid-append leaves a prefix of the line, or (a filesystem that grew the file
# before writing its data) zero bytes.
TORN_TAILS = [b'{"shard":"shard-000003.jsonl.zst","ro', b"\0" * 300]


@pytest.mark.parametrize("tail", TORN_TAILS)
def test_a_torn_last_manifest_line_is_a_warning(job: Path, tail: bytes) -> None:
    with open(job / MANIFEST, "ab") as fh:
        fh.write(tail)
    problems = verify(job)
    assert [(p.path, p.kind, p.warning) for p in problems] == [
        (MANIFEST, "torn_manifest_line", True)
    ]
    result = CliRunner().invoke(shards_group, ["verify", str(job), "--no-redis"])
    assert result.exit_code == 0, result.output
    assert "warning: job-a/manifest.jsonl: torn_manifest_line: line 3" in result.output


@pytest.mark.parametrize("tail", TORN_TAILS)
def test_the_next_append_repairs_a_torn_manifest_line(job: Path, tail: bytes) -> None:
    with open(job / MANIFEST, "ab") as fh:
        fh.write(tail)
    write_shard(job, 3, [make_record("f")])  # the writer's next shard
    lines = (job / MANIFEST).read_bytes().splitlines()
    assert [orjson.loads(line)["shard"] for line in lines] == [shard_name(n) for n in (1, 2, 3)]
    assert verify(job) == []


def test_a_complete_last_line_without_its_newline_is_kept(job: Path) -> None:
    (job / MANIFEST).write_bytes((job / MANIFEST).read_bytes().rstrip(b"\n"))
    write_shard(job, 3, [make_record("f")])
    assert verify(job) == [] and len((job / MANIFEST).read_bytes().splitlines()) == 3


def test_a_huge_manifest_line_is_refused_without_reading_it_whole(job: Path) -> None:
    lines = (job / MANIFEST).read_bytes().splitlines(keepends=True)
    huge = b'{"shard":"' + b"x" * (8 << 20) + b'"}\n'
    (job / MANIFEST).write_bytes(lines[0] + huge + lines[1])
    tracemalloc.start()
    try:
        manifest = read_manifest(job)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert sorted(manifest.shards) == [shard_name(1), shard_name(2)]  # the lines around it
    problems = verify(job)
    assert [(p.path, p.kind) for p in problems] == [(MANIFEST, "manifest_line")]
    assert f"line 2 is over {MAX_MANIFEST_LINE:,} bytes" in problems[0].message
    # A writer appends after it all the same, on a fresh line.
    write_shard(job, 3, [make_record("f")])
    assert sorted(read_manifest(job).shards) == [shard_name(n) for n in (1, 2, 3)]


def test_verify_an_empty_folder(tmp_path: Path) -> None:
    assert kinds(verify(tmp_path)) == {"no_jobs"}


# --- stats -------------------------------------------------------------------------------


def test_stats_numbers(job: Path) -> None:
    (only,) = stats(job)
    assert only.job == "job-a"
    assert (only.shards, only.rows) == (2, 5)
    assert only.prompt_tokens == 25
    assert only.completion_tokens == 1 + 3 + 1000 + 0 + 3
    assert only.bytes == sum(p.stat().st_size for p in shard_paths(job))
    assert dict(only.finish_reasons) == {"stop": 4, "length": 1}
    assert (only.drift, only.drift_checked) == (1, 4)
    assert only.histogram_rows() == [("0-0", 1), ("1-1", 1), ("2-3", 2), ("512-1023", 1)]


def test_stats_over_a_folder_of_jobs(job: Path) -> None:
    write_shard(job.parent / "job-b", 1, [make_record("a")])
    assert [(s.job, s.rows) for s in stats(job.parent)] == [("job-a", 5), ("job-b", 1)]


# --- the CLI -----------------------------------------------------------------------------


def test_cli_verify_exit_codes(job: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(shards_group, ["verify", str(job)])
    assert ok.exit_code == 0, ok.output
    assert "ok" in ok.output
    (job / shard_name(2)).unlink()
    bad = runner.invoke(shards_group, ["verify", str(job)])
    assert bad.exit_code == 1
    assert "missing_shard" in bad.output


def test_cli_stats_and_export(job: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    as_json = runner.invoke(shards_group, ["stats", str(job.parent), "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = orjson.loads(as_json.output)
    assert (data["job"], data["rows"], data["drift"]) == ("job-a", 5, 1)
    assert data["completion_histogram"]["512-1023"] == 1
    text = runner.invoke(shards_group, ["stats", str(job)])
    assert text.exit_code == 0 and "rows         5" in text.output

    out = tmp_path / "conv.jsonl"
    exported = runner.invoke(shards_group, ["export", str(job), "--out", str(out)])
    assert exported.exit_code == 0, exported.output
    # "d" generated nothing: a row with nothing to train on is dropped, and counted.
    assert len(out.read_bytes().splitlines()) == 4
    assert "dropped 1 (no_loss_tokens 1)" in exported.output
    assert next(iter_records(job / shard_name(1)))["id"] == "a"


def test_verify_reports_a_line_that_is_no_object(tmp_path: Path) -> None:
    job = tmp_path / "job"
    write_shard(job, 1, [make_record("a")])
    shard = OpenShard(job, shard_name(2), OWNER)
    shard._zstd.write(b"[1, 2]\n")  # a writer bug: a JSON line that is not a record
    info = shard.close_durably()
    place(job, info, OWNER)
    # (The manifest line counts no rows: the writer never saw one.)
    assert [(p.path, p.kind) for p in verify(job)] == [
        (shard_name(2), "schema"), (shard_name(2), "manifest_mismatch"),
    ]  # fmt: skip
