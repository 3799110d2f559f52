"""A tokenize worker that finds Redis behind a job's shard folder rebuilds the job's
ledger itself (consumers/tokenize/recover.py), once, under a lock, and then writes on.

The rebuild needs the shard folder, and the tokenize worker is where the folder is.
Several workers may find the same rollback at once (each checks at its job refresh and
before each commit: ledger_vs_disk.py), so the first takes a lock in Redis (SET NX with an
expiry, renewed while the recovery runs) and the others leave the job alone until it is
done; a worker killed mid-recovery lets the lock expire, and the next worker to find
Redis behind runs it again (recovery is safe to rerun). Under the lock the folder is
checked again: a worker that took the lock just after another finished finds nothing
to do. While Redis is behind, `keys.job_behind` is set, so that the job's follower
(`regen enqueue --follow`, producer/healer.py) forgets no id and queues nothing before
the ledger is whole again: recovery deletes it (docs/design/exactly-once.md, "Healing").
"""

from __future__ import annotations

import logging
import threading
import uuid

import redis

from regen.common import defaults, jobspec, keys
from regen.common.ledger.commit_ledger import CommitLedger
from regen.consumers.tokenize.job_folder import JobFolder
from regen.consumers.tokenize.ledger_vs_disk import check, manifest_epoch
from regen.consumers.tokenize.recover import Recovery, recover

log = logging.getLogger("regen.tokenize")

# KEYS[1]: the lock; ARGV: the holder's token, the expiry in ms. Renews or releases the
# lock only while this holder has it (an expired lock another worker took stays theirs).
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RecoveryLock:
    """The job's recovery lock, held from `acquire` until `release`, renewed meanwhile by
    a thread every third of its expiry."""

    def __init__(self, r: redis.Redis, job: str, owner: str, ttl_s: float) -> None:
        self._r = r
        self._key = keys.job_recover_lock(job)
        self._token = f"{owner}:{uuid.uuid4().hex}"
        self._ttl_ms = int(ttl_s * 1000)
        self._renew = r.register_script(_RENEW_LUA)
        self._release = r.register_script(_RELEASE_LUA)
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._keep, name="regen-recover-lock", daemon=True)

    def acquire(self) -> bool:
        if not self._r.set(self._key, self._token, nx=True, px=self._ttl_ms):
            return False
        self._renewer.start()
        return True

    def _keep(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                self._renew(keys=[self._key], args=[self._token, self._ttl_ms])
            except redis.RedisError as exc:  # the next renewal may get through
                log.warning("renewing the recovery lock failed: %s", exc)

    def release(self) -> None:
        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join()
        self._release(keys=[self._key], args=[self._token])


def recover_behind(
    r: redis.Redis,
    job: str,
    folder: JobFolder,
    owner: str,
    ttl_s: float = defaults.RECOVER_LOCK_TTL_S,
) -> Recovery | None:
    """Rebuild `job`'s ledger from `folder` (OUT/JOB) when Redis is still behind it and no
    other worker is doing so; the report, or None when nothing was run here."""
    r.set(keys.job_behind(job), owner)  # before the lock: the follower waits from now on
    if job not in jobspec.list_jobs(r):
        # Redis lost everything, the spec with it: recovery needs the spec (the committed
        # index's layout, --turns). The job's follower stores it again; retried then.
        log.error("job %s: Redis is behind its shards and lost its spec too; waiting for "
                  "the job's `regen enqueue --follow` to store it again", job)  # fmt: skip
        return None
    lock = RecoveryLock(r, job, owner, ttl_s)
    if not lock.acquire():
        log.info("job %s: another tokenize worker is recovering it", job)
        return None
    try:
        if not check(CommitLedger(r, job), folder, manifest_epoch(folder)).behind:
            r.delete(keys.job_behind(job))  # another worker recovered it just now
            return None
        log.warning("job %s: Redis is behind its shards; rebuilding its ledger from %s",
                    job, folder)  # fmt: skip
        report = recover(r, job, folder)
    finally:
        lock.release()
    log.warning(
        "job %s: ledger rebuilt from %d shard(s): %d shard(s), %d id(s) restored; %d id(s) "
        "in no place taken out of the job's ids; epoch %d -> %d; the job's follower "
        "queues what Redis lost",
        job, report.shards_on_disk, len(report.shards_restored), report.ids_restored,
        report.missing_requeued, *report.epoch,
    )  # fmt: skip
    if not report.ok:
        log.error("job %s: its shards hold problems recovery cannot mend; "
                  "`regen shards verify` lists them", job)  # fmt: skip
    return report
