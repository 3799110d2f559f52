"""`regen verify`: every prompt id a job enqueued, reconciled to exactly one place.

The places, in precedence order (a prompt moves down this list as it is processed):
1. done: committed to a shard in place (the `committed` index, less pending claims);
2. in flight: open in a chunk a worker holds, a result on the stream, or claimed by a
   shard being committed;
3. waiting: open in a chunk on the generate queue;
4. dead-lettered: in a DLQ (its most downstream stage counts);
5. purged: its dead letter deleted for good (`regen dlq purge`).
"Exactly once" means each enqueued id has a place, and is in no two places the
pipeline's guarantees keep apart. At-least-once delivery does put an id in several
places at once, and those are counted as notes, not problems: a chunk and its result
(counted in flight once), two results for one id (a chunk that ran twice), a result for
an id already done (the tokenize stage drops it). These are problems (exit status 1):
- missing: enqueued, in no place;
- in two chunks; dead-lettered in two stages; dead-lettered and also waiting, in flight
  or done (a requeue takes an entry out of its DLQ in the step that queues it, and a
  commit drops the id's dead letters);
- placed somewhere but never enqueued; committed to a shard neither in place nor pending;
- shard files (when readable): an id twice in a job's shards (or in a shard but
  committed to another), in a shard but not committed, committed but not in its shard,
  a listed shard without its file, or a shard file the job does not list.
The reads are not one transaction (a job can hold 1M ids), so on a running job an id can
move between them: every id that looks wrong gets a second look with fresh reads, and
only what is still wrong then is reported.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from regen.common import keys, provenance, tokenizer_refusals
from regen.common.jobspec import JobSpec
from regen.consumers.tokenize.operator_view import (
    CommitLedger,
    JobFolder,
    as_folder,
    behind_message,
)
from regen.ops import accounting, locate
from regen.ops.accounting import text
from regen.ops.reconcile_shards import BATCH, batches, check_shards, shard_folder
from regen.producer.job_ids import JobIds

# Problems kept per kind, with their ids; beyond that they are only counted.
MAX_LISTED = 100


@dataclass
class Reconciliation:
    job: str
    enqueued: int = 0
    places: Counter[str] = field(default_factory=Counter)
    # Ids placed in a DLQ: stage -> reason -> count.
    dead_letters: dict[str, Counter[str]] = field(default_factory=dict)
    notes: Counter[str] = field(default_factory=Counter)
    problem_counts: Counter[str] = field(default_factory=Counter)
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # kind, id, detail
    shards_read: int = 0
    shard_ids_read: int = 0
    shards_note: str = ""
    # What is not a problem of accounting but worth knowing (servers' versions mixed).
    warnings: list[str] = field(default_factory=list)
    max_listed: int = MAX_LISTED  # problems listed per kind

    def problem(self, kind: str, subject: str, detail: str) -> None:
        self.problem_counts[kind] += 1
        if self.problem_counts[kind] <= self.max_listed:
            self.problems.append((kind, subject, detail))

    @property
    def ok(self) -> bool:
        return not self.problem_counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job, "ok": self.ok, "enqueued": self.enqueued,
            "places": dict(self.places),
            "dead_letters": {
                s: dict(self.dead_letters[s]) for s in keys.STAGES if s in self.dead_letters
            },
            "notes": dict(self.notes), "problem_counts": dict(self.problem_counts),
            "problems": [{"kind": k, "id": i, "detail": d} for k, i, d in self.problems],
            "shards_read": self.shards_read, "shard_ids_read": self.shard_ids_read,
            "shards_note": self.shards_note, "warnings": self.warnings,
        }  # fmt: skip


@dataclass
class _Window:
    """The job's moving parts at one reading."""

    waiting: set[str] = field(default_factory=set)  # open in a queued chunk
    # Open in a chunk a worker holds, a result on the stream, or claimed by a shard
    # being committed.
    in_flight: set[str] = field(default_factory=set)
    chunk_of: dict[str, str] = field(default_factory=dict)  # open id -> its chunk
    stream: Counter[str] = field(default_factory=Counter)
    dead: dict[str, list[str]] = field(default_factory=dict)  # id -> stages
    reasons: dict[str, dict[str, str]] = field(default_factory=dict)  # stage -> id -> reason
    pending: dict[str, list[str]] = field(default_factory=dict)  # shard -> claimed ids
    purged: set[str] = field(default_factory=set)
    everywhere: set[str] = field(default_factory=set)  # every id seen, for "not enqueued"


def _read_window(
    r: redis.Redis, ledger: CommitLedger, spec: JobSpec, report: Reconciliation | None
) -> _Window:
    """Read in the direction prompts move (queues, workers, stream, shards being
    committed, DLQs), so a prompt moving on meanwhile is seen twice, not missed."""
    w = _Window()
    for chunk in locate.window_contents(r, spec):
        w.everywhere.update(chunk.prompt_ids)
        for pid in chunk.open_ids:
            other = w.chunk_of.setdefault(pid, chunk.chunk_id)
            if other != chunk.chunk_id and report is not None:
                report.problem("in_two_chunks", pid, f"chunks {other} and {chunk.chunk_id}")
            (w.in_flight if chunk.in_flight else w.waiting).add(pid)
    w.stream.update(locate.stream_result_ids(r, spec.name))
    w.pending = {shard: claim.ids for shard, claim in ledger.pending().items()}
    w.in_flight.update(w.stream, *w.pending.values())
    for stage in keys.STAGES:
        w.reasons[stage] = accounting.dead_letter_reasons(r, spec.name, stage)
        for entry_id in w.reasons[stage]:
            if accounting.is_prompt_entry(entry_id):
                w.dead.setdefault(entry_id, []).append(stage)
    w.purged = {text(m) for m in r.sscan_iter(keys.dlq_purged(spec.name), count=BATCH)}
    w.everywhere.update(w.in_flight, w.dead, w.purged)
    return w


def _classify(
    report: Reconciliation, w: _Window, ids: list[str], owners: list[str | None], final: bool
) -> list[str]:
    """Place each id (see the module doc). On a first pass (`final` False) an id that
    looks wrong is not placed but returned, for a second look with fresh reads."""
    second_look = []
    for pid, owner in zip(ids, owners, strict=True):
        stages = w.dead.get(pid, [])
        done = owner is not None and owner not in w.pending
        live = "in_flight" if pid in w.in_flight else "waiting" if pid in w.waiting else None
        placed = bool(done or live or stages or pid in w.purged)
        if not final and (len(stages) > 1 or bool(stages and (done or live)) or not placed):
            second_look.append(pid)
            continue
        if len(stages) > 1:
            report.problem("dead_lettered_twice", pid, f"in the {' and '.join(stages)} DLQs")
        if done:
            report.places["done"] += 1
            if stages:
                report.problem("done_and_dead_lettered", pid, f"in {owner}, {stages[0]} DLQ")
            if w.stream[pid]:  # a chunk ran twice: the tokenize stage drops the result
                report.notes["result_of_a_done_prompt"] += 1
            if pid in w.chunk_of:  # will be generated again, and dropped the same way
                report.notes["done_and_open_in_a_chunk"] += 1
        elif live is not None:
            report.places[live] += 1
            if stages:
                report.problem("live_and_dead_lettered", pid, f"{live}, {stages[0]} DLQ")
            if w.stream[pid] > 1:
                report.notes["duplicate_results"] += 1
        elif stages:
            stage = stages[-1]  # keys.STAGES order: the most downstream
            report.places["dead_lettered"] += 1
            report.dead_letters.setdefault(stage, Counter())[w.reasons[stage][pid]] += 1
        elif pid in w.purged:
            report.places["purged"] += 1
        else:
            report.places["missing"] += 1
            report.problem("missing", pid, "enqueued, in no queue, worker, stream, shard or DLQ")
    return second_look


def _check_owners(ledger: CommitLedger, per_shard: Counter[str], report: Reconciliation) -> None:
    """Every shard the index names is in place or pending. Read after the index: a shard
    claimed meanwhile is pending or in place by now; one released meanwhile (its claim
    undone) has no ids left, which a second look at the index shows."""
    final, pending = ledger.shard_names()
    unknown = per_shard.keys() - final - pending
    if not unknown:
        return
    still = Counter(shard for _, shard in ledger.iter_committed() if shard in unknown)
    for shard, count in sorted(still.items()):
        detail = f"{count} ids committed to it; it is neither in place nor pending"
        report.problem("unknown_shard", shard, detail)


def _enqueued(r: redis.Redis, job: str) -> set[str]:
    """The job's ids. ~100 bytes an id."""
    return set(JobIds(r, job))


def missing_ids(r: redis.Redis, spec: JobSpec) -> list[str]:
    """Every id of the job in no place, each seen so in two readings (the module doc)."""
    report = Reconciliation(spec.name, max_listed=1 << 62)
    _place_enqueued(r, CommitLedger(r, spec.name), spec, report)
    return [pid for kind, pid, _ in report.problems if kind == "missing"]


def _place_enqueued(
    r: redis.Redis, ledger: CommitLedger, spec: JobSpec, report: Reconciliation
) -> tuple[_Window, set[str]]:
    """Place every id of the job; (the first reading, the job's ids)."""
    w = _read_window(r, ledger, spec, report)
    enqueued = _enqueued(r, spec.name)
    report.enqueued = len(enqueued)
    second_look = []
    for batch in batches(enqueued):
        second_look += _classify(report, w, batch, ledger.owner_of(batch), False)
    if second_look:  # on a running job, an id may have moved between two reads
        fresh = _read_window(r, ledger, spec, None)
        _classify(report, fresh, second_look, ledger.owner_of(second_look), True)
    return w, enqueued


def reconcile(
    r: redis.Redis,
    spec: JobSpec,
    shards_dir: JobFolder | Path | str | None,
    read_shards: bool = True,
) -> Reconciliation:
    """Reconcile the job; `shards_dir` overrides where its shards are read from."""
    job = spec.name
    ledger = CommitLedger(r, job)
    report = Reconciliation(job)
    mixed = provenance.mixed_versions(ledger.totals().server_versions)
    if mixed:
        report.warnings.append(mixed)
    report.warnings += tokenizer_refusals.warnings(r, job)
    w, enqueued = _place_enqueued(r, ledger, spec, report)
    report.places.setdefault("missing", 0)  # shown even when none
    for pid in w.everywhere - enqueued:
        report.problem("not_enqueued", pid, "in the pipeline but not in the job's ids")

    per_shard: Counter[str] = Counter()
    for pid, shard in ledger.iter_committed():
        per_shard[shard] += 1
        if pid not in enqueued:
            report.problem("not_enqueued", pid, f"committed to {shard} but not in the job's ids")
    enqueued.clear()  # the largest thing held; what follows needs only per_shard
    _check_owners(ledger, per_shard, report)

    if not read_shards:
        report.shards_note = "shard files not read (--no-shards)"
        return report
    folder = shard_folder(r, job) if shards_dir is None else as_folder(shards_dir)
    if folder is None:
        report.shards_note = "shard files not read: no tokenize worker recorded a folder yet"
        return report
    if not folder.readable_here():
        report.shards_note = (
            f"shard files not read: {folder} is not a folder here (on another host? "
            "give --shards-dir, or --no-shards)"
        )
        return report
    behind = behind_message(ledger, job, folder)
    if behind:
        report.problem("redis_behind", job, behind)
    report.shards_read, report.shard_ids_read = check_shards(
        ledger, folder, per_shard, report.problem
    )
    return report
