"""One job's side of a tokenize consumer: results in, records into shards, commits out.

Stream entries are acknowledged only when the shard holding their record is in place
and committed (docs/design/exactly-once.md, Exactly-once commits), or at once when their id is
already in a committed shard (a duplicate from a chunk that ran twice). An entry whose id
is claimed by a shard that is still pending is left alone: it is either committed (then
a later delivery is a duplicate) or released (then it is written again). An entry
that holds no readable result is dead-lettered with its bytes, never left to stop the
stage (entries.py; docs/design/tokenize.md, Tokenize).

The disk is the truth for committed shards: a writer checks that Redis knows every
shard of its folder when it opens the job and before each commit, never takes a shard
name already on disk, and raises RedisBehind (ledger_vs_disk.py) instead of writing on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis

from regen.common import crashpoints, defaults, dlq, keys, provenance
from regen.common.connection import OUTAGE_ERRORS
from regen.common.ledger.commit_ledger import CLAIM_MARGIN_S, CommitLedger, PendingShard
from regen.common.ledger.id_buckets import BucketedIds
from regen.common.ledger.shard_names import shard_name
from regen.common.record import CheckFailed, Reason, RecordContext, build_record
from regen.common.results import GeneratedResult
from regen.consumers.tokenize.entries import Unreadable, read_entry
from regen.consumers.tokenize.job_folder import JobFolder, ShardRef
from regen.consumers.tokenize.ledger_vs_disk import (
    RedisBehind,
    behind_error,
    ensure_current,
    manifest_epoch,
)
from regen.consumers.tokenize.shard_files import (
    OpenShard,
    ShardExists,
    ShardInfo,
    describe,
    leftover_owner,
    owner_token,
    rewrite_without,
    tmp_path,
)

log = logging.getLogger("regen.tokenize")

# What an entry gives: a result, or an unreadable entry that names a prompt of the job.
Taken = GeneratedResult | Unreadable
# Errors building a record of a well-typed result can still raise on odd content (a
# message without a role, an id past the vocabulary): such a result is dead-lettered.
_BUILD_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


def _prompt_of(taken: Taken) -> str:
    return taken.id if isinstance(taken, GeneratedResult) else str(taken.prompt_id)


@dataclass(frozen=True)
class ShardPolicy:
    """When an open shard is closed and committed (see common.defaults)."""

    max_rows: int = defaults.SHARD_MAX_ROWS
    # Uncompressed bytes.
    max_bytes: int = defaults.SHARD_MAX_BYTES
    # Oldest a shard stays open.
    max_age_s: float = defaults.SHARD_MAX_AGE_S
    # Commit an open shard once no result has arrived for this long.
    idle_s: float = defaults.SHARD_IDLE_S


@dataclass
class WriterCounters:
    records: int = 0
    tokens: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    shards: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class JobWriter:
    def __init__(
        self,
        r: redis.Redis,
        job: str,
        folder: JobFolder,
        owner: str,
        context: RecordContext,
        policy: ShardPolicy,
    ) -> None:
        self.job = job
        self.folder = folder
        self.owner = owner
        self.counters = WriterCounters()
        self._r = r
        self._ledger = CommitLedger(r, job)
        # The job's ids (common/ledger/job_ids.py), to tell whether an unreadable entry's id
        # is a prompt of the job.
        self._job_ids = BucketedIds(r, context.spec.id_buckets, lambda b: keys.job_ids(job, b))
        self._context = context
        self._policy = policy
        self._shard: OpenShard | None = None
        self._committed_now: set[str] = set()
        # Stream entries per id in the open shard, acked when it commits.
        self._entries: dict[str, list[str]] = {}
        # Some entries were left unacknowledged, to be read again by this consumer once
        # what held them is resolved (the consumer re-reads and clears it).
        self.left_unacked = False
        folder.spool.mkdir(parents=True, exist_ok=True)
        # Refuses a Redis that lost shards of this folder (RedisBehind); the job's first
        # shard starts epoch 1.
        epoch = ensure_current(self._ledger, job, folder, manifest_epoch(folder))
        self._epoch = epoch or self._ledger.start_epoch()
        # The job's provenance beside its shards, so the folder says what made it.
        made_by = provenance.load(r, job)
        if made_by is not None:
            folder.write_provenance(made_by)

    @property
    def stream(self) -> str:
        return keys.results_stream(self.job)

    @property
    def open_rows(self) -> int:
        return self._shard.rows if self._shard else 0

    # --- taking results ----------------------------------------------------------

    def take(self, entries: list[tuple[str, dict[bytes, bytes] | None]]) -> None:
        """Handle a batch of stream entries (id, fields); fields None = deleted entry."""
        results: list[tuple[str, Taken]] = []
        unreadable: list[tuple[str, Unreadable]] = []
        for entry_id, fields in entries:
            if fields is None:  # deleted after a commit: nothing left to do
                self._ack([entry_id])
                continue
            read = read_entry(fields)
            if isinstance(read, GeneratedResult):
                results.append((entry_id, read))
            else:
                unreadable.append((entry_id, read))
        results += self._named_prompts(unreadable)
        owners = self._ledger.owner_of([_prompt_of(taken) for _, taken in results])
        pending = set(self._ledger.pending()) if any(owners) else set()
        # Ids this call commits when a shard fills mid-batch: their later copies in the
        # batch are duplicates, though `owners` was read before the commit.
        self._committed_now = set()
        for (entry_id, taken), owner in zip(results, owners, strict=True):
            pid = _prompt_of(taken)
            if pid in self._committed_now:
                self.counters.duplicates += 1
                self._ack([entry_id])
            elif owner is not None:
                if owner in pending:
                    self.left_unacked = True
                    continue  # decided when that shard commits or is released
                self.counters.duplicates += 1
                self._ack([entry_id])
            elif pid in self._entries:
                self._entries[pid].append(entry_id)  # a duplicate in this shard
                self.counters.duplicates += 1
            elif isinstance(taken, Unreadable):
                self._dead_letter_unreadable(entry_id, taken, pid)
            else:
                self._write(entry_id, taken)
                if self._full():  # roll over mid-batch: shards stay at their size
                    self.commit()

    def _named_prompts(self, unreadable: list[tuple[str, Unreadable]]) -> list[tuple[str, Taken]]:
        """Unreadable entries that name a prompt of the job, to be placed like its result
        (a copy of a committed one is a duplicate); the others are dead-lettered now,
        under an id of their own, counted apart from prompts (docs/design/tokenize.md, Tokenize)."""
        named = [(e, u) for e, u in unreadable if u.prompt_id is not None]
        known = self._job_ids.get([u.prompt_id for _, u in named if u.prompt_id is not None])
        kept: list[tuple[str, Taken]] = []
        for (entry_id, read), found in zip(named, known, strict=True):
            if found is None:
                self._dead_letter_unreadable(entry_id, read, None)
            else:
                kept.append((entry_id, read))
        for entry_id, read in unreadable:
            if read.prompt_id is None:
                self._dead_letter_unreadable(entry_id, read, None)
        return kept

    def _write(self, entry_id: str, result: GeneratedResult) -> None:
        try:
            record = build_record(result, self._context)
        except CheckFailed as exc:
            self._dead_letter(entry_id, result, exc)
            return
        except _BUILD_ERRORS as exc:  # a result no check foresaw: never stop the stage
            log.exception("%s: the record of %s could not be built", self.job, result.id)
            failed = CheckFailed(Reason.MALFORMED_RESULT, f"{type(exc).__name__}: {exc}")
            self._dead_letter(entry_id, result, failed)
            return
        if self._shard is None:
            name = shard_name(self._ledger.next_shard_seq())
            if self.folder.has(name):
                raise behind_error(self.job, self.folder, f"its counter gave out {name} again")
            self._shard = OpenShard(self.folder.spool, name, self.owner, epoch=self._epoch)
        self._shard.add(record)
        crashpoints.hit("tokenize.mid_shard")
        self._entries[result.id] = [entry_id]
        self.counters.records += 1
        self.counters.tokens += len(record["input_ids"])

    def _dead_letter(self, entry_id: str, result: GeneratedResult, exc: CheckFailed) -> None:
        keep_payload = exc.reason != Reason.TRUNCATED_DROPPED
        self._put_dead_letter(
            entry_id,
            dlq.DeadLetter(
                entry_id=result.id,
                job=self.job,
                stage="tokenize",
                reason=exc.reason,
                message=exc.message,
                prompt_id=result.id,
                source=result.source,
                attempts=result.attempt + 1,
                worker=self.owner,
                payload={"result": result.__dict__} if keep_payload else {},
            ),
        )

    def _dead_letter_unreadable(self, entry_id: str, read: Unreadable, pid: str | None) -> None:
        """An entry with no result in it: its bytes go to the DLQ under the prompt it
        names (a prompt of the job), else under an id of its own."""
        log.error("%s: unreadable results entry %s: %s: %s", self.job, entry_id,
                  read.reason, read.message)  # fmt: skip
        self._put_dead_letter(
            entry_id,
            dlq.DeadLetter(
                entry_id=pid or read.entry_id(),
                job=self.job,
                stage="tokenize",
                reason=read.reason,
                message=read.message,
                prompt_id=pid,
                worker=self.owner,
                payload={**read.payload(), "stream_entry": entry_id},
            ),
        )

    def _put_dead_letter(self, entry_id: str, letter: dlq.DeadLetter) -> None:
        """The dead letter, the ack and the delete of its entry in one MULTI."""
        pipe = self._r.pipeline()
        dlq.put(pipe, letter)
        pipe.xack(self.stream, keys.TOKENIZE_GROUP, entry_id)
        pipe.xdel(self.stream, entry_id)
        pipe.execute()
        self.counters.dead_lettered += 1
        by_reason = self.counters.by_reason
        by_reason[letter.reason] = by_reason.get(letter.reason, 0) + 1

    def _ack(self, entry_ids: list[str]) -> None:
        if entry_ids:
            pipe = self._r.pipeline()
            pipe.xack(self.stream, keys.TOKENIZE_GROUP, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)
            pipe.execute()

    # --- committing --------------------------------------------------------------

    def _full(self) -> bool:
        shard = self._shard
        return shard is not None and (
            shard.rows >= self._policy.max_rows
            or shard.uncompressed_bytes >= self._policy.max_bytes
        )

    def due(self, idle_for_s: float) -> bool:
        """The open shard should be committed now: full, old, or no results coming."""
        shard = self._shard
        if shard is None or shard.rows == 0:
            return False
        policy = self._policy
        return self._full() or shard.age_s() >= policy.max_age_s or idle_for_s >= policy.idle_s

    def _check_disk(self) -> None:
        """Raise RedisBehind when Redis lost shards of the folder or its epoch went back;
        take up a newer epoch (`regen recover` ran)."""
        self._epoch = ensure_current(self._ledger, self.job, self.folder, self._epoch)

    def commit(self) -> None:
        """Close the open shard and commit it (see commit_ledger.py for the protocol)."""
        shard, self._shard = self._shard, None
        entries, self._entries = self._entries, {}
        if shard is None:
            return
        info = shard.close_durably()
        try:
            self._check_disk()  # before the claim: a Redis behind would free ids on disk
            self._commit_closed(shard, info, entries)
        except RedisBehind:
            shard.abort()  # its entries stay unacknowledged
            raise
        except OUTAGE_ERRORS:
            # Redis went away mid-commit: drop the temp file if not yet in place. A claim
            # that landed is resolved by recovery once the claim expires, from the files
            # alone; the entries stay unacknowledged and are read again.
            shard.abort()
            self.left_unacked = True
            raise

    def _commit_closed(
        self, shard: OpenShard, info: ShardInfo, entries: dict[str, list[str]]
    ) -> None:
        while True:
            taken, claim = self._ledger.claim(shard.name, self.owner, sorted(shard.ids))
            if not taken:
                break
            # Another consumer holds some ids: leave their entries unacknowledged (they
            # are re-read later and dropped if that shard commits) and write the rest.
            self.left_unacked = True
            for pid in taken:
                entries.pop(pid, None)
            info = rewrite_without(shard, set(taken))
            if not shard.ids:
                shard.abort()
                return
        if claim.lease_until - CLAIM_MARGIN_S < time.time():
            # Too slow to rename safely: undo; the entries come back to a consumer.
            self._ledger.release(claim, owner=self.owner)
            shard.abort()
            self.left_unacked = True
            log.warning("shard %s of %s abandoned: claim lease ran short", shard.name, self.job)
            return
        crashpoints.hit("tokenize.after_claim")
        if not self._ledger.holds(claim):
            # Redis lost the claim (restored from an older copy, maybe with `regen
            # recover` run since): placing now would put on disk ids that Redis has free
            # and stop the job as behind the disk. Undo; the entries come back.
            shard.abort()
            self.left_unacked = True
            log.warning("shard %s of %s abandoned: Redis lost its claim", shard.name, self.job)
            return
        try:
            self.folder.place(info, self.owner)
        except ShardExists:
            self._ledger.release(claim, owner=self.owner)
            shard.abort()
            raise behind_error(self.job, self.folder, f"{shard.name} is already on disk") from None
        crashpoints.hit("tokenize.after_place")
        acked = [e for pid in shard.ids for e in entries.get(pid, [])]
        self._ledger.finalize(shard.name, info.to_json(), acked, sorted(shard.ids))
        self._committed_now |= shard.ids
        self.counters.shards += 1
        log.info(
            "%s: shard %s in place (%d rows, %d bytes)",
            self.job,
            shard.name,
            info.rows,
            info.compressed_bytes,
        )

    def open_entries(self) -> set[str]:
        """The stream entries whose records are in the open shard."""
        return {entry for ids in self._entries.values() for entry in ids}

    def abandon(self) -> None:
        """Drop the open shard without committing (disk error); its entries come back."""
        if self._shard is not None:
            self._shard.abort()
        self._shard, self._entries = None, {}

    # --- recovery ----------------------------------------------------------------

    def recover(self, live_owners: set[str]) -> None:
        """Resolve expired pending shards and remove dead writers' temporary files.

        Reads the pending records and lists the folder: its cost does not grow with the
        shards' content (only a shard whose manifest line was torn is re-read). Raises
        RedisBehind first when Redis is behind the folder: a claim it lost must not be
        released.
        """
        self._check_disk()
        pending = self._ledger.pending()
        for claim in pending.values():
            if claim.expired():
                self._resolve(claim)
        live = {owner_token(o) for o in live_owners} | {owner_token(self.owner)}
        unexpired = {owner_token(c.owner) for c in pending.values() if not c.expired()}
        for path in self.folder.spool.iterdir():
            token = leftover_owner(path)
            if token is not None and token not in live and token not in unexpired:
                log.warning("%s: removing leftover %s", self.job, path.name)
                path.unlink(missing_ok=True)

    def _resolve(self, claim: PendingShard) -> None:
        if self.folder.has(claim.shard):
            manifest = self.folder.manifest().shards
            info = manifest.get(claim.shard) or describe(
                ShardRef(self.folder, claim.shard), self._epoch
            )
            if claim.shard not in manifest:
                self.folder.add_manifest(info)
            self._ledger.finalize(claim.shard, info.to_json(), [], claim.ids)
            log.warning(
                "%s: finished the commit of %s left by %s", self.job, claim.shard, claim.owner
            )
        else:
            self._ledger.release(claim)
            tmp_path(self.folder.spool, claim.shard, claim.owner).unlink(missing_ok=True)
            log.warning(
                "%s: released %s, never placed by %s; its results will be written again",
                self.job,
                claim.shard,
                claim.owner,
            )
