"""`regen shards export`: the records of one or more jobs, as the files trainers read.

Formats (rows and files in export_sinks): `conversations` (text JSONL), `specforge`
(ids and mask JSONL), `speculators` (ids, mask and metadata JSONL) and `hf` (a `datasets`
folder). What is exported, in this order: the records of the jobs chosen (all by
default); less those with a quality flag in `drop_flags` (common/quality.py; by default
every flag but `truncated`); each once (a record found again in a later shard, by its
job and id, is skipped and counted: shard_copies); less those longer than `max_length`
(dropped, or cut to it with `truncate`); less those with no trained token (a prompt cut
to max_length) or fewer than `min_loss_tokens`; split into a held-out set by prompt;
shuffled by a seed. Records are read once and streamed, and the shuffle spills to disk
(export_order), as does the search for copies, so memory stays flat however many
records there are.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from regen.common import crashpoints, provenance
from regen.common.quality_flags import DEFAULT_DROP_FLAGS, FLAGS
from regen.common.samples import prompt_unit
from regen.consumers.tokenize.operator_view import JobFolder, ShardRef, iter_records, job_folders
from regen.ops.dataset_card import ExportedStats, write_card
from regen.ops.export_order import bucket_count, held_out, shuffle_key, sort_by_key
from regen.ops.export_sinks import (
    FORMATS,
    TOKEN_SCHEMA,
    ExportError,
    Row,
    Shape,
    Sink,
    require_datasets,
)
from regen.ops.shard_copies import Copies, find_copies

__all__ = ["EXPORT_FORMATS", "ExportError", "ExportOptions", "ExportSummary", "export"]

EXPORT_FORMATS = tuple(FORMATS)
# Where a crash test kills an export: every row written, no file in place yet.
CRASHPOINT = "export.before_commit"
# speculators' prepare_data.py picks its loader by the --data path's suffix.
_SPECULATORS_SUFFIXES = (".jsonl", ".json")


class Dropped:
    """Why a record is not exported: the summary's reasons."""

    FLAGGED = "flagged"  # by flag in ExportSummary.flagged
    DUPLICATE_ID = "duplicate_id"  # a copy of a record exported from an earlier shard
    TOO_LONG = "too_long"
    # Nothing to train on: a prompt longer than max_length cut to it (with truncate).
    NO_LOSS_TOKENS = "no_loss_tokens"
    FEW_LOSS_TOKENS = "few_loss_tokens"


@dataclass(frozen=True)
class ExportOptions:
    format: str = "conversations"
    jobs: tuple[str, ...] = ()  # names of the job folders to merge; all when empty
    max_length: int | None = None
    truncate: bool = False  # a record over max_length is cut to it instead of dropped
    drop_flags: tuple[str, ...] = DEFAULT_DROP_FLAGS  # records with any of these are left out
    min_loss_tokens: int = 0
    seed: int | None = None  # shuffle with this seed; None keeps shard order
    heldout: float = 0.0  # fraction of records held out, into a second file or folder

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            known = ", ".join(EXPORT_FORMATS)
            raise ExportError(f"unknown export format {self.format!r}; known: {known}")
        if self.max_length is not None and self.max_length < 1:
            raise ExportError(f"max_length must be at least 1, not {self.max_length}")
        if self.truncate and self.max_length is None:
            raise ExportError("--truncate cuts records to --max-length, which is not set")
        if self.truncate and self.format == "conversations":
            raise ExportError("--truncate: conversations rows are text, with no ids to cut")
        unknown = [flag for flag in self.drop_flags if flag not in FLAGS]
        if unknown:
            raise ExportError(
                f"unknown quality flag {', '.join(unknown)}; known: {', '.join(FLAGS)}"
            )
        if self.min_loss_tokens < 0:
            raise ExportError(f"min_loss_tokens must be 0 or more, not {self.min_loss_tokens}")
        if not 0 <= self.heldout < 1:
            raise ExportError(f"the held-out fraction must be in [0, 1), not {self.heldout}")


@dataclass
class ExportSummary:
    out: Path
    heldout_out: Path | None = None
    written: int = 0  # to `out`
    held_out: int = 0  # to `heldout_out`
    cut: int = 0  # written, but cut to max_length
    dropped: Counter[str] = field(default_factory=Counter)  # by Dropped reason
    # The records dropped for their flags, by flag (one with two counts under both).
    flagged: Counter[str] = field(default_factory=Counter)
    # What the written and the held-out records hold (for the hf dataset card).
    stats: tuple[ExportedStats, ExportedStats] = field(
        default_factory=lambda: (ExportedStats(), ExportedStats())
    )
    # Shards holding copies: (the shard exported from, the shard with the copies, how
    # many, an id), each as JOB_FOLDER/SHARD.
    duplicates: list[tuple[str, str, int, str]] = field(default_factory=list)
    # A `datasets` folder's card was written without its histogram picture (no matplotlib).
    card_without_picture: bool = False

    def line(self) -> str:
        parts = [f"wrote {self.written:,} records to {self.out}"]
        if self.heldout_out is not None:
            parts.append(f"{self.held_out:,} held out to {self.heldout_out}")
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(self.dropped.items()))
        parts.append(f"dropped {self.dropped.total():,}" + (f" ({reasons})" if reasons else ""))
        if self.flagged:
            flags = ", ".join(f"{flag} {n:,}" for flag, n in sorted(self.flagged.items()))
            parts.append(f"dropped by flag: {flags}")
        parts.append(f"cut {self.cut:,}")
        return "; ".join(parts)


def heldout_path(out: Path) -> Path:
    """Where the held-out records go by default: `data.jsonl` -> `data.heldout.jsonl`."""
    return out.with_name(f"{out.stem}.heldout{out.suffix}")


def export(
    folder: Path | str,
    out: Path,
    options: ExportOptions | None = None,
    heldout_out: Path | None = None,
    dead_letters: dict[str, Counter[str]] | None = None,
) -> ExportSummary:
    """Write the records at `folder` (a job folder or a folder of them, local or in a
    bucket: read streamed either way) to `out`, and the
    held-out ones to `heldout_out` (default: heldout_path(out)) when options.heldout.

    Every output carries the jobs' provenance (common/provenance.py): a `datasets` folder
    in its dataset card and `provenance.json`, a file beside it as OUT.provenance.json.
    `dead_letters` (by stage, then reason), where known, go into the card."""
    options = options or ExportOptions()
    jobs = select_jobs(folder, options.jobs)
    if heldout_out is not None and not options.heldout:
        raise ExportError("a held-out output is given but no held-out fraction (--split)")
    summary = ExportSummary(out)
    paths = [out]
    if options.heldout:
        summary.heldout_out = heldout_out or heldout_path(out)
        paths.append(summary.heldout_out)
    _check_outputs(options.format, paths)
    shape, open_sink = FORMATS[options.format]
    shards = [shard for job in jobs for shard in job.shards()]
    sinks: list[Sink] = []
    try:
        for path in paths:
            sinks.append(open_sink(path))
        with ExitStack() as stack:
            scratch = Path(
                stack.enter_context(
                    tempfile.TemporaryDirectory(prefix=f".{out.name}.export-", dir=out.parent)
                )
            )
            copies = find_copies(shards, scratch)
            summary.duplicates = [
                (_label(shards[p.first]), _label(shards[p.copy]), p.count, p.example)
                for p in copies.pairs
            ]
            selected = _selected(shards, copies, options, summary, shape)
            rows: Iterator[tuple[bool, Row]]
            if options.seed is None:
                rows = ((is_held_out, row) for _, is_held_out, row in selected)
            else:
                rows = _shuffled(selected, options.seed, _data_bytes(jobs), scratch)
            for is_held_out, row in rows:
                sinks[is_held_out].write(row)
                if options.format == "hf":
                    summary.stats[is_held_out].add(row)
                if is_held_out:
                    summary.held_out += 1
                else:
                    summary.written += 1
        crashpoints.hit(CRASHPOINT)
        for sink in sinks:
            sink.commit()
        _describe(options, summary, paths, jobs, dead_letters)
    except BaseException:
        for sink in sinks:
            sink.abort()
        raise
    return summary


def _describe(
    options: ExportOptions,
    summary: ExportSummary,
    paths: list[Path],
    jobs: list[JobFolder],
    dead_letters: dict[str, Counter[str]] | None,
) -> None:
    """Write each output's provenance, and a `datasets` folder's card: each job's
    provenance.json with the SGLang versions its records were generated by (from its
    manifest: the servers' versions are known only as their results come in)."""
    made_by = []
    for job in jobs:
        found = job.read_provenance()
        if found is not None:
            versions: Counter[str] = Counter()
            for info in job.manifest().shards.values():
                versions.update(info.server_versions)
            made_by.append({**found, "server_versions": dict(versions)})
    for path, stats in zip(paths, summary.stats, strict=False):
        if options.format != "hf":
            sidecar = path.with_name(f"{path.name}.provenance.json")
            sidecar.write_bytes(orjson.dumps({"jobs": made_by}, option=orjson.OPT_INDENT_2))
            continue
        (path / provenance.PROVENANCE_FILE).write_bytes(
            orjson.dumps({"jobs": made_by}, option=orjson.OPT_INDENT_2)
        )
        features = require_datasets().Features.from_arrow_schema(TOKEN_SCHEMA)._to_yaml_list()
        size = sum(f.stat().st_size for f in path.glob("data-*.arrow"))
        drawn = write_card(
            path, features=features, num_bytes=size, stats=stats, dropped=summary.dropped,
            provenances=made_by, dead_letters=dead_letters,
        )  # fmt: skip
        summary.card_without_picture |= not drawn


def select_jobs(folder: Path | str, names: Sequence[str]) -> list[JobFolder]:
    """The job folders to export: those named, in the order given, or else all."""
    jobs = job_folders(folder)
    if not jobs:
        raise ExportError(f"no job folders in {folder}")
    if not names:
        return jobs
    by_name = {job.name: job for job in jobs}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ExportError(
            f"no job {', '.join(unknown)} in {folder}; its jobs: {', '.join(by_name)}"
        )
    return [by_name[name] for name in dict.fromkeys(names)]


def _check_outputs(fmt: str, paths: list[Path]) -> None:
    if len(set(paths)) < len(paths):
        raise ExportError(f"the held-out output is the same path as --out: {paths[0]}")
    for path in paths:
        if fmt == "hf" and path.exists():
            raise ExportError(f"{path} exists; remove it or choose another output folder")
        if fmt != "hf" and path.is_dir():
            raise ExportError(f"{path} is a folder; --format {fmt} writes one file")
        if fmt == "speculators" and path.suffix not in _SPECULATORS_SUFFIXES:
            raise ExportError(
                f"{path}: speculators' prepare_data.py reads only files named *.jsonl or "
                "*.json; name the output so"
            )
        path.parent.mkdir(parents=True, exist_ok=True)


def _label(shard: ShardRef) -> str:
    return f"{shard.folder.name}/{shard.name}"


def _selected(
    shards: list[ShardRef],
    copies: Copies,
    options: ExportOptions,
    summary: ExportSummary,
    shape: Shape,
) -> Iterator[tuple[str, bool, Row]]:
    """(the shuffle's key, held out?, row) for each record exported, in shard order;
    copies, drops and cuts counted in `summary`."""
    for number, shard in enumerate(shards):
        skip = copies.rows_in(number)
        for row, record in enumerate(iter_records(shard)):
            if row in skip:
                summary.dropped[Dropped.DUPLICATE_ID] += 1
                continue
            fitted = _fit(record, options, summary)
            if fitted is None:
                continue
            # By conversation where there is one (`--turns all`), and by prompt across its
            # samples: a held-out set that shares a conversation's earlier turns or a
            # prompt's other answers with training would not be held out.
            unit = prompt_unit(fitted)
            is_held_out = bool(options.heldout) and held_out(unit, options.heldout)
            yield f"{fitted['job']}\0{fitted['id']}", is_held_out, shape(fitted)


def _fit(record: Row, options: ExportOptions, summary: ExportSummary) -> Row | None:
    """The record as exported (cut to max_length with truncate), or None when dropped."""
    flagged = [flag for flag in record.get("flags", ()) if flag in options.drop_flags]
    if flagged:
        summary.dropped[Dropped.FLAGGED] += 1
        summary.flagged.update(flagged)
        return None
    cut = False
    length = options.max_length
    if length is not None and len(record["input_ids"]) > length:
        if not options.truncate:
            summary.dropped[Dropped.TOO_LONG] += 1
            return None
        record, cut = _cut(record, length), True
    trained = sum(record["loss_mask"])
    if not trained:  # a row of prompt alone teaches nothing and can upset a trainer's loss
        summary.dropped[Dropped.NO_LOSS_TOKENS] += 1
        return None
    if trained < options.min_loss_tokens:
        summary.dropped[Dropped.FEW_LOSS_TOKENS] += 1
        return None
    summary.cut += cut
    return record


def _cut(record: Row, length: int) -> Row:
    """The record's first `length` tokens. A cut answer no longer ends where the model
    stopped, so it reads as finish `length`, like one cut by max_new_tokens."""
    prompt = min(record["prompt_tokens"], length)
    return {
        **record,
        "input_ids": record["input_ids"][:length],
        "loss_mask": record["loss_mask"][:length],
        "prompt_tokens": prompt,
        "completion_tokens": length - prompt,
        "finish_reason": "length",
    }


def _shuffled(
    selected: Iterator[tuple[str, bool, Row]], seed: int, data_bytes: int, scratch: Path
) -> Iterator[tuple[bool, Row]]:
    keyed = ((shuffle_key(seed, key), [is_held_out, row]) for key, is_held_out, row in selected)
    payload: Any
    for payload in sort_by_key(keyed, bucket_count(data_bytes), scratch):
        yield payload[0], payload[1]


def _data_bytes(jobs: list[JobFolder]) -> int:
    """The records' size, from the manifests: what the shuffle's buckets will hold, at
    most (rows drop `messages` and the like)."""
    return sum(info.uncompressed_bytes for job in jobs for info in job.manifest().shards.values())
