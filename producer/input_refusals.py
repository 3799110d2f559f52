"""The rows and prompts the job refuses: each to the input DLQ with its reason, its id
(and its conversation's other turns) recorded in the job's ids in the same
transaction, so it is accounted for and not queued again; counted by reason."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import redis

from regen.common import dlq
from regen.common.conversation import blocked_letters
from regen.common.ledger.job_ids import JobIds
from regen.producer.enqueue_stats import EnqueueStats
from regen.producer.pending_prompt import Pending
from regen.producer.readers import RawRow
from regen.producer.rows import Reason

# The input DLQ keeps this much of a bad row, enough to see what was wrong with it.
RAW_SNIPPET_CHARS = 2000


class Refusals:
    def __init__(self, r: redis.Redis, job: str, ids: JobIds, stats: EnqueueStats) -> None:
        self._r = r
        self._job = job
        self._ids = ids
        self._stats = stats

    def row(self, raw: RawRow, path: Path, reason: str, message: str) -> None:
        """A row that is no prompt (unreadable, or not a row of the job's format)."""
        # Keyed by file and row, so re-reading the file after a crash overwrites the entry.
        key = hashlib.blake2b(f"{Path(path).resolve()}\0{raw.row}".encode(), digest_size=8)
        snippet = None if raw.value is None else repr(raw.value)[:RAW_SNIPPET_CHARS]
        dlq.put(
            self._r,
            dlq.DeadLetter(
                entry_id=f"row:{key.hexdigest()}",
                job=self._job,
                stage="input",
                reason=reason,
                message=message,
                source={"file": str(path), "row": raw.row},
                payload={"row": snippet},
            ),
        )
        self.count(reason)

    def prompt(self, item: Pending, reason: Reason, message: str, payload: dict[str, Any]) -> None:
        """A prompt the job refuses still belongs to the job: its id goes into the job's
        id set together with the DLQ entry, so it is accounted for (and not retried). A
        conversation's later turns wait behind its first, each with its own entry."""
        pid = item.id
        if item.conversation is not None:
            payload = {**payload, "conversation": item.conversation.to_dict()}
        letter = dlq.DeadLetter(
            entry_id=pid,
            job=self._job,
            stage="input",
            reason=reason,
            message=message,
            prompt_id=pid,
            source=item.source,
            payload=payload,
        )
        letters = [letter]
        if item.conversation is not None:
            letters += blocked_letters(letter, item.conversation, 0)
        self.put(letters, [each.entry_id for each in letters])
        self.count(reason)

    def put(self, letters: list[dlq.DeadLetter], ids: list[str]) -> None:
        """Dead-letter prompts, with `ids` (theirs, and any others of their conversation)
        recorded in the job's ids in the same transaction."""
        pipe = self._r.pipeline()
        self._ids.add(ids, pipe)
        for each in letters:
            dlq.put(pipe, each)
        pipe.execute()

    def count(self, reason: str) -> None:
        self._stats.rejected += 1
        by_reason = self._stats.rejected_by_reason
        code = str(reason)  # a Reason member is no JSON key: count by its string
        by_reason[code] = by_reason.get(code, 0) + 1
