"""`regen recover` for `--turns all` jobs: conversations in progress resume after the
turns their shards already hold.

A chunk of conversations marks each turn it hands off in its `generated` set and
checkpoints the turn's answer (consumers/generate/turn_state.py); a redelivered chunk
resumes each conversation at its first turn not marked, on the checkpointed answers. A
Redis that came back from an older copy lost the marks and checkpoints of the turns
handed off since, while the shards hold their records: the chunk would generate those
turns again, and the turns after them on other answers than the records hold. So for
each of the job's chunks still waiting or in flight, every conversation's turns that
are committed to a shard on disk (a prefix of its turns: a turn is handed off only
after the one before it) are marked generated and their answers checkpointed from
their records, one transaction per chunk; a conversation committed whole has its
checkpoint dropped, as its last hand-off would have (docs/design/exactly-once.md, Exactly-once
commits). Memory: the window's chunks and the answers of their committed turns.

A conversation whose chunk Redis lost whole (published after the copy was taken) has no
chunk to mark: the answers of its committed turns are saved in the job's
`recovered_answers` (LostAnswers), and the job's enqueue publishes the conversation
again with that same state written for its new chunk (producer/lost_turns.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
from redis.typing import EncodableT, FieldT

from regen.common import defaults, keys
from regen.common.chunk import Chunk
from regen.common.conversation import (
    Conversation,
    checkpoint_settled,
    split_turn_id,
    turn_id,
)
from regen.common.jobspec import JobSpec
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.ledger.job_ids import JobIds
from regen.common.ledger.places import MESSAGES_PER_CALL, batches, decode_chunk_message, text
from regen.common.queues import queue_lists
from regen.consumers.tokenize.job_folder import JobFolder, ShardRef
from regen.consumers.tokenize.shard_files import READ_ERRORS, iter_records


@dataclass
class _Resume:
    """One conversation of a chunk: its committed turns (a prefix), with their shards."""

    chunk: Chunk
    conversation: Conversation
    committed: list[tuple[int, str, str]]  # (turn, turn id, shard)

    @property
    def complete(self) -> bool:
        return len(self.committed) == self.conversation.end - self.conversation.start


@dataclass
class TurnsResumed:
    turns: int = 0  # committed turns newly marked generated in their chunk
    conversations: int = 0
    chunks: set[str] = field(default_factory=set)


def resume_after_shards(
    r: redis.Redis, ledger: CommitLedger, spec: JobSpec, folder: JobFolder, on_disk: set[str]
) -> TurnsResumed:
    """Mark the committed turns of the window's conversations generated, with their
    answers checkpointed from their records (the module doc)."""
    report = TurnsResumed()
    plans: list[_Resume] = []
    for chunk in _window_chunks(r, spec):
        raw = r.smembers(keys.chunk_generated(spec.name, chunk.chunk_id))
        generated = {text(member) for member in raw}
        for prompt in chunk.prompts:
            conversation = prompt.conversation
            if conversation is None:
                continue
            ids = conversation.turn_ids()
            committed = []
            for turn, (tid, owner) in enumerate(zip(ids, ledger.owner_of(ids), strict=True)):
                if owner is None or owner not in on_disk:
                    break
                committed.append((conversation.start + turn, tid, owner))
            missing = [tid for _, tid, _ in committed if tid not in generated]
            if missing:
                plans.append(_Resume(chunk, conversation, committed))
                report.turns += len(missing)
                report.conversations += 1
                report.chunks.add(chunk.chunk_id)
    if not plans:
        return report
    answers = _answers(folder, [p for p in plans if not p.complete])
    pipe = r.pipeline(transaction=True)
    for plan in plans:
        checkpoint = None
        if not plan.complete:
            checkpoint = {str(turn): orjson.dumps(answers[tid]) for turn, tid, _ in plan.committed}
        settled = [tid for _, tid, _ in plan.committed]
        checkpoint_settled(
            pipe, spec.name, plan.chunk.chunk_id, plan.conversation.id, settled, checkpoint
        )
    pipe.execute()
    return report


class LostAnswers:
    """Saves the answers of committed turns whose conversation Redis lost whole (its first
    turn not in the job's ids: its chunk was published after the copy Redis came back
    from), one shard at a time, for the job's enqueue to resume the conversation after
    them (producer/lost_turns.py). A chunk Redis still holds is resume_after_shards'. A
    shard is read whole only when it holds such a turn; saving again is harmless."""

    def __init__(self, r: redis.Redis, job: str) -> None:
        self._r = r
        self._key = keys.recovered_answers(job)
        self._job_ids = JobIds(r, job)
        self.turns = 0
        self.conversations: set[str] = set()

    def save(self, shard: ShardRef, ids: list[str]) -> None:
        """Save the answers of the shard's turns (`ids`) whose conversation is lost."""
        wanted: set[str] = set()
        for batch in batches(ids):
            firsts = [turn_id(split_turn_id(tid)[0], 0) for tid in batch]
            known = self._job_ids.contains(firsts)
            wanted.update(tid for tid, is_in in zip(batch, known, strict=True) if not is_in)
        if not wanted:
            return
        found: dict[FieldT, EncodableT] = {}
        for record in iter_records(shard):
            conversation = record.get("conversation_id")
            if conversation is not None and record["id"] in wanted:
                found[record["id"]] = orjson.dumps(record["messages"][-1])
                self.conversations.add(conversation)
        if not found:
            return
        pipe = self._r.pipeline(transaction=True)
        pipe.hset(self._key, mapping=found)
        pipe.expire(self._key, defaults.RECOVERED_ANSWERS_TTL_S)
        pipe.execute()
        self.turns += len(found)

    def save_settled_before(
        self, ledger: CommitLedger, folder: JobFolder, missing: list[str]
    ) -> None:
        """Save the answers of the turns committed before each conversation's first
        turn in `missing` (a conversation's turns settle in order, so those are all it
        has in shards), reading only the shards that hold them."""
        first_missing: dict[str, int] = {}
        for tid in missing:
            conversation, turn = split_turn_id(tid)
            first_missing[conversation] = min(turn, first_missing.get(conversation, turn))
        before = [turn_id(c, turn) for c, first in first_missing.items() for turn in range(first)]
        by_shard: dict[str, list[str]] = {}
        for batch in batches(before):
            for tid, owner in zip(batch, ledger.owner_of(batch), strict=True):
                if owner is not None:
                    by_shard.setdefault(owner, []).append(tid)
        for shard, ids in sorted(by_shard.items()):
            with contextlib.suppress(OSError, *READ_ERRORS):  # `recover` reported it
                self.save(ShardRef(folder, shard), ids)


def _answers(folder: JobFolder, plans: list[_Resume]) -> dict[str, dict[str, Any]]:
    """Each committed turn's answer, the assistant message its record ends with; one
    pass over each shard that holds some."""
    by_shard: dict[str, set[str]] = {}
    for plan in plans:
        for _, tid, shard in plan.committed:
            by_shard.setdefault(shard, set()).add(tid)
    found: dict[str, dict[str, Any]] = {}
    for shard, wanted in sorted(by_shard.items()):
        for record in iter_records(ShardRef(folder, shard)):
            if record["id"] in wanted:
                found[record["id"]] = record["messages"][-1]
    return found


def _window_chunks(r: redis.Redis, spec: JobSpec) -> Iterator[Chunk]:
    """The job's chunks on its queues and in flight (kombu's `unacked`), each once."""
    seen: set[str] = set()
    for payload in _window_payloads(r, spec):
        if payload.get("job") != spec.name or payload.get("chunk") in seen:
            continue
        seen.add(str(payload.get("chunk")))
        try:
            yield Chunk.from_payload(payload)
        except (ValueError, AttributeError):  # a poison message: generate dead-letters it
            continue


def _window_payloads(r: redis.Redis, spec: JobSpec) -> Iterator[dict[str, Any]]:
    """Chunk payloads on the job's queues, then in `unacked`; anything else skipped."""
    for queue in queue_lists(spec.queue):
        first = 0
        while raws := r.lrange(queue, first, first + MESSAGES_PER_CALL - 1):
            for raw in raws:
                payload = _payload(raw, unacked=False)
                if payload is not None:
                    yield payload
            first += MESSAGES_PER_CALL
    for _, raw in r.hscan_iter(keys.KOMBU_UNACKED, count=MESSAGES_PER_CALL):
        payload = _payload(raw, unacked=True)
        if payload is not None:
            yield payload


def _payload(raw: bytes | str, unacked: bool) -> dict[str, Any] | None:
    """The chunk payload of a kombu message (in `unacked`: [message, exchange, key])."""
    try:
        message = orjson.loads(raw)
        if unacked:
            message = message[0]
    except (orjson.JSONDecodeError, TypeError, KeyError, IndexError):
        return None
    return decode_chunk_message(message) if isinstance(message, dict) else None
