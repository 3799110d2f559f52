"""What both stand-ins share: SGLang's request checks, its scheduler's slots, the answers
and the counters. The HTTP server (server.py) and the offline `sglang.Engine` stand-in
(offline_engine.py) put different surfaces on this one core, so for the same prompt they
give the same answer and fail the same way.

POST /abort_request (aborts.py) ends a request with the output decoded so far, which
its client keeps to continue elsewhere; that is accounted apart from a client that went
away (its work wasted). What a request aborted in the waiting queue gets back depends
on the SGLang version imitated (versions.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from typing import Any

from tests.support.sglang_standin.aborts import (
    ABORT_BEFORE_PREFILL,
    ABORT_IN_WAITING_QUEUE,
    ABORTED,
    Aborts,
    abort_reason,
    lands_on_last_step,
    last_step_end,
    sleep_unless,
    tokens_at_abort,
)
from tests.support.sglang_standin.batching import BatchEngine
from tests.support.sglang_standin.completer import Completer, Completion
from tests.support.sglang_standin.config import StandinConfig, parse_fault
from tests.support.sglang_standin.prefix_cache import PrefixCache
from tests.support.sglang_standin.slots import Slots
from tests.support.sglang_standin.validate import Item, RequestError
from tests.support.sglang_standin.versions import QueuedAbort

# A window for sglang:gen_throughput, which SGLang reports over its last log interval.
THROUGHPUT_WINDOW_S = 10.0
# The last requests served, with what their prefix-cache match was (GET /_served).
SERVED_KEPT = 10_000
# The last requests that held a slot, with when and how that ended (GET /_slot_log).
SLOT_LOG_KEPT = 100_000
ALWAYS_COUNTED = (
    "requests_total",
    "completed",
    "generation_tokens_total",
    "prompt_tokens_total",
    "cached_tokens_total",
    "connections_total",
    "aborted_total",
    "moved_total",  # aborted by request while running: the client keeps the output
    # Of those, the ones whose abort came on the answer's last step: the whole answer
    # (and, a step being several tokens, more) came back with finish "abort".
    "moved_at_end_total",
    "moved_waiting_total",  # aborted by request before it ran
    "repeated_total",
)


class Scheduler:
    def __init__(self, config: StandinConfig, completer: Completer) -> None:
        self.config = config
        self.release = config.release
        self.completer = completer
        self.slots = Slots(config.max_running_requests, config.max_queued_requests)
        # With the batch model on, it owns running and waiting requests instead of slots.
        self.batch = BatchEngine(config) if config.decode_step_s > 0 else None
        self.faults: deque[list[Any]] = deque(list(parse_fault(f)) for f in config.fault)
        # Per-status and per-fault counters appear on first use; these are always there.
        self.counters: Counter[str] = Counter(dict.fromkeys(ALWAYS_COUNTED, 0))
        self.active_rids: set[str] = set()
        self.aborts = Aborts()
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens)
        self.served: deque[dict[str, Any]] = deque(maxlen=SERVED_KEPT)
        # Slot accounting a bench reads back (slot model): each request's time on a slot
        # ({rid, prompt, start, end, outcome}: end None while it runs; outcome "completed",
        # "aborted" (the client gone), "moved" (POST /abort_request: the client keeps
        # the output) or "moved_at_end" (that abort came on the last step: the whole
        # answer came back, aborted); all but "aborted" add the output `tokens`, the
        # moved ones the whole tokens decoded when the abort came, `decoded_at_abort`),
        # and the busy time of work thrown away: answers aborted mid-way and answers to a
        # prompt already answered (a redo, "moved_at_end" being an answer too). A moved
        # answer's time is not thrown away.
        self.slot_log: deque[dict[str, Any]] = deque(maxlen=SLOT_LOG_KEPT)
        self.aborted_busy_s = 0.0
        self.repeated_busy_s = 0.0
        self._answered: set[int] = set()

    def take_fault(self) -> tuple[str, int, float] | None:
        """The next armed fault (kind, count left, delay_s), or None; counted as fault_KIND."""
        if not self.faults:
            return None
        fault = self.faults[0]
        fault[1] -= 1
        if fault[1] <= 0:
            self.faults.popleft()
        self.counters[f"fault_{fault[0]}"] += 1
        return fault[0], fault[1], fault[2]

    def admit(self, items: list[Item]) -> None:
        """SGLang's TokenizerManager checks (auto-truncate off), then the rids are taken
        until `finish(items)`. RequestError (a ValueError) is SGLang's ValueError."""
        ctx = self.config.context_length
        for item in items:
            n = len(item.input_ids)
            if n >= ctx:
                raise RequestError(
                    f"The input ({n} tokens) is longer than the model's context length "
                    f"({ctx} tokens)."
                )
            # Like SGLang, only an explicit max_new_tokens counts toward the total.
            max_new = item.sampling.get("max_new_tokens")
            if max_new is not None and n + max_new > ctx:
                raise RequestError(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{ctx} tokens. You requested a total of {n + max_new} tokens: {n} tokens "
                    f"from the input messages and {max_new} tokens for the completion. Please "
                    "reduce the number of tokens in the input messages or the completion to "
                    "fit within the limit."
                )
        rids = [item.rid for item in items]
        for i, rid in enumerate(rids):
            if rid in self.active_rids or rid in rids[:i]:
                raise RequestError(f"Duplicate request ID detected: {rid}")
        self.active_rids.update(rids)
        for rid in rids:
            self.aborts.watch(rid)

    def finish(self, items: list[Item]) -> None:
        self.active_rids.difference_update(item.rid for item in items)
        for item in items:
            self.aborts.forget(item.rid)

    def abort(self, rid: str | None, *, abort_all: bool = False) -> None:
        """POST /abort_request: the request (or all) returns what it has (aborts.py)."""
        self.aborts.abort(rid, abort_all=abort_all)

    @property
    def running(self) -> int:
        return len(self.batch.running) if self.batch else self.slots.running

    @property
    def queued(self) -> int:
        return len(self.batch.waiting) if self.batch else self.slots.queued

    async def run(self, item: Item, delay_s: float, started: float) -> dict[str, Any]:
        """Wait for a slot, "decode", and return SGLang's reply dict (QueueFull if the
        waiting queue is full); POST /abort_request cuts both waits short."""
        abort = self.aborts.event(item.rid)
        if self.batch is not None:
            return await self._run_batched(self.batch, item, delay_s, started, abort)
        if (abort is not None and abort.is_set()) or not await self.slots.acquire(abort):
            return await self._aborted_waiting(item, started)
        entry: dict[str, Any] = {
            "rid": item.rid,
            "prompt": hash(tuple(item.input_ids)),  # the same in every process: ints
            "start": time.time(),
            "end": None,
            "outcome": "running",
        }
        self.slot_log.append(entry)
        step = self.config.tokens_per_step
        try:
            cached = self._prefill(item)
            done = self.completer.complete(item.input_ids, item.sampling)
            if done.origin is not None:  # the rest of an answer begun elsewhere
                entry["prompt"], entry["resumed"] = done.origin, done.resumed
            planned, tps = len(done.output_ids), self.config.decode_tokens_per_s
            decode_s = planned / tps if tps > 0 else 0.0
            decode_start = time.monotonic()
            # A delay fault holds the slot after the decode: an abort then cuts nothing.
            aborted = delay_s + decode_s > 0 and await sleep_unless(abort, delay_s + decode_s)
            elapsed = time.monotonic() - decode_start
            k = tokens_at_abort(elapsed, tps, step, planned) if aborted else None
            if k is not None:  # what it had decoded when the abort came, for a test
                entry["decoded_at_abort"] = int(elapsed * tps)
            if k is not None and self._lands_on_last_step(item.rid):
                # The abort reaches the scheduler as the last step runs: decode up to it.
                await asyncio.sleep(max(0.0, decode_start + decode_s - time.monotonic()))
                k = last_step_end(planned, step)
        except asyncio.CancelledError:
            self._account(entry, "aborted")
            raise
        finally:
            self.slots.release()
        if k is None:
            entry["tokens"] = planned
            self._account(entry, "completed")
            return self._reply(item, done, started, cached)
        # Cut: the client continues it elsewhere, or, cut at its end, has it all.
        outcome = "moved" if k < planned else "moved_at_end"
        entry["tokens"] = k
        self._account(entry, outcome)
        cut = self.completer.cut(item.input_ids, item.sampling, done, k, dict(ABORTED),
                                 entry["prompt"])  # fmt: skip
        return self._reply(item, cut, started, cached, outcome=outcome)

    async def _run_batched(
        self,
        batch: BatchEngine,
        item: Item,
        delay_s: float,
        started: float,
        abort: asyncio.Event | None,
    ) -> dict[str, Any]:
        cached = self._prefill(item)
        done = self.completer.complete(item.input_ids, item.sampling)
        seq = await batch.run(len(item.input_ids), len(done.output_ids), abort,
                              last_step=self._lands_on_last_step(item.rid))  # fmt: skip
        if seq.aborted_in is None:
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            return self._reply(item, done, started, cached)
        origin = hash(tuple(item.input_ids)) if done.origin is None else done.origin
        if seq.aborted_in == "waiting":  # perhaps retracted, with output kept
            return await self._aborted_waiting(item, started, done, seq.generated, origin)
        k = seq.generated
        outcome = "moved" if k < len(done.output_ids) else "moved_at_end"
        cut = self.completer.cut(item.input_ids, item.sampling, done, k, dict(ABORTED), origin)
        return self._reply(item, cut, started, cached, outcome=outcome)

    async def _aborted_waiting(
        self,
        item: Item,
        started: float,
        done: Completion | None = None,
        k: int = 0,
        origin: int = 0,
    ) -> dict[str, Any]:
        """The reply to a request aborted in the waiting queue, as the imitated version
        gives it; `done` and `k`: a retracted request's planned answer and the tokens it
        had decoded (kept from 0.5.5 on, lost before)."""
        shape = self.release.queued_abort
        # Counted as moved when the client gets tokens to continue, else as never run.
        kept_any = done is not None and k > 0 and shape is QueuedAbort.SO_FAR
        self.counters["moved_total" if kept_any else "moved_waiting_total"] += 1
        if shape is QueuedAbort.HANG:
            # 0.4.6 drops the request's state: /generate waits until its client leaves.
            never: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            return await never
        if shape is QueuedAbort.BEFORE_PREFILL:
            nothing = {"id": item.rid, "finish_reason": abort_reason(ABORT_BEFORE_PREFILL),
                       "prompt_tokens": 0, "completion_tokens": 0}  # fmt: skip
            return {"text": "", "meta_info": nothing}
        finish = abort_reason(ABORT_IN_WAITING_QUEUE)
        kept = Completion([], finish, "")
        if kept_any and done is not None:
            kept = self.completer.cut(item.input_ids, item.sampling, done, k, finish, origin)
            self.counters["generation_tokens_total"] += k
        meta: dict[str, Any] = {"id": item.rid, "finish_reason": finish}
        if self.release.abort_meta_extras:
            meta.update(weight_version="default", e2e_latency=time.monotonic() - started)
        meta["completion_tokens"] = len(kept.output_ids)
        text = "" if self.config.skip_tokenizer_init else kept.text
        return {"text": text, "output_ids": kept.output_ids, "meta_info": meta}

    def _lands_on_last_step(self, rid: str) -> bool:
        return lands_on_last_step(self.config.abort_on_last_step, self.config.seed, rid)

    def _account(self, entry: dict[str, Any], outcome: str) -> None:
        """Close a request's slot-log entry; count what its slot time was wasted on."""
        entry["end"] = time.time()
        entry["outcome"] = outcome
        busy = entry["end"] - entry["start"]
        if outcome == "aborted":
            self.counters["aborted_total"] += 1
            self.aborted_busy_s += busy
        if outcome not in ("completed", "moved_at_end"):  # only those are whole answers
            return
        key = entry["prompt"]
        if key in self._answered:
            self.counters["repeated_total"] += 1
            self.repeated_busy_s += busy
        self._answered.add(key)

    def _prefill(self, item: Item) -> int:
        """Prefill: what the cache already holds (the reply's cached_tokens), then the
        prompt is cached too."""
        cached = self.prefix_cache.match(item.input_ids)
        self.prefix_cache.insert(item.input_ids)
        return cached

    def _reply(
        self,
        item: Item,
        done: Completion,
        started: float,
        cached: int,
        *,
        outcome: str = "completed",
    ) -> dict[str, Any]:
        """SGLang's reply to a request that ran; `outcome` "moved" or "moved_at_end" for
        one POST /abort_request ended."""
        n_out = len(done.output_ids)
        # A finished (or aborted) request leaves its prompt and output in the cache; the
        # last output token was never fed back, so it has no KV to keep.
        self.prefix_cache.insert(item.input_ids + done.output_ids[:-1])
        self.counters["cached_tokens_total"] += cached
        if outcome == "completed":
            self.served.append(
                {"rid": item.rid, "prompt_tokens": len(item.input_ids), "cached_tokens": cached}
            )
            self.counters["completed"] += 1
        else:
            self.counters["moved_total"] += 1
            if outcome == "moved_at_end":
                self.counters["moved_at_end_total"] += 1
        self.counters["generation_tokens_total"] += n_out
        self.counters["prompt_tokens_total"] += len(item.input_ids)
        self._recent_tokens.append((time.monotonic(), n_out))
        meta = {
            "id": item.rid,
            "finish_reason": done.finish_reason,
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": n_out,
            "cached_tokens": cached,
            "e2e_latency": time.monotonic() - started,
        }
        if self.config.skip_tokenizer_init:  # SGLang then detokenizes nothing
            return {"output_ids": done.output_ids, "meta_info": meta}
        if not self.release.output_ids:  # 0.4.x: the detokenized text alone
            return {"text": done.text, "meta_info": meta}
        return {"text": done.text, "output_ids": done.output_ids, "meta_info": meta}

    def throughput(self) -> float:
        horizon = time.monotonic() - THROUGHPUT_WINDOW_S
        while self._recent_tokens and self._recent_tokens[0][0] < horizon:
            self._recent_tokens.popleft()
        return sum(n for _, n in self._recent_tokens) / THROUGHPUT_WINDOW_S
