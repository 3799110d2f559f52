"""`regen recover`: rebuild a job's commit ledger in Redis from its shard folder.

The disk is the truth for committed shards (consumers/tokenize/ledger_vs_disk.py). After
Redis came back behind the disk (restored from an older copy, a failover to a lagging
replica), every shard file is read, one at a time, and recorded through the commit
ledger as its writer would have: its ids mapped to it in the committed index (ids Redis
had free, or on a shard that is not on disk), the shard in the job's shard list with
its manifest line (rebuilt from the file when missing), counted once, and its ids'
dead letters dropped. Then stale claims are released, the shard counter is moved past
every name on disk, the epoch is raised, and the job's enqueue cursors are dropped so
that the job's own `regen enqueue` re-reads its files from the first row, skipping ids
that are enqueued, committed or dead-lettered: it queues exactly the prompts Redis lost
with no record. With `--turns all`, the conversations of the chunks Redis still holds
resume after the turns the shards hold, on those turns' answers, and the answers of the
committed turns of conversations Redis lost whole are saved for that enqueue, which
resumes them the same way (recover_turns).

Then the ids in no place (`regen verify`'s `missing`: their chunk was lost in kombu's
window between popping a message and recording it in `unacked`, as when Redis dies in
between) are taken out of the job's ids, for the same enqueue to queue again.

Besides those, it only adds what the disk proves, so it is safe to run on a healthy
job, and again. Memory holds one shard's ids at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import redis

from regen.common import jobspec, keys
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.ledger.job_ids import reread_from_start
from regen.common.ledger.places import batches, forget_missing, missing_ids
from regen.common.ledger.shard_names import shard_number
from regen.consumers.tokenize.job_folder import JobFolder, ShardRef, as_folder
from regen.consumers.tokenize.ledger_vs_disk import manifest_epoch
from regen.consumers.tokenize.recover_turns import LostAnswers, resume_after_shards
from regen.consumers.tokenize.shard_files import (
    READ_ERRORS,
    ShardInfo,
    describe,
    iter_ids,
)


@dataclass
class Recovery:
    """What `regen recover` found and did."""

    job: str
    folder: JobFolder
    shards_on_disk: int = 0
    # On disk, unknown to Redis (neither in place nor pending): what Redis had lost.
    shards_restored: list[str] = field(default_factory=list)
    # Ids Redis had free that a shard file holds.
    ids_restored: int = 0
    # Ids Redis had on a shard that is not on disk (a stale claim), moved to their file.
    ids_moved: int = 0
    manifest_lines_rebuilt: list[str] = field(default_factory=list)
    claims_released: list[str] = field(default_factory=list)  # pending, never placed
    claims_left: list[str] = field(default_factory=list)  # pending, lease still running
    seq: tuple[int, int] = (0, 0)  # the shard counter before, after
    epoch: tuple[int, int] = (0, 0)
    cursors_dropped: int = 0
    # Ids in no place (their chunk lost in kombu's window) taken out of the job's ids,
    # for its enqueue to queue again.
    missing_requeued: int = 0
    # `--turns all`: committed turns marked generated in the chunks still waiting or in
    # flight, with their answers checkpointed (recover_turns), and their conversations.
    turns_resumed: int = 0
    conversations_resumed: int = 0
    # `--turns all`: committed turns of conversations Redis lost whole (their first turn
    # not in the job's ids), their answers saved for the job's enqueue
    # (recover_turns.LostAnswers), and those conversations.
    answers_saved: int = 0
    conversations_saved: int = 0
    # Problems on disk that recovery cannot mend: (id, shard kept, other shard).
    duplicates: list[tuple[str, str, str]] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (shard, error)

    @property
    def ok(self) -> bool:
        return not self.duplicates and not self.unreadable


def recover(r: redis.Redis, job: str, where: JobFolder | Path | str) -> Recovery:
    """Rebuild `job`'s ledger from its shard folder (OUT/JOB, local or in a bucket)."""
    folder = as_folder(where)
    ledger = CommitLedger(r, job)
    report = Recovery(job, folder)
    manifest = folder.manifest().shards
    paths = folder.shards()
    on_disk = {path.name for path in paths}
    known, _ = ledger.shard_names()
    disk_epoch = manifest_epoch(folder)
    report.shards_on_disk = len(paths)
    spec = jobspec.load(r, job)
    lost = LostAnswers(r, job) if spec.turns == jobspec.TURNS_ALL else None
    for path in paths:
        info = manifest.get(path.name)
        try:
            if info is None:  # placed, then the writer died before its manifest line
                info = describe(path, disk_epoch)
                folder.add_manifest(info)
                report.manifest_lines_rebuilt.append(path.name)
            ids = _restore_shard(ledger, path, info, on_disk, report)
            if lost is not None:
                lost.save(path, ids)
        except (OSError, KeyError, *READ_ERRORS) as exc:
            report.unreadable.append((path.name, str(exc)))
            continue
        if path.name not in known:
            report.shards_restored.append(path.name)
    # After the ledger is whole again: an id it lacked looked missing before.
    missing = missing_ids(r, spec)
    report.missing_requeued = forget_missing(r, spec, missing)
    if lost is not None and missing:
        # Conversations whose first turn just left the job's ids resume on their
        # committed turns' answers, read from the shards that hold them.
        lost.save_settled_before(ledger, folder, missing)
    for claim in ledger.pending().values():  # those in place were recorded above
        if claim.expired():
            ledger.release(claim)
            report.claims_released.append(claim.shard)
        else:
            report.claims_left.append(claim.shard)
    numbers = [shard_number(name) or 0 for name in on_disk | set(report.claims_left)]
    report.seq = ledger.raise_shard_seq(max(numbers, default=0))
    report.epoch = ledger.raise_epoch(disk_epoch)
    resumed = resume_after_shards(r, ledger, spec, folder, on_disk)
    report.turns_resumed, report.conversations_resumed = resumed.turns, resumed.conversations
    if lost is not None:
        report.answers_saved, report.conversations_saved = lost.turns, len(lost.conversations)
    report.cursors_dropped = reread_from_start(r, job)
    # The ledger is whole again: the job's follower may forget ids and queue again.
    r.delete(keys.job_behind(job))
    return report


def _restore_shard(
    ledger: CommitLedger, path: ShardRef, info: ShardInfo, on_disk: set[str], report: Recovery
) -> list[str]:
    """Map the shard's ids that Redis lost to it and record it as committed; returns
    the ids it keeps."""
    name = path.name
    ids: list[str] = []
    remap: list[str] = []
    seen: set[str] = set()
    for batch in batches(iter_ids(path)):
        for pid, owner in zip(batch, ledger.owner_of(batch), strict=True):
            if pid in seen:
                continue  # twice in one shard: `regen shards verify` reports it
            seen.add(pid)
            if owner is not None and owner != name and owner in on_disk:
                report.duplicates.append((pid, owner, name))  # the first shard keeps it
                continue
            ids.append(pid)
            if owner is None:
                report.ids_restored += 1
                remap.append(pid)
            elif owner != name:
                report.ids_moved += 1
                remap.append(pid)
    ledger.restore(name, info.to_json(), remap, ids)
    return ids
