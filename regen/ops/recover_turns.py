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
checkpoint dropped, as its last hand-off would have (docs/design.md, Exactly-once
commits). Memory: the window's chunks and the answers of their committed turns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis
from redis.typing import EncodableT, FieldT

from regen.common import defaults, keys
from regen.common.chunk import Chunk
from regen.common.conversation import Conversation
from regen.common.jobspec import JobSpec
from regen.common.queues import queue_lists
from regen.consumers.tokenize.commit import CommitLedger
from regen.consumers.tokenize.shard_files import iter_records
from regen.ops.accounting import MESSAGES_PER_CALL, text
from regen.ops.locate import decode_chunk_message


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
    r: redis.Redis, ledger: CommitLedger, spec: JobSpec, folder: Path, on_disk: set[str]
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
        generated_key = keys.chunk_generated(spec.name, plan.chunk.chunk_id)
        pipe.sadd(generated_key, *(tid for _, tid, _ in plan.committed))
        pipe.expire(generated_key, defaults.CHUNK_STATE_TTL_S)
        answers_key = keys.conversation_answers(
            spec.name, plan.chunk.chunk_id, plan.conversation.id
        )
        if plan.complete:
            pipe.delete(answers_key)
            continue
        mapping: dict[FieldT, EncodableT] = {
            str(turn): orjson.dumps(answers[tid]) for turn, tid, _ in plan.committed
        }
        pipe.hset(answers_key, mapping=mapping)
        pipe.expire(answers_key, defaults.CHUNK_STATE_TTL_S)
    pipe.execute()
    return report


def _answers(folder: Path, plans: list[_Resume]) -> dict[str, dict[str, Any]]:
    """Each committed turn's answer, the assistant message its record ends with; one
    pass over each shard that holds some."""
    by_shard: dict[str, set[str]] = {}
    for plan in plans:
        for _, tid, shard in plan.committed:
            by_shard.setdefault(shard, set()).add(tid)
    found: dict[str, dict[str, Any]] = {}
    for shard, wanted in sorted(by_shard.items()):
        for record in iter_records(folder / shard):
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
