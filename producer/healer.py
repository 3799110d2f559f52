"""`regen enqueue --follow`: the producer stays with its job until every prompt has a
place, and queues again what a failure lost (docs/design/exactly-once.md, "Healing").

Only the producer holds the prompts' data (its dataset files), so it is the one that
can queue a lost prompt again. Two failures lose prompts with no record: a chunk popped
by a worker killed (or a Redis that died) inside kombu's window, between BRPOP and the
round trip that records it in `unacked`; and a Redis restored behind the disk, which
forgets the hand-offs, chunks and cursor moves made since its copy. Each pass:

1. beat: the job's follower key, with an expiry, so `regen status` can say when an
   unfinished job has no follower;
2. the spec gone (a Redis that lost everything): store it again and wait; the tokenize
   workers then list the job again, find Redis behind its shards and rebuild its ledger;
3. Redis behind the disk, as far as this process can tell: wait, forgetting no id and
   queueing nothing (the ledger may lack commits the shards hold: queueing their ids
   again would write them twice). It is behind while a tokenize worker's flag
   (keys.job_behind) is set, or while the shard counter is below the highest this
   follower saw with no newer ledger epoch (a recovery raises the epoch);
4. the job's enqueue cursors below where this follower's last pass left them (a
   rollback lost cursor moves, or a recovery dropped them): run the enqueue pass again,
   which queues the prompts with no record;
5. every prompt committed or dead-lettered, and nothing left to read: done;
6. prompts in no place (the O(window) count, common/ledger/places.py): list them
   (O(job), only then), and those in no place in two readings at least the grace apart
   are taken out of the job's ids (recover.forget_missing), the cursors dropped, and the
   enqueue pass, reading the files again, queues them again; their chunk id is reused,
   so if the worker holding them was only stopped and wakes later, the chunk lease and
   the commit ledger keep each answer once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import orjson
import redis

from regen.common import jobspec, keys, settings
from regen.common.backoff import REDIS_RETRY
from regen.common.connection import OUTAGE_ERRORS, raise_if_refused
from regen.common.ledger.job_ids import reread_from_start
from regen.common.ledger.places import count_places, forget_missing, missing_ids, text
from regen.producer.outages import wait_out_outages

log = logging.getLogger("regen.enqueue")
# The follower key outlives this many passes without renewal.
HEARTBEAT_PASSES = 3


@dataclass
class Watermark:
    """The highest shard counter and ledger epoch this follower saw in Redis."""

    seq: int = 0
    epoch: int = 0

    def behind(self, seq: int, epoch: int) -> bool:
        """Whether (seq, epoch) read now show a Redis older than what was seen: the
        counter went back with no recovery since (no newer epoch)."""
        return epoch < self.epoch or (seq < self.seq and epoch <= self.epoch)

    def see(self, seq: int, epoch: int) -> None:
        if epoch > self.epoch:
            self.seq = seq  # a recovery ran: its counter is the new truth
        self.seq = max(self.seq, seq)
        self.epoch = max(self.epoch, epoch)


@dataclass
class Follower:
    """Follows job `job` (see the module doc). `enqueue_pass` runs the job's enqueue over
    its files (through outages) and `store_spec` stores its spec again."""

    r: redis.Redis
    job: str
    enqueue_pass: Callable[[], object]
    store_spec: Callable[[], object]
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    poll_s: float = field(default_factory=lambda: settings.current().follow_poll_s)
    grace_s: float = field(default_factory=lambda: settings.current().follow_grace_s)
    watermark: Watermark = field(default_factory=Watermark)
    # Cursors as the last enqueue pass left them.
    cursors: dict[str, int] = field(default_factory=dict)
    # The first reading of ids in no place: (when, ids).
    suspects: tuple[float, set[str]] | None = None
    requeued: int = 0
    passes: int = 0
    _last_beat: float = float("-inf")

    def run(self) -> None:
        """Publish the job, then follow it until every prompt has a place."""
        wait_out_outages(self._start, "publishing the job", self.sleep)
        failures = 0
        while True:
            try:
                if self.step():
                    break
                failures = 0
                self.sleep(self.poll_s)
            except OUTAGE_ERRORS as exc:
                raise_if_refused(exc)
                delay = REDIS_RETRY.delay(failures)
                failures += 1
                log.warning("Redis unreachable (%s); following again in %.1f s", exc, delay)
                self.sleep(delay)
        wait_out_outages(lambda: self.r.delete(keys.job_follower(self.job)), "leaving",
                         self.sleep)  # fmt: skip

    def _start(self) -> None:
        """Wait out a recovery under way, then publish the job (safe to repeat: the
        enqueue resumes from Redis)."""
        while self.r.exists(keys.job_behind(self.job)):
            self.beat()
            self.sleep(self.poll_s)
        self._enqueue()

    def step(self) -> bool:
        """One pass; True once every prompt of the job is committed or dead-lettered."""
        self.passes += 1
        self.beat()
        if self.job not in jobspec.list_jobs(self.r):
            log.warning("job %s: Redis lost its spec; storing it again, then waiting for the "
                        "tokenize stage to rebuild its ledger", self.job)  # fmt: skip
            self.store_spec()
            return False
        if self._behind():
            self.suspects = None
            return False
        if self._cursors_lost():
            log.warning("job %s: Redis lost enqueue cursor moves (restored, or a recovery "
                        "dropped them); reading the files again", self.job)  # fmt: skip
            self._enqueue()
            return False
        spec = jobspec.load(self.r, self.job)
        counts = count_places(self.r, spec)
        if counts.total == counts.done + counts.dead_lettered + counts.purged:
            log.info("job %s: every prompt has a place (%d done, %d dead-lettered)",
                     self.job, counts.done, counts.dead_lettered)  # fmt: skip
            return True
        if not counts.unplaced:
            self.suspects = None
            return False
        self._heal_unplaced(spec)
        return False

    def _heal_unplaced(self, spec: jobspec.JobSpec) -> None:
        now = self.clock()
        missing = set(missing_ids(self.r, spec))
        if self.suspects is None or not missing:
            self.suspects = (now, missing) if missing else None
            return
        since, before = self.suspects
        if now - since < self.grace_s:
            return  # a second reading only once the grace is over
        lost = sorted(missing & before)
        self.suspects = (now, missing - before) if missing - before else None
        if not lost or self._behind():  # the flag could have been set since the first look
            return
        forgotten = forget_missing(self.r, spec, lost)
        # The files are read again from the first row (O(job) reading, only when prompts
        # were lost): what is in the job, committed or dead-lettered is skipped.
        reread_from_start(self.r, self.job)
        self.requeued += len(lost)
        log.warning("job %s: %d prompt(s) in no place for %.0f s (a chunk lost between a "
                    "worker's pop and kombu's unacked record, or to a Redis rollback); "
                    "queueing them again (%d id(s) out of the job's ids)",
                    self.job, len(lost), now - since, forgotten)  # fmt: skip
        self._enqueue()

    def _behind(self) -> bool:
        seq = int(self.r.get(keys.shard_seq(self.job)) or 0)
        epoch = int(self.r.get(keys.job_epoch(self.job)) or 0)
        flagged = self.r.exists(keys.job_behind(self.job))
        if flagged or self.watermark.behind(seq, epoch):
            log.warning("job %s: Redis is behind the job's shards (shard counter %d, epoch %d; "
                        "seen %d, %d; tokenize flag %s): waiting for the tokenize stage to "
                        "rebuild the ledger", self.job, seq, epoch, self.watermark.seq,
                        self.watermark.epoch, bool(flagged))  # fmt: skip
            return True
        self.watermark.see(seq, epoch)
        return False

    def _cursors_lost(self) -> bool:
        now = self._read_cursors()
        return any(now.get(name, 0) < at for name, at in self.cursors.items())

    def _read_cursors(self) -> dict[str, int]:
        raw = cast("dict[bytes, bytes]", self.r.hgetall(keys.job_cursors(self.job)))
        return {text(name): int(at) for name, at in raw.items()}

    def _enqueue(self) -> None:
        self.enqueue_pass()
        self.cursors = self._read_cursors()

    def beat(self) -> None:
        """Renew the job's follower key; also called from a long enqueue pass's progress."""
        record = {"host": socket.gethostname(), "pid": os.getpid(), "last_seen": time.time()}
        ttl = max(1, int(HEARTBEAT_PASSES * self.poll_s + 1))
        self.r.set(keys.job_follower(self.job), orjson.dumps(record), ex=ttl)
        self._last_beat = self.clock()

    def beat_if_due(self) -> None:
        if self.clock() - self._last_beat >= self.poll_s:
            self.beat()


def follower_alive(r: redis.Redis, job: str) -> bool:
    """Whether a `regen enqueue --follow` of the job beat recently."""
    return bool(r.exists(keys.job_follower(job)))
