"""The tokenize consumer loop: read results of one or more jobs, write shards, commit.

Results are read with a Redis Streams consumer group (atomic claim, per-entry ack), so
several consumers can share a job. Entries a dead consumer held are taken over once its
heartbeat is stale (takeover.py); as a last resort, XAUTOCLAIM takes any entry idle for
longer than a live consumer keeps a shard open. A Redis outage is waited out: the loop
backs off, then re-reads what it may have missed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import orjson
import redis

from regen.common import defaults, jobspec, keys, settings, tokenizer_refusals
from regen.common.backoff import REDIS_RETRY
from regen.common.chat_family import detect_family
from regen.common.connection import OUTAGE_ERRORS
from regen.common.heartbeat import last_seen
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.record import RecordContext
from regen.common.tokenizer import TokenizerMismatch, load_job_tokenizer
from regen.consumers.tokenize.job_end import JobEnd
from regen.consumers.tokenize.job_folder import (
    JobFolder,
    LocalFolder,
    check_writable,
    job_folder,
    local_root,
)
from regen.consumers.tokenize.job_writer import JobWriter, ShardPolicy
from regen.consumers.tokenize.ledger_vs_disk import RedisBehind, ensure_current, manifest_epoch
from regen.consumers.tokenize.self_recovery import recover_behind
from regen.consumers.tokenize.takeover import (
    claim_from,
    dead_consumers,
    delete_if_empty,
    own_left_over,
)

log = logging.getLogger("regen.tokenize")

# Pending shards are looked at this often; within a claim's life, so a dead consumer's claims
# are resolved soon after they expire.
RECOVER_INTERVAL_S = min(30.0, settings.current().shard_lease_s / 2)
# A new job is looked for this often (one SMEMBERS), apart from the recovery pass: its
# results would otherwise wait up to RECOVER_INTERVAL_S on a worker busy with another job.
JOB_DISCOVERY_S = 2.0
DISK_POLL_S = 2.0


@dataclass
class TokenizeOptions:
    # A local folder, or an object storage URL (kept a str: pathlib folds its `//`).
    out_dir: Path | str
    jobs: list[str] = field(default_factory=list)
    policy: ShardPolicy = field(default_factory=ShardPolicy)
    on_truncated: str = defaults.ON_TRUNCATED
    drift_check: bool = defaults.DRIFT_CHECK
    # Pause (not crash, not write partial files) while the shard folder has less free.
    min_free_bytes: int = defaults.MIN_FREE_BYTES
    batch: int = 256
    block_ms: int = 1000
    # Entries any consumer holds longer than this are taken over, whatever its heartbeat
    # says: above the longest a live consumer keeps a shard open. (A dead consumer's are
    # taken over within a heartbeat's stale time plus one beat.)
    claim_idle_s: float = defaults.CLAIM_IDLE_S


@dataclass
class ConsumerState:
    paused_for_disk: bool = False
    free_bytes: int = 0
    writers: dict[str, JobWriter] = field(default_factory=dict)
    # Jobs not written because Redis is behind their shard folder: job -> why, and the fix.
    behind: dict[str, str] = field(default_factory=dict)


def _where(folder: JobFolder) -> str:
    """The folder as status and verify find it again: an absolute path, or the URL."""
    return str(folder.path.resolve()) if isinstance(folder, LocalFolder) else str(folder)


def free_bytes(folder: Path) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def group_lost(exc: redis.ResponseError) -> bool:
    """The error of a read whose stream or group Redis no longer has: NOGROUP, or
    UNBLOCKED for a read that was waiting when the stream went (deleted, or the server
    demoted to a replica under it)."""
    return str(exc).startswith(("NOGROUP", "UNBLOCKED"))


def ensure_group(r: redis.Redis, stream: str) -> None:
    """The tokenize group on `stream` (and the stream), if not there already.

    From id 0, the stream's start, both for a new job and for a group Redis lost: the
    stream holds only results not yet committed (a commit deletes its entries), so this
    reads again at most the job's uncommitted window, never the whole job; and what is
    read again is harmless: ids the commit ledger holds are acked as duplicates, and ids
    in this consumer's open shard are recognized there (JobWriter.take). From `$`
    instead, the entries written before the group came back (those a restored copy
    holds, and any added while it was gone) would never be read: prompts in no place.
    """
    try:
        r.xgroup_create(stream, keys.TOKENIZE_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class TokenizeConsumer:
    def __init__(self, r: redis.Redis, options: TokenizeOptions, name: str) -> None:
        self._r = r
        self._options = options
        self.name = name
        self.state = ConsumerState()
        self._last_seen: dict[str, float] = {}
        self.ends: dict[str, JobEnd] = {}
        self._next_recover = 0.0
        self._next_discovery = 0.0
        self._next_claim = 0.0
        self._next_takeover = 0.0
        self._refused: set[str] = set()
        self._groups_lost = False
        check_writable(options.out_dir)  # raises UnwritableFolder, before any Redis work
        # Free space where this worker's files are: the shard folder, or a bucket's spool.
        self._local_root = local_root(options.out_dir)
        self.state.free_bytes = free_bytes(self._local_root)  # known from the first heartbeat

    # --- jobs ----------------------------------------------------------------------

    def _refresh_jobs(self) -> None:
        wanted = self._options.jobs or jobspec.list_jobs(self._r)
        for job in wanted:
            if job not in self.state.writers and job not in self._refused:
                try:
                    writer = self._open_job(job)
                except RedisBehind as exc:
                    self._note_behind(job, exc)
                    continue
                except jobspec.JobSpecError as exc:  # e.g. a job of an older regen's layout
                    if job not in jobspec.list_jobs(self._r):
                        continue  # its spec is gone (a Redis that lost everything): not yet
                    log.error("job %s: %s; skipping it", job, exc)
                    self._refused.add(job)
                    continue
                self.state.behind.pop(job, None)
                if writer is not None:
                    self.state.writers[job] = writer
                    self._take_own_pending(writer)

    def _open_job(self, job: str) -> JobWriter | None:
        folder = job_folder(self._options.out_dir, job)
        # Checked before the tokenizer loads: a job whose Redis is behind is retried often.
        ensure_current(CommitLedger(self._r, job), job, folder, manifest_epoch(folder))
        spec = jobspec.load(self._r, job)
        try:
            tok = load_job_tokenizer(spec)
        except TokenizerMismatch as exc:
            # Records would be checked against a different tokenizer than the prompts.
            log.error("job %s: %s; skipping it", job, exc)
            tokenizer_refusals.record(self._r, job, self.name, str(exc))
            self._refused.add(job)
            return None
        context = RecordContext(
            spec=spec,
            tokenizer=tok,
            family=detect_family(tok),
            on_truncated=self._options.on_truncated,
            drift_check=self._options.drift_check,
        )
        ensure_group(self._r, keys.results_stream(job))
        self._r.hset(
            keys.TOKENIZE_OUTPUTS,
            job,
            orjson.dumps({"dir": _where(folder), "host": os.uname().nodename, "worker": self.name}),
        )
        writer = JobWriter(self._r, job, folder, self.name, context, self._options.policy)
        writer.recover(self._live_owners())
        self._last_seen[job] = time.monotonic()
        self.ends[job] = JobEnd(self._r, spec)
        log.info("tokenizing job %s into %s", job, folder)
        return writer

    def _live_owners(self) -> set[str]:
        now = time.time()
        return {
            name
            for name, seen in last_seen(self._r).items()
            if now - seen < settings.current().heartbeat_stale_s
        }

    # --- the loop ------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        failures = 0
        try:
            while not stop.is_set():
                try:
                    self.step()
                except OUTAGE_ERRORS as exc:
                    delay = REDIS_RETRY.delay(failures)
                    failures += 1
                    log.warning("Redis unreachable (%s); retrying in %.1f s", exc, delay)
                    self._after_outage()
                    stop.wait(delay)
                except redis.ResponseError as exc:
                    if not group_lost(exc):
                        raise
                    delay = REDIS_RETRY.delay(failures) if failures else 0.0
                    failures += 1
                    log.warning("the results group is gone (%s); creating it again", exc)
                    # At the next step's start, where an outage meanwhile is waited out.
                    self._groups_lost = True
                    stop.wait(delay)
                else:
                    failures = 0
        finally:
            self.commit_all()

    def _recreate_groups(self) -> None:
        """Redis lost a results stream's consumer group (restored from an older copy, a
        replica promoted without it, the stream deleted): create it again, from the
        stream's start, and go on as after an outage."""
        for writer in self.state.writers.values():
            ensure_group(self._r, writer.stream)
        self._groups_lost = False
        self._after_outage()

    def _after_outage(self) -> None:
        """A read whose reply was lost still moved entries to this consumer: re-read its
        own pending entries, and do the housekeeping that was due, once Redis is back."""
        for writer in self.state.writers.values():
            writer.left_unacked = True
        self._next_recover = 0.0

    def step(self) -> None:
        """One round: housekeeping, a blocking read, commits that are due."""
        if self._groups_lost:
            self._recreate_groups()
        now = time.monotonic()
        if now >= self._next_discovery:
            self._next_discovery = now + JOB_DISCOVERY_S
            self._refresh_jobs()
        if now >= self._next_recover:
            self._next_recover = now + RECOVER_INTERVAL_S
            live = self._live_owners()
            for writer in list(self.state.writers.values()):
                try:
                    writer.recover(live)
                except RedisBehind as exc:
                    self._stop_writing(writer, exc)
                    continue
                self._retake_left_over(writer)
        if not self._disk_ok():
            time.sleep(DISK_POLL_S)
            return
        if not self.state.writers:
            time.sleep(self._options.block_ms / 1000)
            self._next_discovery = 0.0
            return
        if now >= self._next_takeover:
            self._next_takeover = now + settings.current().heartbeat_interval_s
            self._take_over_dead()
        if now >= self._next_claim:
            self._next_claim = now + min(self._options.claim_idle_s / 3, 60.0)
            self._take_over_idle()
        drained = self._read()
        now = time.monotonic()
        for job, writer in list(self.state.writers.items()):
            if writer.due(now - self._last_seen[job]) or (
                job in drained and self._job_done(writer)
            ):
                self._commit(writer)

    def _job_done(self, writer: JobWriter) -> bool:
        """The job's open shard holds its last results: nothing is left to come (job_end.py),
        so it is committed now, not after --idle-commit."""
        if not writer.open_rows or not self.ends[writer.job].nothing_left():
            return False
        log.info("%s: every prompt of the job is generated or dead-lettered: committing "
                 "its last %d records now", writer.job, writer.open_rows)  # fmt: skip
        return True

    def _read(self) -> set[str]:
        """Read and take a batch; returns the jobs whose stream this read drained (it
        gave them fewer entries than a batch)."""
        streams = {w.stream: ">" for w in self.state.writers.values()}
        # redis-py gives [[stream, entries], ...] here, over RESP2 and RESP3 alike (its
        # legacy shape); the stubs' type also allows a dict by stream.
        replies = cast(
            "list[list[Any]] | None",
            self._r.xreadgroup(
                keys.TOKENIZE_GROUP,
                self.name,
                streams,  # type: ignore[arg-type]
                count=self._options.batch,
                block=self._options.block_ms,
            ),
        )
        by_stream = {w.stream: w for w in self.state.writers.values()}
        drained = set(self.state.writers)
        for stream, entries in replies or []:
            writer = by_stream[stream.decode() if isinstance(stream, bytes) else stream]
            self._last_seen[writer.job] = time.monotonic()
            self._take(writer, entries)
            if len(entries) >= self._options.batch:
                drained.discard(writer.job)
        return drained

    def _take(self, writer: JobWriter, entries: list[Any]) -> None:
        decoded = [(eid.decode(), fields or None) for eid, fields in entries]
        try:
            writer.take(decoded)
        except OSError as exc:  # disk full mid-write: drop the shard, pause, retry later
            log.error("%s: writing failed (%s); abandoning the open shard", writer.job, exc)
            writer.abandon()
        except RedisBehind as exc:
            self._stop_writing(writer, exc)

    def _take_own_pending(self, writer: JobWriter) -> None:
        """Entries this consumer read and left unacknowledged (in a job it stopped writing
        while Redis was behind) are read again from its own pending list."""
        cursor = "0-0"
        while writer.job in self.state.writers:
            reply = cast(
                "list[list[Any]] | None",
                self._r.xreadgroup(
                    keys.TOKENIZE_GROUP, self.name, {writer.stream: cursor},
                    count=self._options.batch,
                ),
            )  # fmt: skip
            entries = reply[0][1] if reply else []
            if not entries:
                return
            self._take(writer, entries)
            last = entries[-1][0]
            cursor = last.decode() if isinstance(last, bytes) else last

    def _stop_writing(self, writer: JobWriter, exc: RedisBehind) -> None:
        """Redis is behind the job's shard folder: drop the job's open shard and its
        writer (its results stay unacknowledged) until `regen recover` rebuilt the
        ledger; each job refresh tries it again."""
        writer.abandon()
        self.state.writers.pop(writer.job, None)
        self._note_behind(writer.job, exc)

    def _note_behind(self, job: str, exc: RedisBehind) -> None:
        """Redis is behind the job's shard folder: rebuild the ledger here, once across
        the workers (self_recovery.py), and take the job up again at the next refresh."""
        self.state.behind[job] = str(exc)
        log.error("%s", exc)
        folder = job_folder(self._options.out_dir, job)
        if recover_behind(self._r, job, folder, self.name) is not None:
            self._next_discovery = 0.0

    def _take_over_dead(self) -> None:
        beats = last_seen(self._r)
        for writer in self.state.writers.values():
            for dead in dead_consumers(self._r, writer.stream, self.name, beats):
                taken = 0
                for entries in claim_from(self._r, writer.stream, dead, self.name):
                    taken += len(entries)
                    self._take(writer, entries)
                if taken:
                    log.warning("%s: took over %d results of dead %s", writer.job, taken, dead)
                if delete_if_empty(self._r, writer.stream, dead):
                    log.info("%s: removed dead consumer %s", writer.job, dead)

    def _retake_left_over(self, writer: JobWriter) -> None:
        """Read again the entries this consumer left unacknowledged (their ids were held
        by a pending shard, which recovery may since have resolved)."""
        if not writer.left_unacked:
            return
        writer.left_unacked = False
        for entries in own_left_over(self._r, writer.stream, self.name, writer.open_entries()):
            self._take(writer, entries)

    def _take_over_idle(self) -> None:
        idle_ms = int(self._options.claim_idle_s * 1000)
        for writer in list(self.state.writers.values()):
            cursor = "0-0"
            while writer.job in self.state.writers:
                reply = self._r.xautoclaim(
                    writer.stream,
                    keys.TOKENIZE_GROUP,
                    self.name,
                    idle_ms,
                    start_id=cursor,
                    count=500,
                )
                cursor, entries = reply[0], reply[1]
                if entries:
                    log.warning(
                        "%s: took over %d results idle for over %.0f s",
                        writer.job,
                        len(entries),
                        self._options.claim_idle_s,
                    )
                    self._take(writer, entries)
                if cursor in (b"0-0", "0-0"):
                    break

    def _commit(self, writer: JobWriter) -> None:
        try:
            writer.commit()
        except OSError as exc:
            log.error("%s: committing failed (%s); its results come back", writer.job, exc)
            writer.abandon()
        except RedisBehind as exc:
            self._stop_writing(writer, exc)
        except OUTAGE_ERRORS as exc:  # the writer has undone what it could; see commit()
            log.error(
                "%s: Redis unreachable mid-commit (%s); its results come back", writer.job, exc
            )

    def commit_all(self) -> None:
        for writer in list(self.state.writers.values()):
            self._commit(writer)

    def _disk_ok(self) -> bool:
        free = free_bytes(self._local_root)
        self.state.free_bytes = free
        ok = free >= self._options.min_free_bytes
        if ok == self.state.paused_for_disk:  # state changes: say so once
            if ok:
                log.warning("disk space is back (%d MB free): resuming", free >> 20)
            else:
                log.error(
                    "only %d MB free at %s (need %d MB): paused until space returns",
                    free >> 20,
                    self._local_root,
                    self._options.min_free_bytes >> 20,
                )
        self.state.paused_for_disk = not ok
        return ok
