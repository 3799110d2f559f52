"""The producer: dataset rows -> prompts -> chunks on the job's generate queue.

Each file is read from its resume cursor; every row ends in exactly one place: a chunk
(published atomically with its ids and the cursor, see publish.py), the input DLQ (with
file, row and reason), or counted as a duplicate of a prompt already in the job. The
cursor only moves past rows that are resolved, so `kill -9` then the same command again
continues where it stopped. A cursor found behind where this producer moved it (Redis
restored from an older copy while it ran) sends it back to read the file again from
the cursor Redis has: the chunks the copy lost are published again.

With `--turns all` a row becomes a conversation (producer/conversations.py): its first
turn is rendered and checked here, and every turn's id enters the job with its chunk. A
conversation Redis lost while the shards hold its first turns resumes after them
(producer/lost_turns.py).
With `--samples K` each prompt becomes K prompts, rendered once and published as one
chunk per sample index with that sample's seed (common/samples.py); the file's cursor
moves with the last of them, so a crash in between re-reads the rows and publishes
only the samples not yet in the job.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from regen.common import chat_family, dlq, keys
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.committed_index import committed_index
from regen.common.conversation import Conversation, blocked_letters, turn_id
from regen.common.queues import waiting_chunks
from regen.common.samples import SEED_PARAM, sample_id, sample_seed
from regen.producer.conversations import job_prompt
from regen.producer.job_ids import JobIds
from regen.producer.lost_turns import LostTurns, history_lost_letters
from regen.producer.publish import ChunkPublisher, CursorBehind
from regen.producer.readers import SUPPORTED_SUFFIXES, RawRow, file_fingerprint, iter_rows
from regen.producer.rows import BadRow, Prompt, Reason
from regen.producer.spec import PreparedJob

log = logging.getLogger("regen.producer")

BACKPRESSURE_POLL_S = 0.5
# The input DLQ keeps this much of a bad row, enough to see what was wrong with it.
RAW_SNIPPET_CHARS = 2000


@dataclass
class EnqueueStats:
    rows_read: int = 0
    rows_resumed: int = 0
    enqueued: int = 0
    duplicates: int = 0
    rejected: int = 0
    chunks: int = 0
    # Prompts already committed or dead-lettered though not among the job's ids (Redis
    # lost them and `regen recover` rebuilt the ledger): recorded as enqueued, not queued.
    already_settled: int = 0
    # Conversations Redis lost while shards hold their first turns, published again to
    # resume after those turns (producer/lost_turns.py).
    conversations_resumed: int = 0
    waiting: int = 0
    high_water: int = 0
    throttled: bool = False
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def rate(self) -> float:
        return self.rows_read / max(time.monotonic() - self.started, 1e-9)


@dataclass
class _Pending:
    prompt: Prompt
    source: dict[str, Any]
    # With --turns all, the conversation whose first turn `prompt` is.
    conversation: Conversation | None = None
    # With --samples, the sample this is (None: the job draws one answer a prompt).
    sample: int | None = None

    @property
    def id(self) -> str:
        """The prompt's id: its first turn's for a conversation (all come in together),
        a sample's own (common/samples.py)."""
        if self.conversation is not None:
            return turn_id(self.conversation.id, 0)
        return self.prompt.id if self.sample is None else sample_id(self.prompt.id, self.sample)

    def as_sample(self, k: int) -> _Pending:
        """Sample k of this prompt (a conversation: with its own conversation id), its
        index in the source."""
        source = {**self.source, "sample": k}
        conversation = self.conversation
        if conversation is not None:
            conversation = replace(conversation, id=sample_id(conversation.id, k))
        return replace(self, source=source, conversation=conversation, sample=k)


class Enqueuer:
    def __init__(
        self,
        r: redis.Redis,
        app: Celery,
        job: PreparedJob,
        *,
        high_water: int,
        on_progress: Callable[[EnqueueStats], None] = lambda stats: None,
    ) -> None:
        self._r = r
        self._job = job
        self._spec = job.spec
        self._publisher = ChunkPublisher(app, r, self._spec)
        self._committed = committed_index(r, self._spec.name)
        self._ids = JobIds(r, self._spec.name)
        self._lost = LostTurns(r, self._spec.name)
        self._high_water = high_water
        self._on_progress = on_progress
        self._token_limit = self._spec.prompt_token_limit()
        # Per file: where this producer last moved (or found) its cursor in Redis.
        self._cursor_at: dict[str, int] = {}
        self.stats = EnqueueStats(high_water=high_water)

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
        self.stats.rows_resumed += start
        if budget is not None:
            budget -= start
        last_row = start
        buffer: list[_Pending] = []
        for raw in iter_rows(path, start_row=start):
            if budget is not None:
                if budget <= 0:
                    break
                budget -= 1
            self.stats.rows_read += 1
            last_row = max(last_row, raw.row)
            pending = self._interpret(raw, path)
            if pending is not None:
                buffer.extend(self._samples(pending))
            if len(buffer) >= self._spec.chunk_size * self._spec.samples:
                self._flush(buffer, fingerprint, last_row)
                buffer = []
            if self.stats.rows_read % 256 == 0:
                self._on_progress(self.stats)
        # Rows after the last full chunk form the file's final, smaller chunk.
        self._flush(buffer, fingerprint, last_row)
        return budget

    # --- one row -------------------------------------------------------------------

    def _interpret(self, raw: RawRow, path: Path) -> _Pending | None:
        source = {"file": str(path), "row": raw.row}
        if raw.error is not None:
            self._dead_letter_row(raw, path, raw.error.reason, raw.error.message)
            return None
        try:
            prompt, conversation = job_prompt(raw.value, self._spec)
        except BadRow as exc:
            self._dead_letter_row(raw, path, exc.reason, exc.message)
            return None
        source["id"] = prompt.source_id
        return _Pending(prompt=prompt, source=source, conversation=conversation)

    def _samples(self, item: _Pending) -> list[_Pending]:
        """The prompts a row's prompt makes: itself, or one per sample (--samples)."""
        if self._spec.samples == 1:
            return [item]
        return [item.as_sample(k) for k in range(self._spec.samples)]

    def _dead_letter_row(self, raw: RawRow, path: Path, reason: str, message: str) -> None:
        # Keyed by file and row, so re-reading the file after a crash overwrites the entry.
        key = hashlib.blake2b(f"{Path(path).resolve()}\0{raw.row}".encode(), digest_size=8)
        snippet = None if raw.value is None else repr(raw.value)[:RAW_SNIPPET_CHARS]
        dlq.put(
            self._r,
            dlq.DeadLetter(
                entry_id=f"row:{key.hexdigest()}",
                job=self._spec.name,
                stage="input",
                reason=reason,
                message=message,
                source={"file": str(path), "row": raw.row},
                payload={"row": snippet},
            ),
        )
        self._count_rejected(reason)

    def _count_rejected(self, reason: str) -> None:
        self.stats.rejected += 1
        by_reason = self.stats.rejected_by_reason
        code = str(reason)  # a Reason member is no JSON key: count by its string
        by_reason[code] = by_reason.get(code, 0) + 1

    # --- a chunk -------------------------------------------------------------------

    def _flush(self, buffer: list[_Pending], fingerprint: str, last_row: int) -> None:
        """Resolve every buffered row, then move the file's cursor to `last_row`."""
        fresh = self._drop_known(buffer)
        prompts = self._render_all(fresh)
        by_sample: dict[int | None, list[ChunkPrompt]] = {}
        for item, prompt in zip(fresh, prompts, strict=True):
            if prompt is not None:
                by_sample.setdefault(item.sample, []).append(prompt)
        groups = sorted(by_sample.items(), key=lambda group: group[0] or 0)
        for i, (sample, chunk_prompts) in enumerate(groups):
            sampling = {} if sample is None else {SEED_PARAM: sample_seed(self._spec.name, sample)}
            # The cursor moves with the buffer's last chunk only.
            last = i == len(groups) - 1
            self._publish(chunk_prompts, sampling, {fingerprint: last_row} if last else {})
        if not groups:
            self._save_cursors({fingerprint: last_row})
        self._lost.clear()

    def _render_all(self, fresh: list[_Pending]) -> list[ChunkPrompt | None]:
        """Each prompt rendered, or dead-lettered (None). The samples of one prompt share
        its rendering, which does not depend on the sample; one that fails is tried for
        each sample, so that each sample's id gets its own dead letter."""
        rendered: dict[str, ChunkPrompt | None] = {}
        out: list[ChunkPrompt | None] = []
        for item in fresh:
            if item.sample is None:
                out.append(self._render(item))
                continue
            base = item.prompt.id  # the same for every sample of the prompt
            if base not in rendered:
                rendered[base] = self._render(item)
                out.append(rendered[base])
                continue
            first = rendered[base]
            if first is None:
                out.append(self._render(item))
            else:
                out.append(replace(first, id=item.id, source=item.source,
                                   conversation=item.conversation))  # fmt: skip
        return out

    def _publish(
        self, prompts: list[ChunkPrompt], sampling: dict[str, Any], cursors: dict[str, int]
    ) -> None:
        """Publish prompts as one chunk, less any another producer enqueued meanwhile."""
        while prompts:
            self._wait_for_room()
            ids = [pid for p in prompts for pid in p.accounted_ids]
            chunk = Chunk(self._spec.name, Chunk.make_id(self._spec.name, ids), prompts, sampling)
            resumed = self._lost.checkpoint(chunk.chunk_id, prompts)
            outcome = self._publisher.publish(
                chunk.chunk_id, chunk.to_payload(), ids, cursors, behind=self._cursor_at
            )
            if outcome.published or not outcome.already_enqueued:
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

    def _drop_known(self, buffer: list[_Pending]) -> list[_Pending]:
        """Drop prompts already in the job or earlier in this buffer (exact duplicates),
        and those already settled though Redis lost them from the job's ids."""
        if not buffer:
            return []
        ids = [item.id for item in buffer]
        known = self._ids.contains(ids)
        unknown: dict[str, _Pending] = {}
        for item, pid, is_known in zip(buffer, ids, known, strict=True):
            if not is_known:
                unknown.setdefault(pid, item)
        settled, dropped = self._settled(list(unknown.values()))
        seen: set[str] = set()
        fresh = []
        for item, pid, is_known in zip(buffer, ids, known, strict=True):
            if is_known or pid in seen:
                self.stats.duplicates += 1
            elif pid in settled:
                self.stats.already_settled += 1
            elif pid not in dropped:
                fresh.append(item)
            seen.add(pid)
        return fresh

    def _settled(self, items: list[_Pending]) -> tuple[set[str], set[str]]:
        """Of prompts not in the job's ids: the ids of those settled, every turn committed
        to a shard or dead-lettered (after `regen recover`), put back into the job's ids
        so every place they are in counts them, and not queued again; and the ids of
        conversations not queued for another reason. A conversation whose first turns
        are settled and the others in no place (Redis lost its chunk) resumes after them,
        or, without their answers, has its open turns dead-lettered (lost_turns.py)."""
        whole: list[_Pending] = []
        lost: list[tuple[_Pending, Conversation, list[bool]]] = []
        for item, flags in zip(items, self._turns_settled(items), strict=True):
            if all(flags):
                whole.append(item)
            elif flags[0] and item.conversation is not None:  # a prompt alone: all or none
                lost.append((item, item.conversation, flags))
        self._ids.add([tid for item in whole for tid in _turn_ids(item)])
        self._lost.forget([tid for item in whole if item.conversation for tid in _turn_ids(item)])
        return {item.id for item in whole}, self._refuse_unresumable(lost)

    def _turns_settled(self, items: list[_Pending]) -> list[list[bool]]:
        """Whether each turn of each prompt (a prompt: its one id) is settled; the later
        turns of a conversation are looked up only when its first is settled."""
        firsts = self._is_settled([item.id for item in items])
        later = [
            _turn_ids(item)[1:] if first else [] for item, first in zip(items, firsts, strict=True)
        ]
        flags = iter(self._is_settled([tid for ids in later for tid in ids]))
        pairs = zip(firsts, later, strict=True)
        return [[first, *(next(flags) for _ in ids)] for first, ids in pairs]

    def _is_settled(self, ids: list[str]) -> list[bool]:
        """Whether each id is committed to a shard (or claimed) or dead-lettered."""
        committed = self._committed.get(ids)
        dead = dlq.dead_lettered(self._r, self._spec.name, ids)
        pairs = zip(committed, dead, strict=True)
        return [shard is not None or is_dead for shard, is_dead in pairs]

    def _refuse_unresumable(
        self, lost: list[tuple[_Pending, Conversation, list[bool]]]
    ) -> set[str]:
        """Of conversations Redis lost whose first turns are settled, those that can
        resume stay to be published; the others' open turns are dead-lettered. Returns
        the ids of the conversations not to queue."""
        if not lost:
            return set()
        resumable = self._lost.resume([(conversation, flags) for _, conversation, flags in lost])
        stuck = [each for each, ok in zip(lost, resumable, strict=True) if not ok]
        # Another producer may have resumed one meanwhile, dropping its answers.
        again = self._ids.contains([item.id for item, _, _ in stuck])
        dropped: set[str] = set()
        for (item, conversation, flags), is_in in zip(stuck, again, strict=True):
            dropped.add(item.id)
            if is_in:
                self.stats.duplicates += 1
                continue
            letters = history_lost_letters(self._spec.name, conversation, flags, item.source)
            self._put_letters(letters, conversation.turn_ids())
            self._lost.forget(conversation.turn_ids())
            self._count_rejected(Reason.HISTORY_LOST)
        return dropped

    def _render(self, item: _Pending) -> ChunkPrompt | None:
        messages, tools = item.prompt.messages, item.prompt.tools
        too_large = self._job.too_large(messages)
        if too_large is not None:
            snippet = repr(messages)[:RAW_SNIPPET_CHARS]  # not the whole row: it can be huge
            self._dead_letter_prompt(item, Reason.ROW_TOO_LARGE, too_large, {"row": snippet})
            return None
        try:
            ids = chat_family.render_prompt_ids(
                self._job.tokenizer, messages, self._spec.chat_template_kwargs, tools
            )
        except Exception as exc:  # a template that raises on this conversation
            self._dead_letter_prompt(
                item, Reason.TEMPLATE_ERROR, f"chat template failed: {exc}", self._payload(item, [])
            )
            return None
        if self._token_limit is not None and len(ids) > self._token_limit:
            self._dead_letter_prompt(
                item,
                Reason.PROMPT_TOO_LONG,
                (
                    f"prompt is {len(ids)} tokens; the job allows {self._token_limit} "
                    f"(max_prompt_tokens={self._spec.max_prompt_tokens}, context "
                    f"{self._spec.context_length} - max_new_tokens "
                    f"{self._spec.sampling['max_new_tokens']})"
                ),
                self._payload(item, ids),
            )
            return None
        return ChunkPrompt(
            id=item.id,
            prompt_ids=ids,
            messages=messages,
            source=item.source,
            tools=tools,
            conversation=item.conversation,
        )

    @staticmethod
    def _payload(item: _Pending, prompt_ids: list[int]) -> dict[str, Any]:
        """What a requeue of a refused prompt needs (`regen dlq requeue`)."""
        return {
            "messages": item.prompt.messages,
            "tools": item.prompt.tools,
            "prompt_tokens": len(prompt_ids),
        }

    def _dead_letter_prompt(
        self, item: _Pending, reason: Reason, message: str, payload: dict[str, Any]
    ) -> None:
        """A prompt the job refuses still belongs to the job: its id goes into the job's
        id set together with the DLQ entry, so it is accounted for (and not retried). A
        conversation's later turns wait behind its first, each with its own entry."""
        pid = item.id
        if item.conversation is not None:
            payload = {**payload, "conversation": item.conversation.to_dict()}
        letter = dlq.DeadLetter(
            entry_id=pid,
            job=self._spec.name,
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
        self._put_letters(letters, [each.entry_id for each in letters])
        self._count_rejected(reason)

    def _put_letters(self, letters: list[dlq.DeadLetter], ids: list[str]) -> None:
        """Dead-letter prompts, with `ids` (theirs, and any others of their conversation)
        recorded in the job's ids in the same transaction."""
        pipe = self._r.pipeline()
        self._ids.add(ids, pipe)
        for each in letters:
            dlq.put(pipe, each)
        pipe.execute()

    def _wait_for_room(self) -> None:
        """Backpressure: block while the job's window in Redis is full."""
        while True:
            self.stats.waiting = waiting_chunks(self._r, self._spec)
            self.stats.throttled = self.stats.waiting >= self._high_water
            if not self.stats.throttled:
                return
            self._on_progress(self.stats)
            time.sleep(BACKPRESSURE_POLL_S)


def _turn_ids(item: _Pending) -> list[str]:
    """The ids a prompt accounts for: a conversation's turns, else its own."""
    return [item.id] if item.conversation is None else item.conversation.turn_ids()


def reread_from_start(r: redis.Redis, job: str) -> int:
    """Drop the job's resume cursors, so its next enqueue reads every file from the first
    row (after `regen recover`: cursors restored from an older copy, or moved on by a
    producer that kept running, can be past prompts Redis lost). Enqueued, committed and
    dead-lettered prompts are skipped on the way. Returns how many cursors there were."""
    pipe = r.pipeline()
    pipe.hlen(keys.job_cursors(job))
    pipe.delete(keys.job_cursors(job))
    dropped, _ = pipe.execute()
    return int(dropped)


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
