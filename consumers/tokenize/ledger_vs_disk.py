"""The disk is the truth for committed shards: a job's ledger in Redis must know every
shard file in the job's folder before anything more is written there.

A Redis restored from an older copy (a backup, a failover to a replica that lagged)
has forgotten the shards committed since: their ids look free again, and the shard
counter hands out their numbers a second time. A writer that went on would write those
ids twice (and, renaming over a name, destroy a committed shard). So the tokenize stage
checks, when it opens a job and before each commit, that Redis knows every shard file
(in place or pending) and that its epoch is not older than the newest the manifest
records, and stops writing the job otherwise until the ledger is rebuilt from the
folder (consumers/tokenize/recover.py): the tokenize worker that finds it runs that itself, once
across the workers (self_recovery.py); an operator may run it as `regen recover`.
`regen status` runs the same check where it can read the folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from regen.common.ledger.commit_ledger import CommitLedger
from regen.consumers.tokenize.job_folder import JobFolder

# Unknown shards named in a message; the rest are counted.
_NAMED = 3


class RedisBehind(Exception):
    """Redis knows less than the job's shard folder; the message says what and names the
    fix."""


def recover_command(job: str, folder: JobFolder) -> str:
    """The command that rebuilds the job's ledger from its shard folder (OUT/JOB)."""
    return f"regen recover --job {job} --out {folder.out}"


def manifest_epoch(folder: JobFolder) -> int:
    """The newest ledger epoch the folder's manifest records (0: none)."""
    return max((info.epoch for info in folder.manifest().shards.values()), default=0)


@dataclass(frozen=True)
class DiskCheck:
    """The ledger against the folder at one moment."""

    unknown: list[str]  # shard files neither in place nor pending in Redis
    disk_epoch: int
    redis_epoch: int

    @property
    def behind(self) -> bool:
        return bool(self.unknown) or self.redis_epoch < self.disk_epoch

    def problem(self) -> str:
        """What Redis is missing, in a few words."""
        parts = []
        if self.unknown:
            named = ", ".join(self.unknown[:_NAMED])
            more = f" and {len(self.unknown) - _NAMED} more" if len(self.unknown) > _NAMED else ""
            parts.append(f"{len(self.unknown)} shard file(s) it does not know ({named}{more})")
        if self.redis_epoch < self.disk_epoch:
            parts.append(f"ledger epoch {self.redis_epoch}, the manifest's {self.disk_epoch}")
        return "; ".join(parts)


def check(ledger: CommitLedger, folder: JobFolder, disk_epoch: int) -> DiskCheck:
    """Compare the folder's shard files, and `disk_epoch` (the newest the writer knows the
    manifest to hold), with the ledger."""
    return DiskCheck(ledger.unknown_shards(folder.shard_names()), disk_epoch, ledger.epoch())


def behind_error(job: str, folder: JobFolder, problem: str) -> RedisBehind:
    """The refusal of a writer that found Redis behind the disk, naming the fix."""
    return RedisBehind(
        f"job {job}: Redis is behind the shards in {folder}: {problem}. It was restored "
        "from an older copy or failed over to a lagging replica, so this job is not written "
        "until its ledger is rebuilt from the folder (nothing is overwritten or written "
        "twice). The tokenize stage rebuilds it by itself (self_recovery.py) and the job's "
        "`regen enqueue --follow` queues what Redis lost; by hand: "
        f"`{recover_command(job, folder)}`, then the job's `regen enqueue` command."
    )


def ensure_current(ledger: CommitLedger, job: str, folder: JobFolder, disk_epoch: int) -> int:
    """The ledger's epoch, after checking that Redis is not behind the folder (raises
    RedisBehind)."""
    found = check(ledger, folder, disk_epoch)
    if found.behind:
        raise behind_error(job, folder, found.problem())
    return found.redis_epoch


def behind_message(ledger: CommitLedger, job: str, folder: JobFolder) -> str | None:
    """For the operator commands: why Redis is behind the folder, with the fix; None
    when it is not."""
    found = check(ledger, folder, manifest_epoch(folder))
    return str(behind_error(job, folder, found.problem())) if found.behind else None
