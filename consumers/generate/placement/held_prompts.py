"""The prompts of one delivery, started as its worker's slots allow, the rest held back
and given to the queue when another worker can start them sooner (docs/design/placement.md,
"Only what can start soon").

A delivery starts what its engine's free slots take (`ChunkContext.reserve`), and the
rest as slots free. The prompts it holds unstarted were never sent to an engine, so
they can leave at no cost: as many as the other generate workers on the queue have idle
slots (peers.py) go back to the queue in new chunks (chunk_life.give_back_unstarted),
and those beyond the worker's own slack also for a peer's missing slack. With no peer
short of prompts (one server, or a busy fleet) nothing moves. At a job's end, a worker
that leaves the job's last prompts to faster servers (stand_down.py) starts none of them
and gives back all it holds; and as faster peers fall idle, it hands its running answers
over to them, each with its answer so far, which they continue (docs/design/placement.md, "A slow
server's last answers move"; resume.py). When the worker drains, or the job is paused, a
delivery starts nothing more and gives back what it holds; with the drain or `regen pause
--now`, every running answer moves back to the queue too (docs/design/placement.md, "Drain and
pause").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any

from regen.common import crashpoints, job_pause, provenance
from regen.common.answer_ends import request_end_ids
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.jobspec import JobSpec
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import (
    ChunkLease,
    generate_with_retry,
    give_back_unstarted,
)
from regen.consumers.generate.engine import GenerateRequest, GenerateResult
from regen.consumers.generate.engine_loop import Batch
from regen.consumers.generate.placement.flow_control import slack
from regen.consumers.generate.placement.resume import continued_sampling, settled, why_not_movable
from regen.consumers.generate.placement.stand_down import FASTER

log = logging.getLogger("regen.generate")

# While prompts wait, a delivery looks this often for free slots of its own (another
# delivery's prompt may have finished) or idle ones of a peer; it also looks each time
# one of its own prompts finishes. A fraction of a second against answers of minutes.
WAITING_CHECK_S = 0.2
# A worker that left a job's end looks this often whether a faster peer has idle slots
# for an answer still running here: a second against answers of minutes.
HAND_OVER_CHECK_S = 1.0
# The server queues an abort and answers at once; this only bounds a server gone wrong.
HAND_OVER_TIMEOUT_S = 15.0
# Why a worker that left a job's end to faster servers gives its prompts back.
LEFT_TO_FASTER = "faster servers finish the job's last prompts"
# Crash point (common/crashpoints.py): answers handed over, their answers so far only in
# this worker's memory.
BEFORE_SEND_ON = "generate.before_send_on"


_said: set[tuple[str, str]] = set()


def _say_once(job: str, message: str) -> None:
    """Log `message` once per job and process: a delivery asks each second."""
    if (job, message) not in _said:
        _said.add((job, message))
        log.info("%s", message)


async def _all(asks: list[Coroutine[Any, Any, bool]]) -> list[bool]:
    return list(await asyncio.gather(*asks))


class HeldPrompts:
    """One delivery's prompts: `started` (by outcome index), `running` of them not
    finished (each counted in the worker's in-flight), and `waiting` (not started,
    counted in the worker's waiting)."""

    def __init__(
        self,
        ctx: ChunkContext,
        lease: ChunkLease,
        chunk: Chunk,
        todo: list[ChunkPrompt],
        spec: JobSpec,
        sampling: dict[str, Any],
    ) -> None:
        self._ctx = ctx
        self._lease = lease
        self._chunk = chunk
        self._sampling = sampling
        self._queue = spec.queue
        # Where an answer ends (an abort on its last step is settled as ended, resume.py)
        # and whether its running answers may move to another server at all.
        self._ends = request_end_ids(spec.end_token_ids, sampling)
        self._budget = int(sampling["max_new_tokens"])
        self._stays = self._why_answers_stay(spec.end_token_ids)
        self.started: list[ChunkPrompt] = []
        self.running = 0
        self.waiting = list(todo)
        ctx.count_waiting(len(todo))
        # The running prompts' outcome indices (indices are given in start order), those
        # asked to hand their answer over, and those stopped to start again elsewhere
        # from scratch (a drain or pause where the answer cannot move).
        self._running_indices: set[int] = set()
        self._handing_over: set[int] = set()
        self._stopped: set[int] = set()

    def start_first(self) -> Batch[GenerateResult]:
        """Start what the worker has free slots for, at least one prompt, unless the
        worker starts none of the job's prompts now (_why_start_none)."""
        count = 0 if self._why_start_none() else self._ctx.reserve(len(self.waiting))
        prompts = self._take(count)
        if self.waiting:
            log.info("chunk %s: starts %d prompts, holds %d until slots free",
                     self._chunk.chunk_id, count, len(self.waiting))  # fmt: skip
        try:
            return self._ctx.runner.start_batch([self._request(p) for p in prompts])
        except BaseException:
            self.release()
            raise

    def start_or_give_back(self, batch: Batch[GenerateResult]) -> None:
        """Start waiting prompts the worker has free slots for now; give as many of the
        rest back as other workers have idle slots. All of them when the worker starts
        none of the job's prompts now: then its running answers move too, all of them
        when it drains or the job is paused with --now, else as many as faster peers
        have idle slots when it leaves the job's end to them. Raises LeaseLost (nothing
        given back)."""
        why = self._why_start_none()
        if why is not None:
            if self.waiting:
                self._send_back(len(self.waiting), why)
            if self._moves_everything():
                self._move_running(batch)
            elif why == LEFT_TO_FASTER:
                self._hand_over_running()
            return
        if not self.waiting:
            return
        # At least one when none runs: a delivery always makes progress.
        count = self._ctx.reserve(len(self.waiting), at_least=0 if self.running else 1)
        if count:
            first = len(self.started)
            batch.extend([self._request(p) for p in self._take(count)], first)
        if self.waiting:
            self._give_back()

    def finished(self, indices: list[int]) -> None:
        """The prompts of these outcome indices ended (answered, failed or handed over)."""
        for index in indices:
            self._running_indices.discard(index)
            self._handing_over.discard(index)
        count = len(indices)
        self.running -= count
        self._ctx.count_inflight(-count)
        if count and self._ctx.has_idle_slots():
            self._ctx.on_idle_slots()

    def release(self) -> None:
        """The delivery ends early: its prompts no longer count as the worker's."""
        self._ctx.count_inflight(-self.running)
        self._ctx.count_waiting(-len(self.waiting))
        self.running, self.waiting = 0, []

    def wake_after_s(self) -> float | None:
        """How long to wait for an outcome before looking again (None: until one)."""
        if self.waiting:
            return WAITING_CHECK_S
        unasked = self._running_indices - self._handing_over - self._stopped
        if unasked and self._ctx.messages is not None:
            # The worker may leave the job's end, drain, or the job be paused, while these
            # run (minutes at real lengths): a look a second, which costs nothing until.
            return HAND_OVER_CHECK_S
        return None

    def send_on(self, handed: list[tuple[ChunkPrompt, GenerateResult]]) -> None:
        """Give the answers handed over back to the queue, each prompt with its answer so
        far to continue (none decoded yet: a plain prompt again), in the lease-checked
        give-back of unstarted prompts: every prompt stays open in exactly one chunk.
        Raises LeaseLost."""
        if not handed:
            return
        messages = self._ctx.messages
        if messages is None:  # never asked for by a bare context (_why_start_none): not dropped
            raise RuntimeError("an answer was handed over where no chunk can carry it on")
        prompts = [
            dataclasses.replace(prompt, resume_ids=list(result.output_ids) or None)
            for prompt, result in handed
        ]
        crashpoints.hit(BEFORE_SEND_ON)
        chunks = give_back_unstarted(self._ctx.redis, messages, self._queue, self._lease,
                                     self._chunk, prompts)  # fmt: skip
        self._ctx.gave_back_at = time.monotonic()
        tokens = sum(len(p.resume_ids or ()) for p in prompts)
        self._ctx.handed_over.add(len(prompts))
        self._ctx.handed_over_tokens.add(tokens)
        # bench/long_generations.py reads the ids and the tokens moved off the logs.
        log.info(
            "chunk %s: handed %d running answers (%d tokens so far) %s in %d chunks: %s",
            self._chunk.chunk_id,
            len(prompts),
            tokens,
            "back to the queue" if self._moves_everything() else "over to faster servers",
            chunks,
            ",".join(p.id for p in prompts),
        )

    def stopped(self, index: int) -> bool:
        """Whether outcome `index` was stopped here to start again elsewhere (its
        CancelledError is then no failure: send_back_stopped gives it back)."""
        return index in self._stopped

    def send_back_stopped(self, prompts: list[ChunkPrompt]) -> None:
        """Give prompts whose answers were stopped back to the queue as they came (a
        continued one keeps the answer it came with): what this server decoded of them
        is thrown away. Raises LeaseLost."""
        if not prompts:
            return
        messages = self._ctx.messages
        if messages is None:  # never stopped by a bare context (_why_start_none)
            raise RuntimeError("an answer was stopped where no chunk can carry it on")
        chunks = give_back_unstarted(self._ctx.redis, messages, self._queue, self._lease,
                                     self._chunk, prompts)  # fmt: skip
        self._ctx.restarted.add(len(prompts))
        log.warning(
            "chunk %s: stopped %d running answers that could not move with their tokens so "
            "far (%s); they start again elsewhere, in %d chunks: %s",
            self._chunk.chunk_id,
            len(prompts),
            self._stays or "the server did not hand them over",
            chunks,
            ",".join(p.id for p in prompts),
        )

    def _why_start_none(self) -> str | None:
        """Why the delivery starts none of its prompts now and gives them back, or None.
        Only where it can give prompts back (a worker always can; a bare context
        cannot, and starts them)."""
        ctx = self._ctx
        if ctx.messages is None:
            return None
        if ctx.draining.is_set():
            return "the worker drains"
        if ctx.pause(self._chunk.job) is not None:
            return "the job is paused"
        return LEFT_TO_FASTER if ctx.leaving(self._queue) else None

    def _moves_everything(self) -> bool:
        """Whether every running answer leaves now: the worker drains, or the job is
        paused with --now."""
        ctx = self._ctx
        return ctx.draining.is_set() or ctx.pause(self._chunk.job) == job_pause.NOW

    def _move_running(self, batch: Batch[GenerateResult]) -> None:
        """Move every running answer back to the queue: with its tokens so far where the
        engine hands it over (send_on), else stopped and given back to start again
        (send_back_stopped). The aborts go out together: a drain has seconds."""
        ctx = self._ctx
        indices = sorted(self._running_indices - self._handing_over - self._stopped)
        if not indices:
            return
        handed: list[bool] = [False] * len(indices)
        if self._stays is None:
            asks = [ctx.runner.engine.hand_over(self._rid(self.started[i])) for i in indices]
            try:
                handed = ctx.runner.call(_all(asks), HAND_OVER_TIMEOUT_S)
            except TimeoutError:
                log.warning("chunk %s: no answer to handing answers over; stopping them",
                            self._chunk.chunk_id)  # fmt: skip
        for index, ok in zip(indices, handed, strict=True):
            if ok:
                self._handing_over.add(index)
            else:
                self._stopped.add(index)
                batch.cancel_one(index)

    def _take(self, count: int) -> list[ChunkPrompt]:
        prompts, self.waiting = self.waiting[:count], self.waiting[count:]
        self._running_indices.update(range(len(self.started), len(self.started) + count))
        self.started += prompts
        self.running += count
        return prompts

    def _why_answers_stay(self, end_token_ids: list[int]) -> str | None:
        """Why this delivery's running answers may not move to another server, or None
        (docs/design/placement.md, "What may move"): a continuation must draw what one server
        would have, and must know where an answer ends."""
        if not end_token_ids and not self._sampling.get("ignore_eos"):
            return ("its spec does not say which tokens end an answer (made by an older "
                    "regen: `regen enqueue` into the job again fills them in)")  # fmt: skip
        model = self._ctx.model_sampling(self._chunk.job)
        if model is None:
            return "it has no provenance, so the model's own sampling defaults are unknown"
        return why_not_movable(provenance.effective_sampling(self._sampling, model))

    def _rid(self, prompt: ChunkPrompt) -> str:
        return f"{self._chunk.chunk_id}-{prompt.id}-{self._lease.attempt}"

    def _request(self, prompt: ChunkPrompt) -> Coroutine[Any, Any, GenerateResult]:
        resume = prompt.resume_ids or []
        request = GenerateRequest(
            rid=self._rid(prompt),
            prompt_ids=[*prompt.prompt_ids, *resume] if resume else prompt.prompt_ids,
            sampling=continued_sampling(self._sampling, len(resume)),
        )
        answer = generate_with_retry(self._ctx.runner, request)
        return settled(answer, resume, self._ends, self._budget)

    def _hand_over_running(self) -> None:
        """Ask the engine to hand over as many running answers, oldest first, as faster
        peers have idle slots: the oldest has decoded the most, and with long-tailed
        lengths has the most left to decode. Each comes back as an outcome marked
        handed over (send_on). None where answers may not move (_why_answers_stay):
        they run to their end here."""
        ctx = self._ctx
        candidates = sorted(self._running_indices - self._handing_over)
        my_tps = ctx.answers.decode_tps()
        if not candidates or ctx.peers is None or my_tps is None:
            return
        if self._stays is not None:
            _say_once(self._chunk.job, f"job {self._chunk.job}: running answers are not handed "
                      f"over to faster servers: {self._stays}")  # fmt: skip
            return
        count = ctx.peers.claim(self._queue, len(candidates), faster_than=my_tps * FASTER)
        for index in candidates[:count]:  # started in index order: the oldest first
            rid = self._rid(self.started[index])
            try:
                handed = ctx.runner.call(ctx.runner.engine.hand_over(rid), HAND_OVER_TIMEOUT_S)
            except TimeoutError:
                log.warning("no answer to handing %s over; it runs on here", rid)
                handed = False
            if handed:
                self._handing_over.add(index)

    def _give_back(self) -> None:
        """Give back as many of the last waiting prompts as other workers have idle
        slots (claimed for them; the first waiting prompts start here as slots free)."""
        ctx = self._ctx
        if ctx.peers is None:
            return
        # Every waiting prompt may go to a peer's idle slots; to a peer's slack only
        # those beyond this worker's own slack (peers.py: slack never comes back).
        engine_slack = slack(ctx.runner.engine.capacity(), ctx.prompts.rate())
        beyond_slack = min(len(self.waiting), ctx.waiting - engine_slack)
        count = ctx.peers.claim(self._queue, len(self.waiting), beyond_slack)
        if count > 0:
            self._send_back(count, "other workers have room")

    def _send_back(self, count: int, why: str) -> None:
        """Give the last `count` waiting prompts back to the queue in new chunks."""
        ctx = self._ctx
        if ctx.messages is None:
            return  # a bare context (no Celery app to render chunks): they stay
        keep, prompts = self.waiting[:-count], self.waiting[-count:]
        chunks = give_back_unstarted(ctx.redis, ctx.messages, self._queue, self._lease,
                                     self._chunk, prompts)  # fmt: skip
        self.waiting = keep
        ctx.count_waiting(-count)
        ctx.gave_back_at = time.monotonic()
        # The ids let bench/long_generations.py count those the giver ran after all.
        log.info(
            "chunk %s: gave %d prompts it had not started back to the queue in %d chunks (%s): %s",
            self._chunk.chunk_id,
            count,
            chunks,
            why,
            ",".join(p.id for p in prompts),
        )
