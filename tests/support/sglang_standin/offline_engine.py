"""A stand-in for `sglang.Engine`, SGLang's offline (in-process) engine, on CPU.

`tests/support/sglang_standin/offline/` holds a package named `sglang` that exports this class:
with that folder on PYTHONPATH, `regen worker generate --engine sglang-engine` builds
this instead of the real engine, which needs CUDA. It keeps the part of the contract
regen uses, as read in sglang 0.5.23 (`srt/entrypoints/engine.py`,
`srt/managers/tokenizer_manager.py`):

- `Engine(**kwargs)`: the keywords are ServerArgs fields; an unknown one is a TypeError.
- `await engine.async_generate(input_ids=..., sampling_params=..., rid=...)` returns the
  same reply dict as `POST /generate`.
- A bad request raises ValueError: too long for the context, invalid ids or sampling,
  "Duplicate request ID detected". A scheduler abort with another status raises
  fastapi's HTTPException (`status_code`, `detail`): 503 when the waiting queue is full.
- `engine.tokenizer_manager.abort_request(rid=...)` and `engine.shutdown()`.
- A crashed scheduler takes the whole process down (SGLang's SIGQUIT handler kills the
  process tree): here a prompt containing the `poison` marker SIGKILLs the process.

Answers and checks come from the HTTP stand-in's core (scheduler.py), so both give the
same output for the same prompt. The stand-in's own knobs come from $REGEN_SGLANG_STANDIN,
a JSON object of StandinConfig fields (`fault`, `output_len_dist`, `decode_tokens_per_s`,
...) plus `poison`; ServerArgs `context_length` and `max_running_requests` apply too.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from tests.support.sglang_standin.completer import (
    Completer,
    default_tokenizer_source,
    load_tokenizer,
)
from tests.support.sglang_standin.config import LengthDist, StandinConfig
from tests.support.sglang_standin.scheduler import Scheduler
from tests.support.sglang_standin.slots import QueueFull
from tests.support.sglang_standin.validate import RequestError, check_item

CONFIG_ENV = "REGEN_SGLANG_STANDIN"
# ServerArgs fields of sglang 0.5.23 that the stand-in accepts (a subset of several
# hundred); the ones that shape its behaviour are read below, the rest are ignored.
SERVER_ARGS = frozenset(
    {
        "model_path", "tokenizer_path", "tp_size", "dp_size", "trust_remote_code",
        "log_level", "context_length", "max_running_requests", "max_queued_requests",
        "mem_fraction_static", "random_seed", "skip_tokenizer_init", "dtype",
        "quantization", "chunked_prefill_size", "reasoning_parser", "enable_metrics",
        "disable_cuda_graph", "attention_backend", "load_format", "kv_cache_dtype",
        "revision", "allow_auto_truncate",
    }
)  # fmt: skip


class HTTPException(Exception):
    """fastapi.HTTPException's shape, which SGLang raises in-process for a non-400 abort."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


class TokenizerManager:
    """The one method regen calls on SGLang's tokenizer manager."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._scheduler.counters["aborted"] += 1
        note(f"abort {rid}")


class Engine:
    def __init__(self, **server_args: Any) -> None:
        unknown = sorted(set(server_args) - SERVER_ARGS)
        if unknown:
            raise TypeError(
                f"ServerArgs.__init__() got an unexpected keyword argument {unknown[0]!r}"
            )
        if "model_path" not in server_args:
            raise TypeError("ServerArgs.__init__() missing 1 required argument: 'model_path'")
        knobs = orjson.loads(os.environ.get(CONFIG_ENV) or "{}")
        self._poison: str | None = knobs.pop("poison", None)
        config = _config(knobs, server_args)
        model = Path(server_args["model_path"])
        # Any model name works: answers use SmolLM2's vocabulary unless given a real path.
        source = str(model) if model.exists() else default_tokenizer_source()
        tokenizer = load_tokenizer(source, trust_remote_code=config.trust_remote_code)
        self._tokenizer = tokenizer
        completer = Completer(
            tokenizer, config.output_len_dist, eos_id=config.eos_id, think=config.think,
            seed=config.seed, suffix=config.answer_suffix,
            length_from_prompt=config.answer_length_from_prompt,
        )  # fmt: skip
        self._scheduler = Scheduler(config, completer)
        self.tokenizer_manager = TokenizerManager(self._scheduler)
        self.server_args = dict(server_args)
        self._shut_down = False
        note(f"engine up: {sorted(server_args)}")

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        return_logprob: bool = False,
        stream: bool = False,
        rid: str | None = None,
    ) -> dict[str, Any]:
        if self._shut_down:
            raise RuntimeError("the engine was shut down")
        if prompt is not None or stream:
            raise ValueError("the stand-in takes input_ids, not text, and does not stream")
        scheduler = self._scheduler
        scheduler.counters["requests_total"] += 1
        item = check_item(input_ids, sampling_params, rid, scheduler.completer.vocab_size)
        if self._poison and self._poison in self._tokenizer.decode(item.input_ids):
            note("poison prompt: the scheduler crashed, the process dies")
            os.kill(os.getpid(), signal.SIGKILL)
        delay_s = 0.0
        fault = scheduler.take_fault()
        if fault is not None:
            kind, _, delay_s = fault
            note(f"fault {kind}")
            if kind == "500":
                raise HTTPException(500, "Internal Server Error")
            if kind == "503":
                raise HTTPException(503, "Injected fault: service unavailable.")
            if kind == "malformed":
                return {"text": "", "meta_info": {"id": item.rid}}
        scheduler.admit([item])  # RequestError is a ValueError, as SGLang's
        try:
            return await scheduler.run(item, delay_s, time.monotonic())
        except QueueFull as exc:
            raise HTTPException(503, str(exc)) from None
        finally:
            scheduler.finish([item])

    def shutdown(self) -> None:
        self._shut_down = True
        note(f"shutdown: {dict(self._scheduler.counters)}")


def _config(knobs: dict[str, Any], server_args: dict[str, Any]) -> StandinConfig:
    names = {f.name for f in dataclasses.fields(StandinConfig)}
    unknown = sorted(set(knobs) - names)
    if unknown:
        raise ValueError(f"${CONFIG_ENV}: unknown stand-in options {unknown}")
    if isinstance(knobs.get("output_len_dist"), str):
        knobs["output_len_dist"] = LengthDist.parse(knobs["output_len_dist"])
    knobs["fault"] = tuple(knobs.get("fault", ()))
    for name in ("context_length", "max_running_requests", "max_queued_requests"):
        if server_args.get(name) is not None:
            knobs[name] = server_args[name]
    knobs["trust_remote_code"] = bool(server_args.get("trust_remote_code"))
    if server_args.get("skip_tokenizer_init"):  # SGLang's own flag, as the engine takes it
        knobs["skip_tokenizer_init"] = True
    return StandinConfig(**knobs)


def note(message: str) -> None:
    """One line in the worker's log, for tests to see what the stand-in did."""
    print(f"sglang-standin: {message}", file=sys.stderr, flush=True)


__all__ = ["Engine", "HTTPException", "RequestError"]
