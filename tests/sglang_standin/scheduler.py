"""What both stand-ins share: SGLang's request checks, its scheduler's slots, the answers
and the counters. The HTTP server (server.py) and the offline `sglang.Engine` stand-in
(offline_engine.py) put different surfaces on this one core, so for the same prompt they
give the same answer and fail the same way.

POST /abort_request (aborts.py) ends a request with the output decoded so far, which
its client keeps to continue elsewhere; that is accounted apart from a client that went
away (its work wasted).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from typing import Any

from tests.sglang_standin.aborts import (
    ABORT_BY_REQUEST,
    ABORT_IN_WAITING_QUEUE,
    Aborts,
    abort_reason,
    sleep_unless,
    tokens_done,
)
from tests.sglang_standin.batching import BatchEngine
from tests.sglang_standin.completer import Completer, Completion
from tests.sglang_standin.config import StandinConfig, parse_fault
from tests.sglang_standin.prefix_cache import PrefixCache
from tests.sglang_standin.slots import Slots
from tests.sglang_standin.validate import Item, RequestError

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
    "moved_waiting_total",  # aborted by request before it ran
    "repeated_total",
)


class Scheduler:
    def __init__(self, config: StandinConfig, completer: Completer) -> None:
        self.config = config
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
        # "aborted" (the client gone) or "moved" (POST /abort_request: the client keeps
        # the output); a completed or moved one adds its output `tokens`), and the busy
        # time of work thrown away: answers aborted mid-way and answers to a prompt
        # already answered (a redo). A moved answer's time is not thrown away.
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
            waited = Completion([], abort_reason(ABORT_IN_WAITING_QUEUE), "")
            return self._reply(item, waited, started, 0, outcome="waiting")
        entry = {
            "rid": item.rid,
            "prompt": hash(tuple(item.input_ids)),  # the same in every process: ints
            "start": time.time(),
            "end": None,
            "outcome": "running",
        }
        self.slot_log.append(entry)
        try:
            cached = self._prefill(item)
            done = self.completer.complete(item.input_ids, item.sampling)
            if done.origin is not None:  # the rest of an answer begun elsewhere
                entry["prompt"], entry["resumed"] = done.origin, done.resumed
            planned, tps = len(done.output_ids), self.config.decode_tokens_per_s
            seconds = delay_s + (planned / tps if tps > 0 else 0.0)
            decode_start = time.monotonic()
            aborted = seconds > 0 and await sleep_unless(abort, seconds)
        except asyncio.CancelledError:
            self._account(entry, "aborted")
            raise
        finally:
            self.slots.release()
        k = tokens_done(time.monotonic() - decode_start, tps, planned) if aborted else planned
        entry["tokens"] = k
        if k < planned:  # cut: the client continues it elsewhere
            self._account(entry, "moved")
            cut = self.completer.cut(item.input_ids, item.sampling, done, k,
                                     abort_reason(ABORT_BY_REQUEST), entry["prompt"])  # fmt: skip
            return self._reply(item, cut, started, cached, outcome="moved")
        self._account(entry, "completed")
        return self._reply(item, done, started, cached)

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
        seq = await batch.run(len(item.input_ids), len(done.output_ids), abort)
        if seq.aborted_in is not None:
            # SGLang keeps a retracted request's output when it aborts it in the queue.
            running = seq.aborted_in == "running"
            message = ABORT_BY_REQUEST if running else ABORT_IN_WAITING_QUEUE
            k = min(seq.generated, len(done.output_ids))
            origin = hash(tuple(item.input_ids)) if done.origin is None else done.origin
            cut = self.completer.cut(
                item.input_ids, item.sampling, done, k, abort_reason(message), origin
            )
            return self._reply(
                item, cut, started, cached, outcome="moved" if running or k else "waiting"
            )
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        return self._reply(item, done, started, cached)

    def _account(self, entry: dict[str, Any], outcome: str) -> None:
        """Close a request's slot-log entry; count what its slot time was wasted on."""
        entry["end"] = time.time()
        entry["outcome"] = outcome
        busy = entry["end"] - entry["start"]
        if outcome == "aborted":
            self.counters["aborted_total"] += 1
            self.aborted_busy_s += busy
        if outcome != "completed":
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
        """SGLang's reply; `outcome` "moved" or "waiting" for POST /abort_request."""
        n_out = len(done.output_ids)
        # A finished (or aborted) request leaves its prompt and output in the cache; the
        # last output token was never fed back, so it has no KV to keep.
        if outcome != "waiting":
            self.prefix_cache.insert(item.input_ids + done.output_ids[:-1])
        self.counters["cached_tokens_total"] += cached
        if outcome == "completed":
            self.served.append(
                {"rid": item.rid, "prompt_tokens": len(item.input_ids), "cached_tokens": cached}
            )
            self.counters["completed"] += 1
        else:
            self.counters["moved_total" if outcome == "moved" else "moved_waiting_total"] += 1
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
        return {"text": done.text, "output_ids": done.output_ids, "meta_info": meta}

    def throughput(self) -> float:
        horizon = time.monotonic() - THROUGHPUT_WINDOW_S
        while self._recent_tokens and self._recent_tokens[0][0] < horizon:
            self._recent_tokens.popleft()
        return sum(n for _, n in self._recent_tokens) / THROUGHPUT_WINDOW_S
