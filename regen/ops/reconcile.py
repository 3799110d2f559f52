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
from pathlib import Path

import redis

from regen.common import provenance, tokenizer_refusals
from regen.common.jobspec import JobSpec
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.ledger.places import Reconciliation, place_enqueued
from regen.consumers.tokenize.operator_view import JobFolder, as_folder, behind_message
from regen.ops.reconcile_shards import check_shards, shard_folder


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
    w, enqueued = place_enqueued(r, ledger, spec, report)
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
