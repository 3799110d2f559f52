"""The prompts of one delivery, started as its worker's slots allow, the rest held back
and given to the queue when another worker can start them sooner (docs/design.md,
"Only what can start soon").

A delivery starts what its engine's free slots take (`ChunkContext.reserve`), and the
rest as slots free. The prompts it holds unstarted were never sent to an engine, so
they can leave at no cost: as many as the other generate workers on the queue have idle
slots (peers.py) go back to the queue in new chunks (chunk_life.give_back_unstarted),
and those beyond the worker's own slack also for a peer's missing slack. With no peer
short of prompts (one server, or a busy fleet) nothing moves. At a job's end, a worker
that leaves the job's last prompts to faster servers (stand_down.py) starts none of them
and gives back all it holds; and as faster peers fall idle, it hands its running answers
over to them, each with its answer so far, which they continue (docs/design.md, "A slow
server's last answers move"; resume.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any

from regen.common import crashpoints
from regen.common.chunk import Chunk, ChunkPrompt
from regen.consumers.generate.chunk_life import (
    ChunkLease,
    generate_with_retry,
    give_back_unstarted,
)
from regen.consumers.generate.context import ChunkContext
from regen.consumers.generate.engine import GenerateRequest, GenerateResult
from regen.consumers.generate.engine_loop import Batch
from regen.consumers.generate.flow_control import slack
from regen.consumers.generate.resume import continued_sampling, resumed
from regen.consumers.generate.stand_down import FASTER

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
# Crash point (common/crashpoints.py): answers handed over, their answers so far only in
# this worker's memory.
BEFORE_SEND_ON = "generate.before_send_on"


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
        sampling: dict[str, Any],
    ) -> None:
        self._ctx = ctx
        self._lease = lease
        self._chunk = chunk
        self._sampling = sampling
        self._queue = ctx.spec(chunk.job).queue
        self.started: list[ChunkPrompt] = []
        self.running = 0
        self.waiting = list(todo)
        ctx.count_waiting(len(todo))
        # The running prompts' outcome indices (indices are given in start order), and
        # those asked to hand their answer over.
        self._running_indices: set[int] = set()
        self._handing_over: set[int] = set()

    def start_first(self) -> Batch[GenerateResult]:
        """Start what the worker has free slots for, at least one prompt, unless the
        worker leaves the job's last prompts to faster servers (then none)."""
        count = 0 if self._leaving() else self._ctx.reserve(len(self.waiting))
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
        rest back as other workers have idle slots; all of them when the worker leaves
        the job's last prompts to faster servers, and then hands running answers over to
        faster peers' idle slots. Raises LeaseLost (nothing given back)."""
        if self._leaving():
            if self.waiting:
                self._send_back(len(self.waiting), "faster servers finish the job's last prompts")
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
        if len(self._running_indices) > len(self._handing_over) and self._ctx.messages is not None:
            # The worker may leave the job's end while these run (minutes at real
            # lengths): a look a second, which costs nothing until it leaves.
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
        if messages is None:  # never asked for by a bare context (_leaving): not dropped
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
            "chunk %s: handed %d running answers (%d tokens so far) over to faster servers "
            "in %d chunks: %s",
            self._chunk.chunk_id,
            len(prompts),
            tokens,
            chunks,
            ",".join(p.id for p in prompts),
        )

    def _leaving(self) -> bool:
        """The worker leaves the job's last prompts to faster servers, and can give
        prompts back (a worker always can; a bare context cannot, and starts them)."""
        return self._ctx.messages is not None and self._ctx.leaving(self._queue)

    def _take(self, count: int) -> list[ChunkPrompt]:
        prompts, self.waiting = self.waiting[:count], self.waiting[count:]
        self._running_indices.update(range(len(self.started), len(self.started) + count))
        self.started += prompts
        self.running += count
        return prompts

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
        return resumed(answer, resume) if resume else answer

    def _hand_over_running(self) -> None:
        """Ask the engine to hand over as many running answers, oldest first, as faster
        peers have idle slots: the oldest has decoded the most, and with long-tailed
        lengths has the most left to decode. Each comes back as an outcome marked
        handed over (send_on). Not with stop strings: one could straddle the cut, and
        the server continuing the answer would not see it."""
        ctx = self._ctx
        candidates = sorted(self._running_indices - self._handing_over)
        my_tps = ctx.answers.decode_tps()
        if not candidates or ctx.peers is None or my_tps is None or self._sampling.get("stop"):
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
