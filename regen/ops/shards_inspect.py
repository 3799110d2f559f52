"""Reading a tokenize stage's output: stats and verification (export: export.py).

Each function takes a job folder (`DIR/JOB`, holding shards and `manifest.jsonl`) or a
folder of job folders (`DIR`), local or in a bucket, and reads them through JobFolder
(job_folder.py) and the shard module (shard_files).
Records are streamed, so memory stays flat however large the job; verify spills the
records' ids to find copies (shard_copies), rather than hold them.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regen.common.record import (
    FINISH_REASONS,
    OPTIONAL_RECORD_FIELDS,
    RECORD_FIELDS,
    RECORD_SCHEMA,
    RECORD_SCHEMAS,
)
from regen.consumers.tokenize.operator_view import (
    MANIFEST,
    READ_ERRORS,
    JobFolder,
    ShardInfo,
    ShardRef,
    iter_records,
    job_folders,
)
from regen.ops.shard_copies import CopyFinder, record_key

# Past this many record-level problems in one shard, the rest are only counted.
MAX_RECORD_PROBLEMS = 10
_HASH_BLOCK = 1 << 20


def job_records(job: JobFolder) -> Iterator[dict[str, Any]]:
    """Every record of a job folder, shard by shard in name order."""
    for shard in job.shards():
        yield from iter_records(shard)


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


def stats(folder: Path | str) -> list[JobStats]:
    """Per job: totals from the manifest, finish reasons, drift and lengths from a pass
    over the records of the shards the manifest lists."""
    return [_job_stats(job) for job in job_folders(folder)]


def _job_stats(job: JobFolder) -> JobStats:
    out = JobStats(job=job.name)
    for info in job.manifest().shards.values():
        out.shards += 1
        out.bytes += info.compressed_bytes
        out.uncompressed_bytes += info.uncompressed_bytes
        out.rows += info.rows
        out.prompt_tokens += info.prompt_tokens
        out.completion_tokens += info.completion_tokens
        if not job.has(info.shard):
            continue  # verify's business; the totals still say what was committed
        for record in iter_records(ShardRef(job, info.shard)):
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
    # Worth knowing, but nothing is wrong with the data (verify exits 0 on warnings alone).
    warning: bool = False

    def __str__(self) -> str:
        text = f"{self.job}/{self.path}: {self.kind}: {self.message}"
        return f"warning: {text}" if self.warning else text


def verify(folder: Path | str) -> list[Problem]:
    """Everything wrong with the shards at `folder`; an empty list means all is well.

    A record found again (its job and id) in a later shard, or later in the same one,
    is a `duplicate_id`, reported on the shard of the copy with the shard it repeats:
    across job folders too, so a folder copied beside its job is caught. Found with
    keys spilled to the system's temporary folder (shard_copies), so memory stays flat.
    """
    jobs = job_folders(folder)
    if not jobs:
        name = str(folder).rstrip("/").rsplit("/", 1)[-1]
        return [Problem(name, ".", "no_jobs", f"no job folders (no {MANIFEST}) in {folder}")]
    shards = [shard for job in jobs for shard in job.shards()]
    with tempfile.TemporaryDirectory(prefix="regen-verify-") as scratch:
        finder = CopyFinder(Path(scratch), len(shards), sum(s.size() for s in shards))
        numbers = {path: number for number, path in enumerate(shards)}
        problems = [problem for job in jobs for problem in _verify_job(job, finder, numbers)]
        copies = finder.finish()
    for pair in copies.pairs:
        first, copy = shards[pair.first], shards[pair.copy]
        ids = "1 id" if pair.count == 1 else f"{pair.count:,} ids"
        problems.append(Problem(copy.folder.name, copy.name, "duplicate_id",
                                f"{ids} also in {first.folder.name}/{first.name} "
                                f"(e.g. {pair.example})"))  # fmt: skip
    return problems


def _verify_job(job: JobFolder, finder: CopyFinder, numbers: dict[ShardRef, int]) -> list[Problem]:
    problems: list[Problem] = []

    def report(path: str, kind: str, message: str, warning: bool = False) -> None:
        problems.append(Problem(job.name, path, kind, message, warning))

    manifest_file = job.manifest()
    manifest = manifest_file.shards
    for _, why in manifest_file.bad:
        report(MANIFEST, "manifest_line", why)
    for line in manifest_file.torn:
        # A crash mid-append: the shard it was for is listed by a later line (recovery
        # rebuilds it) or reported unlisted below; the next append cuts a last one off.
        why = f"line {line}: torn by a crash mid-append; ignored"
        report(MANIFEST, "torn_manifest_line", why, warning=True)
    on_disk = set(job.shard_names())
    for name in sorted(manifest.keys() - on_disk):
        report(name, "missing_shard", "listed in the manifest, not on disk")
    for name in sorted(on_disk - manifest.keys()):
        report(name, "unlisted_shard", "on disk, not in the manifest")
    for tmp in job.leftovers():
        report(
            tmp,
            "leftover_tmp",
            "temporary file: a shard still being written, or left by a crash",
        )

    for name in sorted(on_disk):
        path = ShardRef(job, name)
        info = manifest.get(name)
        if info is not None:
            for kind, message in _check_file(path, info):
                report(name, kind, message)

        def seen(row: int, job_name: str, rid: str, number: int = numbers[path]) -> None:
            finder.add(number, row, record_key(job_name, rid))

        for kind, message in _check_records(path, info, seen):
            report(name, kind, message)
    return problems


def _check_file(path: ShardRef, info: ShardInfo) -> Iterator[tuple[str, str]]:
    size = path.size()
    if size != info.compressed_bytes:
        yield "size", f"{size} bytes on disk, manifest says {info.compressed_bytes}"
    digest = hashlib.sha256()
    with path.open() as fh:
        while block := fh.read(_HASH_BLOCK):
            digest.update(block)
    if digest.hexdigest() != info.sha256:
        yield "checksum", f"sha256 {digest.hexdigest()[:16]}…, manifest says {info.sha256[:16]}…"


def _check_records(
    path: ShardRef, info: ShardInfo | None, seen: Callable[[int, str, str], None]
) -> Iterator[tuple[str, str]]:
    """Problems of the records of one shard; `seen(row, job, id)` is told each record's
    job and id, for the search for copies."""
    rows = prompt_tokens = completion_tokens = found = 0
    try:
        for row, record in enumerate(iter_records(path)):
            rows += 1
            if isinstance(record, dict):
                prompt_tokens += _int(record.get("prompt_tokens"))
                completion_tokens += _int(record.get("completion_tokens"))
                rid, job = record.get("id"), record.get("job")
                if isinstance(rid, str) and isinstance(job, str):
                    seen(row, job, rid)
            for kind, message in _check_record(record):
                found += 1
                if found <= MAX_RECORD_PROBLEMS:
                    yield kind, f"row {row}: {message}"
    except READ_ERRORS as exc:
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


def _check_record(record: Any) -> Iterator[tuple[str, str]]:
    if not isinstance(record, dict):
        yield "schema", f"not a JSON object: {type(record).__name__}"
        return
    # An unknown schema is checked against the current fields, then reported; a field a
    # record has only in some cases is checked where it is there.
    fields = RECORD_SCHEMAS.get(str(record.get("schema")), RECORD_FIELDS)
    fields = {**fields, **{k: v for k, v in OPTIONAL_RECORD_FIELDS.items() if k in record}}
    bad = [
        name
        for name, types in fields.items()
        # A nullable field must still be there; bool is an int to Python, not to a record.
        if name not in record
        or not isinstance(record[name], types)
        or (isinstance(record[name], bool) and bool not in types)
    ]
    if bad:
        yield "schema", f"missing or mistyped field(s) {', '.join(bad)}"
        return
    if record["schema"] not in RECORD_SCHEMAS:
        yield "schema", f"schema {record['schema']!r}, expected {RECORD_SCHEMA!r} or older"
    if record["finish_reason"] not in FINISH_REASONS:
        yield "schema", f"finish_reason {record['finish_reason']!r}"
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
