"""A continuous-batching model of SGLang's scheduler, so the stand-in's speed depends on
the batch as a real server's does (on when `decode_step_s` > 0).

Each loop turn is one forward pass: admit waiting requests while running slots and the
KV budget allow, make room for one more token per running request by retracting the
requests with the fewest output tokens (SGLang's `retract_decode` order), then "decode"
one token for each running request. A pass sleeps

    decode_step_s + decode_step_per_req_s x running + prefill_s_per_token x prefilled

so tokens/s grows with the batch (the compute-bound regime) until the slots or the KV
budget stop it. Admission is optimistic (like SGLang with its new-token ratio at the
floor): it fills the budget to the brim, and the next pass retracts what no longer fits.
A retracted request keeps its output ids but loses its KV: it waits again and is
prefilled anew (prompt + output so far), which is the cost of over-filling a server.
Sleeping, not computing, keeps the stand-in cheap on a shared CPU.

A pass decodes `tokens_per_step` tokens per running request (speculative decoding's
accepted tokens; 1 without it), the last pass of an answer only what it still needs.

POST /abort_request (aborts.py) takes a waiting sequence out of the queue at once; a
running one, as SGLang's `to_finish`, still runs the pass in flight and leaves with that
pass's tokens too (all of them, even past its end), or, when the abort is to land on its
last step, runs on to that step. A cancelled sequence (its client gone) leaves at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from tests.support.sglang_standin.aborts import wait_unless
from tests.support.sglang_standin.config import StandinConfig
from tests.support.sglang_standin.slots import QueueFull

# SGLang logs decode stats (and sets sglang:gen_throughput) every 40 decode passes.
DECODE_LOG_INTERVAL = 40
# Share of the KV budget admission leaves free just after a retraction, and the passes
# over which that reserve decays to nothing (SGLang: new_token_ratio and its decay).
RETRACT_RESERVE = 0.3
RESERVE_DECAY_PASSES = 400


@dataclass(eq=False)
class Sequence:
    prompt_len: int
    target: int  # output tokens it produces before finishing
    done: asyncio.Future[None]
    generated: int = 0
    # Where POST /abort_request found it: "running" or "waiting" (None: not aborted).
    aborted_in: str | None = None
    # Aborted while running: the pass it finishes in, the "next" or its "last".
    abort_on: Literal["next", "last"] | None = None

    @property
    def tokens(self) -> int:
        """KV slots it holds while running."""
        return self.prompt_len + self.generated


@dataclass
class BatchStats:
    retracted_total: int = 0
    retracted_last: int = 0  # retracted in the last pass that retracted any, since the log
    # SGLang's gauge sglang:num_retracted_reqs: retracted_last as of the last stats log
    # (every DECODE_LOG_INTERVAL passes), which then zeroes retracted_last.
    retracted_logged: int = 0
    retracted_input_tokens_total: int = 0
    retracted_output_tokens_total: int = 0
    decode_passes: int = 0
    decoded_total: int = 0  # tokens decoded (a retracted request keeps its own)
    gen_throughput: float = 0.0
    peak_running: int = 0
    aborted_total: int = 0  # cancelled (the client went away) before finishing
    busy_seq_s: float = 0.0
    window_tokens: int = 0
    window_start: float = field(default_factory=time.monotonic)


class BatchEngine:
    def __init__(self, config: StandinConfig) -> None:
        self.config = config
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.used_tokens = 0
        self.reserve = 0.0  # share of the budget admission leaves free
        self.stats = BatchStats()
        self._loop: asyncio.Task[None] | None = None

    def token_usage(self) -> float:
        budget = self.config.kv_budget_tokens
        return self.used_tokens / budget if budget else 0.0

    async def run(
        self,
        prompt_len: int,
        target: int,
        abort: asyncio.Event | None = None,
        *,
        last_step: bool = False,
    ) -> Sequence:
        """Wait until a request of `prompt_len` tokens has decoded `target` tokens, or
        until `abort` is set (then `aborted_in` says where it was, `generated` how far
        it got, after the pass in flight or, with `last_step`, its last pass; it is not
        counted in aborted_total: its client keeps that output)."""
        max_queued = self.config.max_queued_requests
        if max_queued is not None and len(self.waiting) + 1 > max_queued:
            raise QueueFull("The request queue is full.")
        seq = Sequence(prompt_len, max(target, 1), asyncio.get_running_loop().create_future())
        self.waiting.append(seq)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._run_passes())
        try:
            if await wait_unless(abort, seq.done) and not seq.done.done():
                if seq in self.running:
                    seq.abort_on = "last" if last_step else "next"
                    await seq.done  # _decode ends it
                    seq.aborted_in = "running"
                else:
                    seq.aborted_in = "waiting"
        except asyncio.CancelledError:
            self.stats.aborted_total += 1
            raise
        finally:  # a cancelled request (client gone) leaves the batch, as an abort does
            if seq in self.running:
                self._drop(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
        return seq

    async def _run_passes(self) -> None:
        while self.running or self.waiting:
            prefilled = self._admit()
            self._make_room()
            c = self.config
            n = len(self.running)
            seconds = (
                c.decode_step_s + c.decode_step_per_req_s * n + c.prefill_s_per_token * prefilled
            )
            started = time.monotonic()
            await asyncio.sleep(seconds)
            self._decode(time.monotonic(), time.monotonic() - started)

    def _admit(self) -> int:
        """Move waiting requests into the batch while they fit; the tokens prefilled."""
        budget = self.config.kv_budget_tokens
        prefilled = 0
        while self.waiting and len(self.running) < self.config.max_running_requests:
            seq = self.waiting[0]
            free = budget * (1 - self.reserve) - self.used_tokens if budget else 0
            if budget and self.running and seq.tokens > free:
                break
            self.waiting.popleft()
            self.running.append(seq)
            self.used_tokens += seq.tokens
            prefilled += seq.tokens
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return prefilled

    def _make_room(self) -> None:
        """Retract until every running request has KV slots for its next step's tokens."""
        budget = self.config.kv_budget_tokens
        if not budget:
            return
        retracted = 0
        step = self.config.tokens_per_step
        while len(self.running) > 1 and self.used_tokens + step * len(self.running) > budget:
            victim = min(self.running, key=lambda s: (s.generated, -s.prompt_len))
            self._drop(victim)
            self.waiting.appendleft(victim)
            retracted += 1
            self.stats.retracted_input_tokens_total += victim.prompt_len
            self.stats.retracted_output_tokens_total += victim.generated
        if retracted:
            self.reserve = RETRACT_RESERVE
            self.stats.retracted_total += retracted
            self.stats.retracted_last = retracted

    def _drop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.used_tokens -= seq.tokens

    def _decode(self, now: float, seconds: float) -> None:
        stats = self.stats
        stats.busy_seq_s += len(self.running) * seconds
        step = self.config.tokens_per_step
        finished = []
        decoded = 0
        for seq in self.running:
            last = seq.generated + step >= seq.target
            if seq.abort_on == "next" or (seq.abort_on == "last" and last):
                # SGLang checks to_finish before the length and EOS: the whole step stays.
                n = step
            else:
                n = min(step, seq.target - seq.generated)
            seq.generated += n
            decoded += n
            if last or seq.abort_on == "next":
                finished.append(seq)
        self.used_tokens += decoded
        self.reserve = max(0.0, self.reserve - RETRACT_RESERVE / RESERVE_DECAY_PASSES)
        stats.window_tokens += decoded
        stats.decoded_total += decoded
        stats.decode_passes += 1
        if stats.decode_passes % DECODE_LOG_INTERVAL == 0:
            stats.gen_throughput = stats.window_tokens / max(now - stats.window_start, 1e-9)
            stats.window_tokens, stats.window_start = 0, now
            stats.retracted_logged, stats.retracted_last = stats.retracted_last, 0
        for seq in finished:
            self._drop(seq)
            if not seq.done.done():
                seq.done.set_result(None)
