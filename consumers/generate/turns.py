"""Run a chunk's conversations turn by turn (`regen enqueue --turns all`).

Each conversation runs its turns in order inside the chunk's task: generate turn k,
hand it off, render turn k+1 with the job's chat template from the dataset's messages
and the target's own answers so far, send it, and so on; the chunk's conversations run
side by side. The worker drives the turns, rather than the tokenize stage enqueueing
each next one, because the next turn then reaches the same engine seconds after the
previous one, while its prefix is still in SGLang's radix cache, and no turn waits for
a round trip through shards and queues. How each turn is settled exactly once, and how
a redelivered chunk resumes, is turn_state.py's.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

import redis

from regen.common import crashpoints
from regen.common.chat_family import ChatTemplateError
from regen.common.chunk import Chunk, ChunkPrompt
from regen.consumers.generate.engine import GenerateRequest, GenerateResult, PromptRejected
from regen.consumers.generate.reasons import Reason
from regen.consumers.generate.settle import (
    generate_with_retry,
    generated_result,
)
from regen.consumers.generate.turn_state import (
    HistoryLost,
    ToolCallDiverged,
    Turn,
    checkpointed_answer,
    dead_letter_turn,
    hand_off,
    next_turn,
    resume,
)

if TYPE_CHECKING:
    from regen.consumers.generate.chunk_runner import ChunkContext

# Where a crash test kills the worker: right after a turn that has a next one is handed off.
CRASHPOINT = "generate.between_turns"


class _Conversations:
    """The turns of one delivery of a chunk: those running, and what they came to."""

    def __init__(self, ctx: ChunkContext, chunk: Chunk, attempt: int) -> None:
        self.ctx = ctx
        self.chunk = chunk
        self.attempt = attempt
        spec = ctx.spec(chunk.job)
        # A requeued chunk may override some params (`regen dlq requeue --set`).
        self.sampling = {**spec.sampling, **chunk.sampling}
        self.limit = dataclasses.replace(spec, sampling=self.sampling).prompt_token_limit()
        self.chat = ctx.chat(chunk.job)
        self.running: dict[Future[GenerateResult], Turn] = {}
        self.generated = 0
        self.dead_lettered = 0

    def send(self, turn: Turn) -> None:
        """Render the turn where the chunk did not carry its ids, check that it fits,
        and submit it; a turn that cannot be sent is dead-lettered."""
        if not turn.prompt.prompt_ids:
            try:
                turn = turn.rendered(self.chat.render(turn.prompt.messages, turn.prompt.tools))
            except ChatTemplateError as exc:
                self.fail(turn, Reason.TEMPLATE_ERROR, str(exc))
                return
        n_prompt = len(turn.prompt.prompt_ids)
        if self.limit is not None and n_prompt > self.limit:
            message = (
                f"turn prompt is {n_prompt} tokens; the job allows {self.limit} with "
                f"max_new_tokens {self.sampling['max_new_tokens']}"
            )
            self.fail(turn, Reason.PROMPT_TOO_LONG, message)
            return
        request = GenerateRequest(
            rid=f"{self.chunk.chunk_id}-{turn.prompt.id}-{self.attempt}",
            prompt_ids=turn.prompt.prompt_ids,
            sampling=dict(self.sampling),
            # The turns of a conversation follow each other to one server, whose radix
            # cache holds the conversation so far (docs/design.md, "Turns").
            affinity=f"{self.chunk.job}/{turn.conversation.id}",
            # Its conversation's earlier turn ran here: it starts before new ones.
            next_turn=turn.index > turn.conversation.start,
        )
        runner = self.ctx.runner
        self.running[runner.submit(generate_with_retry(runner, request))] = turn
        self.ctx.count_inflight(1)

    def run(self) -> None:
        """Until every conversation has ended or stopped at a dead-lettered turn."""
        try:
            while self.running:
                finished, _ = wait(self.running, return_when=FIRST_COMPLETED)
                for future in finished:
                    turn = self.running.pop(future)
                    self.ctx.count_inflight(-1)
                    self.finish(turn, future)
        except BaseException:
            # Leaving early: stop the turns still running; the chunk comes back unacked.
            for future in self.running:
                if future.cancel():
                    self.ctx.count_inflight(-1)
            raise

    def finish(self, turn: Turn, future: Future[GenerateResult]) -> None:
        """Hand the turn off and send the next one."""
        try:
            output = future.result()
        except PromptRejected as exc:
            self.fail(turn, Reason.REJECTED_BY_SERVER, exc.message, server=exc.server)
            return
        answer = self.chat.answer(turn.prompt.prompt_ids, output, turn.prompt.tools, self.sampling)
        ctx = self.ctx
        result = generated_result(
            self.chunk,
            turn.prompt,
            output,
            worker=ctx.worker,
            attempt=self.attempt,
            sampling=self.sampling,
        )
        if hand_off(ctx.redis, self.chunk, turn, turn.result(result), answer):
            self.generated += 1
            ctx.tokens.add(output.completion_tokens)
            ctx.prompts.add()
        else:  # another delivery of the chunk settled it first: go on from its answer
            settled = checkpointed_answer(ctx.redis, self.chunk, turn)
            if settled is None:
                return
            answer = settled
        try:
            following = next_turn(turn, answer)
        except ToolCallDiverged as exc:
            self.fail(exc.turn, Reason.TOOL_CALL_DIVERGED, str(exc))
            return
        if following is not None:
            crashpoints.hit(CRASHPOINT)
            self.send(following)

    def fail(self, turn: Turn, reason: Reason, message: str, **payload: Any) -> None:
        pipe = self.ctx.redis.pipeline()
        self.dead_lettered += dead_letter_turn(
            pipe,
            self.chunk,
            turn,
            worker=self.ctx.worker,
            reason=reason,
            message=message,
            attempts=self.attempt + 1,
            **payload,
        )
        pipe.execute()


def run_conversations(
    ctx: ChunkContext, chunk: Chunk, prompts: list[ChunkPrompt], attempt: int, settled: set[str]
) -> tuple[int, int]:
    """Run the open turns of the chunk's conversations; (turns generated, dead-lettered)."""
    conversations = _Conversations(ctx, chunk, attempt)
    for prompt in prompts:
        turn = resume(ctx.redis, chunk, prompt, settled)
        if turn is not None:
            conversations.send(turn)
    conversations.run()
    return conversations.generated, conversations.dead_lettered


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
