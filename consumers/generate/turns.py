"""Run a chunk's conversations turn by turn (`regen enqueue --turns all`).

Each conversation runs its turns in order inside the chunk's task: generate turn k,
hand it off, render turn k+1 with the job's chat template from the dataset's messages
and the target's own answers so far, send it, and so on; the chunk's conversations run
side by side. The worker drives the turns, rather than the tokenize stage enqueueing
each next one, because the next turn then reaches the same engine seconds after the
previous one, while its prefix is still in SGLang's radix cache, and no turn waits for
a round trip through shards and queues. Each turn is settled (handed off or
dead-lettered) through chunk_life, under the chunk's lease like every other result; how a
redelivered chunk resumes is turn_state.py's.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import redis

from regen.common import crashpoints, job_pause
from regen.common.chat_family import ChatTemplateError
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.jobspec import JobSpec
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import (
    ChunkDeferred,
    ChunkLease,
    LeaseLost,
    generate_with_retry,
    hand_off,
    write_dead_letters,
)
from regen.consumers.generate.engine import GenerateRequest, GenerateResult, PromptRejected
from regen.consumers.generate.prompt_outcomes import generated_result
from regen.consumers.generate.reasons import Reason
from regen.consumers.generate.turn_state import (
    ToolCallDiverged,
    Turn,
    checkpoint,
    dead_letter_turn,
    next_turn,
    resume,
)

# Where a crash test kills the worker: right after a turn that has a next one is handed off.
CRASHPOINT = "generate.between_turns"
# While turns run, a delivery looks this often whether the worker drains: a second
# against turns of minutes.
DRAIN_CHECK_S = 1.0


class _Conversations:
    """The turns of one delivery of a chunk: those running, and what they came to."""

    def __init__(
        self,
        ctx: ChunkContext,
        lease: ChunkLease,
        chunk: Chunk,
        spec: JobSpec,
        sampling: dict[str, Any],
    ) -> None:
        self.ctx = ctx
        self.lease = lease
        self.chunk = chunk
        self.attempt = lease.attempt
        self.sampling = sampling
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
            # cache holds the conversation so far (docs/design/delivery.md, "Turns").
            affinity=f"{self.chunk.job}/{turn.conversation.id}",
            # Its conversation's earlier turn ran here: it starts before new ones.
            next_turn=turn.index > turn.conversation.start,
        )
        runner = self.ctx.runner
        self.running[runner.submit(generate_with_retry(runner, request))] = turn
        self.ctx.count_inflight(1)

    def run(self, first: list[Turn]) -> None:
        """Send the `first` turns, then until every conversation has ended or stopped at
        a dead-lettered turn."""
        # A lease a heartbeat found lost stops the turns at once; the wait below wakes.
        self.lease.on_lost(self._cancel_running)
        try:
            for turn in first:
                self.send(turn)
            while self.running:
                finished, _ = wait(self.running, DRAIN_CHECK_S, return_when=FIRST_COMPLETED)
                if self.lease.lost.is_set():
                    raise LeaseLost("another delivery holds the chunk")
                self._leave_if_stopping()
                for future in finished:
                    turn = self.running.pop(future)
                    self.ctx.count_inflight(-1)
                    self.finish(turn, future)
        except BaseException:
            # Leaving early: stop the turns still running; the chunk comes back unacked.
            # Each leaves the count, finished or not (one that ended meanwhile cannot be
            # cancelled, and nothing else would count it out).
            for future in self.running:
                future.cancel()
            self.ctx.count_inflight(-len(self.running))
            self.running.clear()
            raise

    def _leave_if_stopping(self) -> None:
        """A worker that drains (or a job paused with --now) gives the chunk back: its
        finished turns are checkpointed, and a redelivery goes on from its first open
        turn; the turns running now start again there (not moved: docs/design/placement.md,
        "Drain and pause"). Raises ChunkDeferred."""
        ctx = self.ctx
        if ctx.messages is None:
            return  # a bare context cannot give chunks back: the turns run on
        if ctx.draining.is_set() or ctx.pause(self.chunk.job) == job_pause.NOW:
            ctx.restarted.add(len(self.running))
            raise ChunkDeferred(f"{len(self.running)} running turns stop: the worker drains "
                                "or the job is paused")  # fmt: skip

    def _cancel_running(self) -> None:
        # From the heartbeat's thread: list() copies the keys in one step under the GIL.
        for future in list(self.running):
            future.cancel()

    def finish(self, turn: Turn, future: Future[GenerateResult]) -> None:
        """Hand the turn off and send the next one."""
        try:
            output = future.result()
        except PromptRejected as exc:
            self.fail(turn, Reason.REJECTED_BY_SERVER, exc.message, server=exc.server)
            return
        answer = self.chat.answer(
            turn.prompt.prompt_ids,
            output,
            turn.prompt.tools,
            self.sampling,
            record_id=turn.prompt.id,
        )
        result = generated_result(
            self.chunk,
            turn.prompt,
            output,
            worker=self.ctx.worker,
            attempt=self.attempt,
            sampling=self.sampling,
        )
        marks = [checkpoint(self.chunk, turn, answer)]
        # Settled already only by this same write, retried after its reply was lost (no
        # other delivery writes while this one holds the lease): its answer is this one.
        if hand_off(self.ctx, self.lease, self.chunk, [turn.result(result)], marks)[0]:
            self.generated += 1
        try:
            following = next_turn(turn, answer)
        except ToolCallDiverged as exc:
            self.fail(exc.turn, Reason.TOOL_CALL_DIVERGED, str(exc))
            return
        if following is not None:
            crashpoints.hit(CRASHPOINT)
            self.send(following)

    def fail(self, turn: Turn, reason: Reason, message: str, **payload: Any) -> None:
        def fill(pipe: redis.client.Pipeline) -> int:
            return dead_letter_turn(
                pipe,
                self.chunk,
                turn,
                worker=self.ctx.worker,
                reason=reason,
                message=message,
                attempts=self.attempt + 1,
                **payload,
            )

        self.dead_lettered += write_dead_letters(self.ctx, self.lease, fill, turn.prompt.id)


def run_conversations(
    ctx: ChunkContext,
    lease: ChunkLease,
    chunk: Chunk,
    prompts: list[ChunkPrompt],
    settled: set[str],
    spec: JobSpec,
    sampling: dict[str, Any],
) -> tuple[int, int]:
    """Run the open turns of the chunk's conversations (`sampling`: the job's, with the
    chunk's overrides); (turns generated, dead-lettered)."""
    conversations = _Conversations(ctx, lease, chunk, spec, sampling)
    first: list[Turn] = []
    for prompt in prompts:
        try:
            turn = resume(ctx.redis, chunk, prompt, settled)
        except ToolCallDiverged as exc:
            # A delivery that died between a turn's hand-off and the dead letter of the
            # turn after it, which its answer does not fit: that dead letter, now.
            conversations.fail(exc.turn, Reason.TOOL_CALL_DIVERGED, str(exc))
            continue
        if turn is not None:
            first.append(turn)
    conversations.run(first)
    return conversations.generated, conversations.dead_lettered
