"""Reading a tokenize stage's output: stats, verification and export.

Each function takes a job folder (`DIR/JOB`, holding `shard-*.jsonl.zst` and
`manifest.jsonl`) or a folder of job folders (`DIR`). Records are streamed, so memory
stays flat however large the job; verify keeps one set of ids per job, nothing more.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import zstandard

from regen.consumers.tokenize.record import (
    FINISH_REASONS,
    OPTIONAL_RECORD_FIELDS,
    RECORD_FIELDS,
    RECORD_SCHEMA,
)
from regen.consumers.tokenize.shard_writer import MANIFEST, TMP_SUFFIX, ShardInfo, iter_records

SHARD_GLOB = "shard-*.jsonl.zst"
EXPORT_FORMATS = ("conversations",)
# Past this many record-level problems in one shard, the rest are only counted.
MAX_RECORD_PROBLEMS = 10
_HASH_BLOCK = 1 << 20


def job_folders(folder: Path) -> list[Path]:
    """The job folders at `folder`: itself when it is one, else its sub-folders that are."""
    if _is_job(folder):
        return [folder]
    return sorted(p for p in folder.iterdir() if p.is_dir() and _is_job(p))


def _is_job(folder: Path) -> bool:
    return (folder / MANIFEST).exists() or any(folder.glob(SHARD_GLOB))


def _shards(job: Path) -> list[Path]:
    return sorted(job.glob(SHARD_GLOB))


# --- stats ------------------------------------------------------------------------------


@dataclass
class JobStats:
    job: str
    shards: int = 0
    bytes: int = 0
    uncompressed_bytes: int = 0
    rows: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    drift: int = 0  # records whose re-rendering differs from their ids
    drift_checked: int = 0  # records with a drift check (it can be switched off)
    # Completion lengths in log2 buckets, keyed by the bucket's lower bound: 0, 1, 2, 4, ...
    completion_histogram: Counter[int] = field(default_factory=Counter)

    def histogram_rows(self) -> list[tuple[str, int]]:
        """("lo-hi", count) per bucket, shortest first."""
        return [
            (f"{lo}-{max(lo, 2 * lo - 1)}", n)
            for lo, n in sorted(self.completion_histogram.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job, "shards": self.shards, "bytes": self.bytes,
            "uncompressed_bytes": self.uncompressed_bytes, "rows": self.rows,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "finish_reasons": dict(self.finish_reasons), "drift": self.drift,
            "drift_checked": self.drift_checked,
            "completion_histogram": dict(self.histogram_rows()),
        }  # fmt: skip


def stats(folder: Path) -> list[JobStats]:
    """Per job: totals from the manifest, finish reasons, drift and lengths from a pass
    over the records of the shards the manifest lists."""
    return [_job_stats(job) for job in job_folders(folder)]


def _job_stats(job: Path) -> JobStats:
    out = JobStats(job=job.name)
    for info in _read_manifest(job)[0].values():
        out.shards += 1
        out.bytes += info.compressed_bytes
        out.uncompressed_bytes += info.uncompressed_bytes
        out.rows += info.rows
        out.prompt_tokens += info.prompt_tokens
        out.completion_tokens += info.completion_tokens
        path = job / info.shard
        if not path.exists():
            continue  # verify's business; the totals still say what was committed
        for record in iter_records(path):
            out.finish_reasons[record["finish_reason"]] += 1
            n = record["completion_tokens"]
            out.completion_histogram[1 << (n.bit_length() - 1) if n else 0] += 1
            if record["drift"] is not None:
                out.drift_checked += 1
                out.drift += bool(record["drift"])
    return out


# --- verify -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    job: str
    path: str  # the file inside the job folder
    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.job}/{self.path}: {self.kind}: {self.message}"


def verify(folder: Path) -> list[Problem]:
    """Everything wrong with the shards at `folder`; an empty list means all is well."""
    jobs = job_folders(folder)
    if not jobs:
        return [Problem(folder.name, ".", "no_jobs", f"no job folders (no {MANIFEST}) in {folder}")]
    return [problem for job in jobs for problem in _verify_job(job)]


def _verify_job(job: Path) -> list[Problem]:
    problems: list[Problem] = []

    def report(path: str, kind: str, message: str) -> None:
        problems.append(Problem(job.name, path, kind, message))

    manifest, torn = _read_manifest(job)
    for line in torn:
        report(MANIFEST, "manifest_line", f"unreadable line {line}")
    on_disk = {p.name for p in _shards(job)}
    for name in sorted(manifest.keys() - on_disk):
        report(name, "missing_shard", "listed in the manifest, not on disk")
    for name in sorted(on_disk - manifest.keys()):
        report(name, "unlisted_shard", "on disk, not in the manifest")
    # `.*.tmp`, and `.*.tmp.rewrite` (the writer's staging when it rewrites a shard).
    for tmp in sorted(job.glob(f".*{TMP_SUFFIX}*")):
        report(
            tmp.name,
            "leftover_tmp",
            "temporary file: a shard still being written, or left by a crash",
        )

    seen: set[str] = set()
    for name in sorted(on_disk):
        path = job / name
        info = manifest.get(name)
        if info is not None:
            for kind, message in _check_file(path, info):
                report(name, kind, message)
        for kind, message in _check_records(path, info, seen):
            report(name, kind, message)
    return problems


def _check_file(path: Path, info: ShardInfo) -> Iterator[tuple[str, str]]:
    size = path.stat().st_size
    if size != info.compressed_bytes:
        yield "size", f"{size} bytes on disk, manifest says {info.compressed_bytes}"
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            digest.update(block)
    if digest.hexdigest() != info.sha256:
        yield "checksum", f"sha256 {digest.hexdigest()[:16]}…, manifest says {info.sha256[:16]}…"


def _check_records(path: Path, info: ShardInfo | None, seen: set[str]) -> Iterator[tuple[str, str]]:
    rows = prompt_tokens = completion_tokens = found = 0
    try:
        for row, record in enumerate(iter_records(path)):
            rows += 1
            if isinstance(record, dict):
                prompt_tokens += _int(record.get("prompt_tokens"))
                completion_tokens += _int(record.get("completion_tokens"))
            for kind, message in _check_record(record, seen):
                found += 1
                if found <= MAX_RECORD_PROBLEMS:
                    yield kind, f"row {row}: {message}"
    except (zstandard.ZstdError, orjson.JSONDecodeError, UnicodeDecodeError) as exc:
        yield "unreadable", f"after {rows} rows: {exc}"
        return
    if found > MAX_RECORD_PROBLEMS:
        yield "more", f"{found - MAX_RECORD_PROBLEMS} more record problems in this shard"
    if info is not None and (rows, prompt_tokens, completion_tokens) != (
        info.rows, info.prompt_tokens, info.completion_tokens,
    ):  # fmt: skip
        yield (
            "manifest_mismatch",
            (
                f"{rows} rows, {prompt_tokens}+{completion_tokens} tokens; manifest says "
                f"{info.rows} rows, {info.prompt_tokens}+{info.completion_tokens} tokens"
            ),
        )


def _check_record(record: Any, seen: set[str]) -> Iterator[tuple[str, str]]:
    if not isinstance(record, dict):
        yield "schema", f"not a JSON object: {type(record).__name__}"
        return
    present = {**RECORD_FIELDS, **{k: v for k, v in OPTIONAL_RECORD_FIELDS.items() if k in record}}
    bad = [
        name
        for name, types in present.items()
        # bool is an int to Python; it is not one to a record.
        if not isinstance(record.get(name), types)
        or (isinstance(record.get(name), bool) and bool not in types)
    ]
    if bad:
        yield "schema", f"missing or mistyped field(s) {', '.join(bad)}"
        return
    if record["schema"] != RECORD_SCHEMA:
        yield "schema", f"schema {record['schema']!r}, expected {RECORD_SCHEMA!r}"
    if record["finish_reason"] not in FINISH_REASONS:
        yield "schema", f"finish_reason {record['finish_reason']!r}"
    if record["id"] in seen:
        yield "duplicate_id", f"id {record['id']} appears more than once in the job"
    seen.add(record["id"])
    ids, mask = record["input_ids"], record["loss_mask"]
    n_prompt, n_output = record["prompt_tokens"], record["completion_tokens"]
    if len(ids) != len(mask):
        yield "mask_length", f"{len(ids)} input_ids but {len(mask)} loss_mask entries"
    if len(ids) != n_prompt + n_output:
        yield "token_count", f"{len(ids)} input_ids, counts say {n_prompt}+{n_output}"
    elif len(mask) == len(ids) and mask != [0] * n_prompt + [1] * n_output:
        yield "loss_mask", f"loss_mask is not {n_prompt} zeros then {n_output} ones"


def _int(value: Any) -> int:
    """A count as the manifest sums it; anything else is the schema check's to report."""
    return value if isinstance(value, int) else 0


def _read_manifest(job: Path) -> tuple[dict[str, ShardInfo], list[int]]:
    """Manifest entries by shard, and the numbers of lines that do not parse.

    Like the shard writer's reader (a later line for a shard wins), but keeping count
    of torn lines, which verify reports.
    """
    out: dict[str, ShardInfo] = {}
    torn: list[int] = []
    path = job / MANIFEST
    if not path.exists():
        return out, torn
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                info = ShardInfo(**orjson.loads(line))
            except (orjson.JSONDecodeError, TypeError):
                torn.append(number)
                continue
            out[info.shard] = info
    return out, torn


# --- export -----------------------------------------------------------------------------


def export(folder: Path, out_path: Path, format: str = "conversations") -> int:
    """Write the records as SpecForge's conversation JSONL; returns the rows written.

    One line per record: `{"id", "conversations": [{"role", "content"}, ...]}`, the
    regenerated assistant turn last, with its `reasoning_content` beside `content` when
    the model thought: the shape SpecForge's `regenerate_train_data.py --reasoning save`
    writes. Token ids are not exported; a trainer that wants them reads the shards.
    Written to a temporary file and renamed, so a reader never sees half an export.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; known: {', '.join(EXPORT_FORMATS)}")
    tmp = out_path.with_name(f".{out_path.name}{TMP_SUFFIX}")
    rows = 0
    try:
        with open(tmp, "wb") as out:
            for job in job_folders(folder):
                for shard in _shards(job):
                    for record in iter_records(shard):
                        out.write(orjson.dumps(_conversation(record)) + b"\n")
                        rows += 1
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return rows


def _conversation(record: dict[str, Any]) -> dict[str, Any]:
    turns = []
    for message in record["messages"]:
        turn = {"role": message["role"], "content": message["content"]}
        if "reasoning_content" in message:
            turn["reasoning_content"] = message["reasoning_content"]
        turns.append(turn)
    return {"id": record["id"], "conversations": turns}
