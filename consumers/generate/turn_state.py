"""Where a conversation stands (`--turns all`), and how each of its turns is settled.

A turn is handed off as any result is (chunk_life, under the chunk's lease), with the
target's answer written into the conversation's checkpoint (`keys.conversation_answers`)
in the same script, or the checkpoint deleted with the last turn. Only the delivery
holding the chunk's lease writes, so a turn is handed off once even when its chunk runs
twice at once. A redelivered chunk resumes each conversation at its first turn not
settled, its history rebuilt from the checkpointed answers: a handed-off turn is never
generated again, nor one skipped.

A turn that fails is dead-lettered with its history (its prompt messages), the turns
after it blocked behind it (common/conversation.py), and the checkpoint deleted: the
dead letter is what a requeue resumes from, so no checkpoint outlives its chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis

from regen.common import dlq, keys
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.conversation import Conversation, blocked_letters, turn_id
from regen.common.output_calls import with_call_ids
from regen.common.results import GeneratedResult
from regen.consumers.generate.chunk_life import Checkpoint, mark_generated
from regen.consumers.generate.prompt_outcomes import dead_letter
from regen.consumers.generate.reasons import Reason


class HistoryLost(RuntimeError):
    """Turns of a conversation are settled but its checkpoint lacks their answers."""


@dataclass(frozen=True)
class Turn:
    """One turn to run: `prompt` has the turn's id and prompt messages, and its ids once
    rendered (empty before)."""

    prompt: ChunkPrompt
    conversation: Conversation  # as the chunk carries it
    index: int

    @property
    def is_last(self) -> bool:
        return self.index == self.conversation.end - 1

    def rendered(self, prompt_ids: list[int]) -> Turn:
        return dataclasses.replace(
            self, prompt=dataclasses.replace(self.prompt, prompt_ids=prompt_ids)
        )

    def result(self, generated: GeneratedResult) -> GeneratedResult:
        return dataclasses.replace(generated, conversation_id=self.conversation.id, turn=self.index)


def _answers_key(chunk: Chunk, conversation: Conversation) -> str:
    return keys.conversation_answers(chunk.job, chunk.chunk_id, conversation.id)


class ToolCallDiverged(Exception):
    """The dataset answers a tool call after this turn, but the target's own turn did not
    make that call: no tool result exists for what it did, so the conversation stops,
    `turn` (the next one) dead-lettered."""

    def __init__(self, turn: Turn, message: str) -> None:
        super().__init__(message)
        self.turn = turn


def fit_tool_results(answer: dict[str, Any], following: list[dict[str, Any]]) -> str | None:
    """Fit the dataset's messages after a turn to the target's `answer` (in place): the
    tool results they open with answer the target's own calls, in order, and take their
    ids. The results themselves are the dataset's (an observation cannot be regenerated;
    the record says so). Returns why they do not fit, or None."""
    results = list(itertools.takewhile(lambda m: m["role"] == "tool", following))
    calls = answer.get("tool_calls") or []
    if len(calls) != len(results):
        return (
            f"the dataset has {len(results)} tool result(s) here, the target's turn made "
            f"{len(calls)} call(s)"
        )
    for result, call in zip(results, calls, strict=True):
        name = call["function"]["name"]
        if result.get("name", name) != name:
            return f"the dataset's tool result is {result['name']!r}'s, the target called {name!r}"
        result["tool_call_id"] = call["id"]
    return None


def next_turn(turn: Turn, answer: dict[str, Any]) -> Turn | None:
    """The turn after `turn`, its history holding the target's `answer`, not rendered;
    None where the conversation ends. Raises ToolCallDiverged."""
    if turn.is_last:
        return None
    if answer.get("tool_calls"):
        # A checkpoint from before calls got ids may hold calls without (JobChat.answer
        # gives them now): the same ids the record of `turn` holds.
        answer = {**answer, "tool_calls": with_call_ids(answer["tool_calls"], turn.prompt.id)}
    index = turn.index + 1
    following = [dict(m) for m in turn.conversation.context_before(index)]
    diverged = fit_tool_results(answer, following)
    messages = [*turn.prompt.messages, answer, *following]
    prompt = ChunkPrompt(
        id=turn_id(turn.conversation.id, index),
        prompt_ids=[],
        messages=messages,
        source=turn.prompt.source,
        tools=turn.prompt.tools,
    )
    following_turn = Turn(prompt, turn.conversation, index)
    if diverged is not None:
        raise ToolCallDiverged(following_turn, diverged)
    return following_turn


def resume(r: redis.Redis, chunk: Chunk, prompt: ChunkPrompt, settled: set[str]) -> Turn | None:
    """The first turn of the prompt's conversation not settled yet (None when all are),
    with the checkpointed answers of the turns before it in its history."""
    conversation = prompt.conversation
    assert conversation is not None
    turn = Turn(prompt, conversation, conversation.start)
    open_turns = [tid for tid in conversation.turn_ids() if tid not in settled]
    if not open_turns:
        return None
    first_open = conversation.end - len(open_turns)
    if first_open == turn.index:
        return turn
    wanted = list(range(conversation.start, first_open))
    fields = [str(i) for i in wanted]
    answers = cast("list[bytes | None]", r.hmget(_answers_key(chunk, conversation), fields))
    for index, raw in zip(wanted, answers, strict=True):
        if raw is None:
            raise HistoryLost(f"{turn_id(conversation.id, index)} is settled, its answer lost")
        following = next_turn(turn, orjson.loads(raw))
        assert following is not None  # the open turn comes after this one
        turn = following
    return turn


def checkpoint(chunk: Chunk, turn: Turn, answer: dict[str, Any]) -> Checkpoint:
    """What the turn's hand-off writes into its conversation's checkpoint: the answer,
    or, after the last turn, the checkpoint's end."""
    answer_json = None if turn.is_last else orjson.dumps(answer)
    return Checkpoint(_answers_key(chunk, turn.conversation), str(turn.index), answer_json)


def dead_letter_turn(pipe: redis.client.Pipeline, chunk: Chunk, turn: Turn, **letter: Any) -> int:
    """Dead-letter the turn (prompt_outcomes.dead_letter's arguments) with what resuming it needs,
    block the turns after it, and drop the checkpoint. Returns the turns settled."""
    rest = turn.conversation.from_turn(turn.index)
    first = dead_letter(pipe, chunk, turn.prompt, conversation=rest.to_dict(), **letter)
    blocked = blocked_letters(first, rest, turn.index)
    for each in blocked:
        dlq.put(pipe, each)
    if blocked:
        mark_generated(pipe, chunk, *(each.entry_id for each in blocked))
    pipe.delete(_answers_key(chunk, turn.conversation))
    return 1 + len(blocked)


def dead_letter_conversation(
    r: redis.Redis,
    pipe: redis.client.Pipeline,
    chunk: Chunk,
    prompt: ChunkPrompt,
    settled: set[str],
    *,
    message: str,
    **letter: Any,
) -> int:
    """Dead-letter a conversation of a poison chunk at its open turn, with the history
    checkpointed so far (nothing rendered: the tokenizer may be what failed); returns
    the turns settled."""
    try:
        turn = resume(r, chunk, prompt, settled)
    except HistoryLost as exc:
        # Not resumable: the entry says so and keeps no prompt to requeue.
        message = f"{message}; {exc}"
        turn = _open_turn_without_history(prompt, settled)
    except ToolCallDiverged as exc:
        # The open turn cannot run on the answer before it, whatever the chunk's fault:
        # the reason a delivery would have given it.
        turn = exc.turn
        letter = {**letter, "reason": Reason.TOOL_CALL_DIVERGED}
        message = str(exc)
    if turn is None:
        return 0
    return dead_letter_turn(pipe, chunk, turn, message=message, **letter)


def _open_turn_without_history(prompt: ChunkPrompt, settled: set[str]) -> Turn:
    conversation = prompt.conversation
    assert conversation is not None
    ids = conversation.turn_ids()
    offset = next(i for i, tid in enumerate(ids) if tid not in settled)
    index = conversation.start + offset
    return Turn(ChunkPrompt(ids[offset], [], [], prompt.source), conversation, index)
