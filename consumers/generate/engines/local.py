"""The Engine on transformers, in this process, on CPU or GPU: the demo's and the tests' engine.

Requests that arrive together are gathered into batches and run with `model.generate` in
one worker thread (torch is not asyncio friendly); each caller awaits its own future.
Results keep SGLang's contract (docs/design/sglang.md, SGLang contract):

- `prompt_ids` are used exactly as given; nothing is re-tokenized.
- `output_ids` include the stop token that ended generation, finish_reason is
  `{"type": "stop", "matched": id}`, and `text` is their decode without that token.
  Stop tokens: the tokenizer's and the model's eos ids plus `stop_token_ids`; none with
  `ignore_eos`. As in SGLang the length limit is checked first, so a stop token drawn as
  the `max_new_tokens`-th token reports `{"type": "length"}`.
- Unset temperature/top_p/top_k/min_p/repetition_penalty come from the model's
  generation_config, else SGLang's defaults; `max_new_tokens` defaults to 128.
- Sampling draws each row from its own generator, seeded with `seed` (SGLang calls it
  `sampling_seed`) or with a random seed reported in `meta["seed"]`. The same prompt,
  sampling and seed on the same device and dtype give the same ids whatever else shares
  the batch, unless batched-matmul rounding flips a near tie.
- SGLang parameters this engine cannot honour (stop strings, frequency/presence
  penalties, grammars, n > 1, ...) reject the prompt unless left at their neutral value.

Loading a GGUF de-quantizes it (~15 s for SmolLM2), so the de-quantized weights are
cached as safetensors under `$REGEN_HOME/cache/models`, kept only after a reload proved
them bit-identical. A model loads once per process: engines with the same settings share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    StoppingCriteriaList,
)

from regen.common import defaults, settings
from regen.common.tokenizer import resolve_model
from regen.consumers.generate.engine import (
    EngineDown,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    PromptRejected,
)
from regen.consumers.generate.engines.local_model import LoadedModel, shared_model
from regen.consumers.generate.engines.local_requests import RowPlan, plan_row
from regen.consumers.generate.engines.local_sampling import RowStop, logits_processors

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    loop: asyncio.AbstractEventLoop
    enqueued: float
    plan: RowPlan | None = None  # set when the worker thread admits the job
    started: bool = False

    @property
    def planned(self) -> RowPlan:
        assert self.plan is not None, "only admitted jobs are batched"
        return self.plan


class LocalEngine:
    """Generate with a transformers model in this process (see the module docstring).

    `model`: `smollm2`, a `.gguf` file or a Hugging Face model folder (local files only).
    `device`: "auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1", ...
    `dtype`: "auto" (float32 on cpu, bfloat16 on gpu), a torch dtype or its name.
    `threads`: torch's intra-op threads, process-wide; default torch's (physical cores).
    `cache_dir`: where de-quantized GGUF weights are kept, default `$REGEN_HOME/cache/models`;
    `cache=False` loads the GGUF every time. (The tokenizer is `common.tokenizer`'s.)
    """

    name = "local"

    def __init__(
        self,
        model: str,
        *,
        device: str = defaults.DEVICE,
        max_batch_size: int = defaults.LOCAL_BATCH_SIZE,
        dtype: str | torch.dtype = "auto",
        batch_wait_s: float = 0.01,
        trust_remote_code: bool = False,
        threads: int | None = None,
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_batch_size < 1 or batch_wait_s < 0:
            raise ValueError("max_batch_size must be >= 1 and batch_wait_s >= 0")
        self.model, self.max_batch_size, self.batch_wait_s = model, max_batch_size, batch_wait_s
        self.ref = resolve_model(model)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype == "auto":
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if threads:
            torch.set_num_threads(threads)
        weights_cache = (
            Path(cache_dir or settings.current().home / "cache" / "models") if cache else None
        )
        self._load_args = (self.ref, str(self.device), self.dtype, trust_remote_code, weights_cache)
        self._loaded: LoadedModel | None = None
        self._load_error: Exception | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._backlog: list[_Job] = []  # admitted, waiting for a batch; worker thread only
        self._closed = False
        self._close_lock = threading.Lock()
        self._abort = threading.Event()
        self._counters = {"batches": 0, "requests": 0, "rejected": 0, "tokens_generated": 0}
        self._busy_s = 0.0
        self._running = 0
        self._thread = threading.Thread(target=self._serve, name="regen-local-engine", daemon=True)
        self._thread.start()

    # --- the Engine interface (event-loop side) -----------------------------------------

    async def generate(
        self, request: GenerateRequest, *, outage_s: float | None = None
    ) -> GenerateResult:
        """`outage_s` bounds the wait while the model is not loaded (EngineDown); once
        it is, a prompt waits for a batch however long the engine stays busy, and
        generation that started is not cut short."""
        loop = asyncio.get_running_loop()
        job = _Job(request, loop.create_future(), loop, time.monotonic())
        # Under the lock, no job can land behind close()'s sentinel and wait forever.
        with self._close_lock:
            if self._closed:
                raise EngineDown("the local engine is closed")
            self._queue.put(job)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(job.future), outage_s)
                except asyncio.TimeoutError:
                    if self._loaded is None and not job.started:
                        raise EngineDown(
                            f"the local model was not loaded within {outage_s:.0f} s"
                        ) from None
        finally:
            job.future.cancel()  # a no-op once settled; otherwise the worker drops the job

    async def health(self) -> bool:
        return self._loaded is not None and not self._closed and self._thread.is_alive()

    async def hand_over(self, rid: str) -> bool:
        """A local model is one device of one worker: no faster server to hand an
        answer to."""
        return False

    def capacity(self) -> int:
        return 2 * self.max_batch_size  # the next batch is queued when one finishes

    def stats(self) -> dict[str, Any]:
        busy, tokens = self._busy_s, self._counters["tokens_generated"]
        return {
            "engine": self.name, "model": self.model, "device": str(self.device),
            "loaded": self._loaded is not None, "closed": self._closed,
            "error": None if self._load_error is None else str(self._load_error),
            "max_batch_size": self.max_batch_size,
            "queued": self._queue.qsize() + len(self._backlog), "running": self._running,
            **self._counters, "busy_s": round(busy, 3),
            "tokens_per_s": round(tokens / busy, 1) if busy else 0.0,
        }  # fmt: skip

    async def close(self) -> None:
        with self._close_lock:
            if not self._closed:
                self._closed = True
                self._abort.set()  # ends a running batch early; its callers get EngineUnavailable
                self._queue.put(None)
        await asyncio.to_thread(self._thread.join)

    # --- the worker thread: gather, batch, run --------------------------------------------

    def _serve(self) -> None:
        try:
            self._loaded = shared_model(*self._load_args)
        except Exception as exc:  # kept: every request is answered with it
            log.exception("loading %s failed", self.model)
            self._load_error = exc
        while self._gather():
            batch = self._take_batch()
            if not batch:  # every waiting caller gave up
                continue
            self._backlog = [job for job in self._backlog if job not in batch]
            try:
                self._run_batch(batch)
            except Exception as exc:  # e.g. out of memory: the engine's trouble, not the prompt's
                log.exception("local generation failed for a batch of %d", len(batch))
                for job in batch:
                    _settle(job, EngineUnavailable(f"local generation failed: {exc!r}"))
        for job in self._backlog:
            _settle(job, EngineUnavailable("the local engine is closed"))

    def _gather(self) -> bool:
        """Move queued jobs to the backlog: block for a first one, then let others join it
        for up to batch_wait_s. False once close() was called."""
        deadline = time.monotonic() if self._backlog else None
        while True:
            if deadline is None:
                timeout = None
            elif self._batch_full():
                timeout = 0.0
            else:
                timeout = max(0.0, deadline - time.monotonic())
            try:
                job = self._queue.get(timeout=timeout)
            except queue.Empty:
                return True
            if job is None:
                return False
            if self._admit(job):
                self._backlog.append(job)
                deadline = deadline or time.monotonic() + self.batch_wait_s

    def _batch_full(self) -> bool:
        key = self._backlog[0].planned.key
        return sum(job.planned.key == key for job in self._backlog) >= self.max_batch_size

    def _take_batch(self) -> list[_Job]:
        """The oldest job, plus younger ones with the same sampling that fit beside it."""
        assert self._loaded is not None
        self._backlog = [job for job in self._backlog if not job.future.cancelled()]
        ctx, batch, width, longest = self._loaded.context_len, [], 0, 0
        for job in self._backlog:
            w, n = max(width, len(job.request.prompt_ids)), max(longest, job.planned.max_new)
            # Every row runs (unused) until the longest is done: all must stay in context.
            if job.planned.key == self._backlog[0].planned.key and (ctx is None or w + n <= ctx):
                batch.append(job)
                width, longest = w, n
                if len(batch) == self.max_batch_size:
                    break
        return batch

    def _admit(self, job: _Job) -> bool:
        """Validate a job; settle it at once when it needs no model run."""
        if job.future.cancelled():
            return False
        if self._load_error is not None:
            _settle(job, EngineUnavailable(f"the local model failed to load: {self._load_error}"))
            return False
        assert self._loaded is not None
        try:
            job.plan = plan_row(job.request, self._loaded)
        except PromptRejected as exc:
            self._counters["rejected"] += 1
            _settle(job, exc)
            return False
        if job.planned.max_new == 0:  # SGLang answers an empty completion
            self._finish(job, [], batch_size=0)
            return False
        return True

    def _run_batch(self, jobs: list[_Job]) -> None:
        assert self._loaded is not None
        key, dev = jobs[0].planned.key, self.device
        prompts = [job.request.prompt_ids for job in jobs]
        width = max(map(len, prompts))
        # Left padding puts every row's last prompt token in the last column. Pad columns
        # are masked (positions come from the mask), so their ids only matter to the
        # repetition penalty: repeating the row's first token keeps them out of it.
        ids = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        plans = [job.planned for job in jobs]
        limits = torch.tensor([plan.max_new for plan in plans], device=dev)
        stop_ids = torch.tensor(key.stop_ids, dtype=torch.long, device=dev)
        started, self._running = time.monotonic(), len(jobs)
        for job in jobs:
            job.started = True
        try:
            with torch.inference_mode():
                out = self._loaded.model.generate(
                    input_ids=ids, attention_mask=mask,
                    generation_config=GenerationConfig(
                        max_new_tokens=max(plan.max_new for plan in plans), do_sample=False),
                    logits_processor=logits_processors(
                        key, [plan.seed or 0 for plan in plans], dev),
                    stopping_criteria=StoppingCriteriaList(
                        [RowStop(stop_ids, limits, width, self._abort)]),
                )  # fmt: skip
        finally:
            self._running = 0
            self._busy_s += time.monotonic() - started
        if self._abort.is_set():  # close() cut the batch short: these rows are unfinished
            raise EngineUnavailable("the local engine is closed")
        self._counters["batches"] += 1
        for job, row in zip(jobs, out[:, width:].tolist(), strict=True):
            self._finish(job, row, batch_size=len(jobs))

    def _finish(self, job: _Job, row: list[int], *, batch_size: int) -> None:
        assert self._loaded is not None
        plan = job.planned
        # A row that ended goes on (unused) while others in its batch still run: cut it at
        # its first stop token, where SGLang would have ended it.
        stops = set(plan.key.stop_ids)
        cut = next((i for i, t in enumerate(row[: plan.max_new - 1]) if t in stops), None)
        if cut is None:
            output, reason = row[: plan.max_new], {"type": "length", "length": plan.max_new}
        else:
            output, reason = row[: cut + 1], {"type": "stop", "matched": row[cut]}
        shown = output[:-1] if cut is not None and plan.trim_stop else output
        text = self._loaded.tokenizer.decode(shown, skip_special_tokens=plan.skip_special)
        meta = {"batch_size": batch_size} | ({} if plan.seed is None else {"seed": plan.seed})
        self._counters["requests"] += 1
        self._counters["tokens_generated"] += len(output)
        _settle(job, GenerateResult(
            output_ids=output, text=text, finish_reason=reason,
            prompt_tokens=len(job.request.prompt_ids), completion_tokens=len(output),
            cached_tokens=0,  # no prefix cache: every prompt token is computed
            latency_s=time.monotonic() - job.enqueued, server=f"local:{self.device}", meta=meta,
        ))  # fmt: skip


def _settle(job: _Job, outcome: GenerateResult | Exception) -> None:
    """Hand an outcome to the awaiting coroutine, on its own event loop."""

    def apply() -> None:
        if job.future.done():  # the caller gave up (cancelled)
            return
        if isinstance(outcome, Exception):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
        job.loop.call_soon_threadsafe(apply)
