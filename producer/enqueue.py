"""The producer: dataset rows -> prompts -> chunks on the job's generate queue.

Each file is read from its resume cursor; every row ends in exactly one place: a chunk
(published atomically with its ids and the cursor, see publish.py), the input DLQ (with
file, row and reason), or counted as a duplicate of a prompt already in the job. The
cursor only moves past rows that are resolved, so `kill -9` then the same command again
continues where it stopped. A cursor found behind where this producer moved it (Redis
restored from an older copy while it ran) sends it back to read the file again from
the cursor Redis has: the chunks the copy lost are published again.

Before a chunk is published its prompts are sifted (prompts_to_queue.py: those already in the
job, or settled, are not queued again), rendered with the chat template or refused to
the input DLQ (render.py, input_refusals.py), and grouped by sample.

With `--turns all` a row becomes a conversation (producer/conversations.py): its first
turn is rendered and checked, and every turn's id enters the job with its chunk. A
conversation Redis lost while the shards hold its first turns resumes after them
(producer/lost_turns.py).
With `--samples K` each prompt becomes K prompts, rendered once and published as one
chunk per sample index with that sample's seed (common/samples.py); the file's cursor
moves with the last of them, so a crash in between re-reads the rows and publishes
only the samples not yet in the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from regen.common import defaults, keys
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.ledger.job_ids import JobIds
from regen.common.queues import waiting_chunks
from regen.common.samples import SEED_PARAM, sample_seed
from regen.producer.answer_length import dataset_answer_chars
from regen.producer.conversations import job_prompt
from regen.producer.enqueue_stats import EnqueueStats
from regen.producer.input_refusals import Refusals
from regen.producer.longest_first import LongestFirst
from regen.producer.lost_turns import LostTurns
from regen.producer.pending_prompt import Pending
from regen.producer.prompts_to_queue import KnownPrompts
from regen.producer.publish import ChunkPublisher, CursorBehind
from regen.producer.publishing_mark import PublishingMark
from regen.producer.readers import SUPPORTED_SUFFIXES, RawRow, file_fingerprint, iter_rows
from regen.producer.render import PromptRenderer
from regen.producer.rows import BadRow
from regen.producer.spec import PreparedJob

log = logging.getLogger("regen.producer")

BACKPRESSURE_POLL_S = 0.5


class Enqueuer:
    def __init__(
        self,
        r: redis.Redis,
        app: Celery,
        job: PreparedJob,
        *,
        high_water: int,
        order_window: int = defaults.ORDER_WINDOW,
        on_progress: Callable[[EnqueueStats], None] = lambda stats: None,
    ) -> None:
        self._r = r
        self._spec = job.spec
        self._publisher = ChunkPublisher(app, r, self._spec)
        self._lost = LostTurns(r, self._spec.name)
        self._high_water = high_water
        self._order = LongestFirst(order_window, job.spec.chunk_size * job.spec.samples)
        self._on_progress = on_progress
        # Per file: where this producer last moved (or found) its cursor in Redis, and
        # the last chunk it published (or found published) from the file's rows.
        self._cursor_at: dict[str, int] = {}
        self._last_chunk: dict[str, str] = {}
        self.stats = EnqueueStats(high_water=high_water)
        ids = JobIds(r, self._spec.name)
        self._refusals = Refusals(r, self._spec.name, ids, self.stats)
        self._renderer = PromptRenderer(job, self._refusals)
        self._known = KnownPrompts(r, self._spec.name, ids, self._lost, self._refusals, self.stats)
        self._mark = PublishingMark(r, self._spec.name)

    # --- the loop ------------------------------------------------------------------

    def run(self, datasets: list[Path], limit: int | None = None) -> EnqueueStats:
        """Enqueue the datasets; `limit` reads only their first `limit` rows in order."""
        budget = limit
        try:
            for path in datasets:
                if budget is not None and budget <= 0:
                    break
                budget = self._run_file(path, budget)
        finally:
            self._mark.clear()
            self._publisher.close()
        self._on_progress(self.stats)
        return self.stats

    def _run_file(self, path: Path, budget: int | None) -> int | None:
        fingerprint = file_fingerprint(path)
        raw_cursor = self._r.hget(keys.job_cursors(self._spec.name), fingerprint)
        start = int(raw_cursor or 0)
        while True:
            try:
                return self._read_file(path, fingerprint, start, budget)
            except CursorBehind as behind:
                log.warning(
                    "%s: Redis lost rows %d to %d of the job (restored from an older "
                    "copy?); reading them again",
                    path,
                    behind.value,
                    self._cursor_at[fingerprint],
                )
                start = behind.value

    def _read_file(
        self, path: Path, fingerprint: str, start: int, budget: int | None
    ) -> int | None:
        """Read the file from row `start` (its cursor in Redis); raises CursorBehind."""
        self._cursor_at[fingerprint] = start
        self._last_chunk.pop(fingerprint, None)
        self.stats.rows_resumed += start
        if budget is not None:
            budget -= start
        last_row = start
        buffer: list[Pending] = []
        for raw in iter_rows(path, start_row=start):
            self._mark.renew_if_due()
            if budget is not None:
                if budget <= 0:
                    break
                budget -= 1
            self.stats.rows_read += 1
            last_row = max(last_row, raw.row)
            pending = self._interpret(raw, path)
            if pending is not None:
                buffer.extend(self._samples(pending))
            if len(buffer) >= self._order.window:
                self._flush(buffer, fingerprint, last_row)
                buffer = []
                self._order.grow()
            if self.stats.rows_read % 256 == 0:
                self._on_progress(self.stats)
        # Rows after the last full chunk form the file's final, smaller chunk.
        self._flush(buffer, fingerprint, last_row)
        return budget

    # --- one row -------------------------------------------------------------------

    def _interpret(self, raw: RawRow, path: Path) -> Pending | None:
        source = {"file": str(path), "row": raw.row}
        if raw.error is not None:
            self._refusals.row(raw, path, raw.error.reason, raw.error.message)
            return None
        try:
            prompt, conversation = job_prompt(raw.value, self._spec)
        except BadRow as exc:
            self._refusals.row(raw, path, exc.reason, exc.message)
            return None
        source["id"] = prompt.source_id
        answer_chars = dataset_answer_chars(raw.value, every_turn=conversation is not None)
        return Pending(prompt=prompt, source=source, conversation=conversation,
                       answer_chars=answer_chars)  # fmt: skip

    def _samples(self, item: Pending) -> list[Pending]:
        """The prompts a row's prompt makes: itself, or one per sample (--samples)."""
        if self._spec.samples == 1:
            return [item]
        return [item.as_sample(k) for k in range(self._spec.samples)]

    # --- a chunk -------------------------------------------------------------------

    def _flush(self, buffer: list[Pending], fingerprint: str, last_row: int) -> None:
        """Resolve every buffered row, then move the file's cursor to `last_row`."""
        fresh = self._known.drop_known(buffer)
        prompts = self._renderer.render_all(fresh)
        by_sample: dict[int | None, list[tuple[Pending, ChunkPrompt]]] = {}
        for item, prompt in zip(fresh, prompts, strict=True):
            if prompt is not None:
                by_sample.setdefault(item.sample, []).append((item, prompt))
        chunks = [
            (sample, chunk_prompts)
            for sample, rendered in sorted(by_sample.items(), key=lambda group: group[0] or 0)
            for chunk_prompts in self._order.chunks(rendered, self._spec.chunk_size)
        ]
        for i, (sample, chunk_prompts) in enumerate(chunks):
            sampling = {} if sample is None else {SEED_PARAM: sample_seed(self._spec.name, sample)}
            # The cursor moves with the buffer's last chunk only: a crash before it reads
            # the buffer's rows again, and those already published are skipped.
            last = i == len(chunks) - 1
            cursor = last_row if last else self._cursor_at[fingerprint]
            self._publish(chunk_prompts, sampling, fingerprint, cursor)
        if not chunks:
            self._save_cursors({fingerprint: last_row})
        self._lost.clear()

    def _publish(
        self, prompts: list[ChunkPrompt], sampling: dict[str, Any], fingerprint: str, cursor: int
    ) -> None:
        """Publish prompts as one chunk, less any another producer enqueued meanwhile,
        moving the file's cursor to `cursor`."""
        cursors = {fingerprint: cursor}
        while prompts:
            self._wait_for_room()
            ids = [pid for p in prompts for pid in p.accounted_ids]
            chunk = Chunk(self._spec.name, Chunk.make_id(self._spec.name, ids), prompts, sampling)
            resumed = self._lost.checkpoint(chunk.chunk_id, prompts)
            outcome = self._publisher.publish(
                chunk.chunk_id, chunk.to_payload(), ids, cursors, behind=self._cursor_at,
                after_chunk=self._last_chunk.get(fingerprint),
            )  # fmt: skip
            if outcome.published or not outcome.already_enqueued:
                self._last_chunk[fingerprint] = chunk.chunk_id
                self._lost.published(resumed)
                if outcome.published:
                    self.stats.enqueued += len(ids)
                    self.stats.chunks += 1
                    self.stats.conversations_resumed += len(resumed)
                    self._cursor_at.update(cursors)
                else:  # this exact chunk was published before: its prompts are in
                    self.stats.duplicates += len(ids)
                    self._save_cursors(cursors)
                return
            # Another producer enqueued some of these prompts meanwhile.
            taken = set(outcome.already_enqueued)
            self.stats.duplicates += len(taken)
            prompts = [p for p in prompts if taken.isdisjoint(p.accounted_ids)]
        self._save_cursors(cursors)

    def _save_cursors(self, cursors: dict[str, int]) -> None:
        """Move cursors past rows that needed no chunk; raises CursorBehind."""
        for name, value in cursors.items():
            self._publisher.move_cursor(name, value, self._cursor_at.get(name, 0))
            self._cursor_at[name] = value

    def _wait_for_room(self) -> None:
        """Backpressure: block while the job's window in Redis is full."""
        while True:
            self._mark.renew_if_due()
            self.stats.waiting = waiting_chunks(self._r, self._spec)
            self.stats.throttled = self.stats.waiting >= self._high_water
            if not self.stats.throttled:
                return
            self._on_progress(self.stats)
            time.sleep(BACKPRESSURE_POLL_S)


def expand_datasets(paths: list[str]) -> list[Path]:
    """Datasets in the order given; a directory expands to its supported files, sorted."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(
                sorted(p for p in path.iterdir() if p.name.lower().endswith(SUPPORTED_SUFFIXES))
            )
        else:
            out.append(path)
    return out
