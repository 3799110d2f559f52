"""`--engine sglang-engine` against the offline `sglang.Engine` stand-in.

The stand-in (tests/support/sglang_standin/offline_engine.py) keeps SGLang 0.5's in-process
contract: the reply dict of /generate, ValueError for a bad request, HTTPException for
other aborts. These tests check how the engine maps each of them; a real SGLang run
needs a GPU (scripts/gpu_check_sglang_engine.sh).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.engine import EngineUnavailable, GenerateRequest, PromptRejected
from regen.consumers.generate.engine_loop import EngineRunner
from regen.consumers.generate.engines import EngineOptions, make_engine
from regen.consumers.generate.engines.sglang_inprocess import SGLangInProcessEngine
from regen.consumers.generate.metrics import GenerateCollector
from regen.ops.status_view import _servers
from tests.support.sglang_standin.completer import Completer, load_tokenizer
from tests.support.sglang_standin.config import LengthDist
from tests.support.sglang_standin.offline_engine import CONFIG_ENV
from tests.support.sglang_standin.process import REPO_ROOT

OFFLINE = str(REPO_ROOT / "tests" / "support" / "sglang_standin" / "offline")
SHORT = "lognormal:mean=30,sigma=0.5,min=2,max=200"


@pytest.fixture
def offline_sglang(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`import sglang` finds the stand-in for this test only."""
    monkeypatch.syspath_prepend(OFFLINE)
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    yield
    sys.modules.pop("sglang", None)


def build(
    monkeypatch: pytest.MonkeyPatch, knobs: dict[str, Any] | None = None, **options: Any
) -> SGLangInProcessEngine:
    monkeypatch.setenv(
        CONFIG_ENV, orjson.dumps({"output_len_dist": SHORT, **(knobs or {})}).decode()
    )
    engine = make_engine("sglang-engine", EngineOptions(model="smollm2", **options))
    assert isinstance(engine, SGLangInProcessEngine)
    return engine


def request(i: int, length: int = 6, rid: str | None = None, **sampling: Any) -> GenerateRequest:
    prompt = [(i * 7919 + k * 104729) % 40000 + 100 for k in range(length)]
    return GenerateRequest(rid or f"req-{i}", prompt, {"max_new_tokens": 64, **sampling})


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.mark.usefixtures("offline_sglang")
def test_results_are_the_engines_replies_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build(monkeypatch)
    completer = Completer(
        load_tokenizer(), LengthDist.parse(SHORT), eos_id=None, think=False, seed=0
    )
    requests = [request(i) for i in range(8)]

    async def main() -> list[Any]:
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    results = run(main())
    for req, result in zip(requests, results, strict=True):
        want = completer.complete(req.prompt_ids, req.sampling)
        assert result.output_ids == want.output_ids
        assert result.text == want.text
        assert result.finish_reason == want.finish_reason
        assert result.prompt_tokens == len(req.prompt_ids)
        assert result.completion_tokens == len(want.output_ids)
        assert result.server == "sglang-engine:smollm2"
    assert engine.stats()["completed"] == 8
    assert engine.stats()["inflight"] == 0


@pytest.mark.usefixtures("offline_sglang")
def test_a_prompt_too_long_is_rejected_while_others_succeed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = build(monkeypatch, sglang_args={"context_length": 100})

    async def main() -> list[Any]:
        reqs = [request(0, length=150), request(1), request(2, length=60, max_new_tokens=64)]
        return await asyncio.gather(*(engine.generate(r) for r in reqs), return_exceptions=True)

    too_long, fine, over_total = run(main())
    assert isinstance(too_long, PromptRejected)
    assert "longer than the model's context length (100 tokens)" in too_long.message
    assert isinstance(over_total, PromptRejected)
    assert "You requested a total of 124 tokens" in over_total.message
    assert fine.output_ids
    assert engine.stats()["failures"] == {"rejected": 2}


@pytest.mark.usefixtures("offline_sglang")
def test_overload_server_errors_and_bad_replies_are_unavailable_not_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = build(monkeypatch, {"fault": ["503:1", "500:1", "malformed:1"]})

    async def main() -> list[Any]:
        return [await engine.generate(request(i)) for i in range(3)]

    for kind in ("HTTP 503", "HTTP 500", "malformed response"):
        with pytest.raises(EngineUnavailable, match=kind):
            run(main())
    assert run(engine.generate(request(4))).output_ids  # faults spent: served again
    assert engine.stats()["failures"] == {"overloaded": 1, "server_error": 1, "bad_response": 1}


@pytest.mark.usefixtures("offline_sglang")
def test_a_duplicate_rid_still_running_is_unavailable_not_rejected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = build(monkeypatch, {"decode_tokens_per_s": 40})

    async def main() -> list[Any]:
        first = asyncio.ensure_future(engine.generate(request(1, rid="same")))
        await asyncio.sleep(0.05)  # the first is running when the second arrives
        second = await asyncio.gather(
            engine.generate(request(2, rid="same")), return_exceptions=True
        )
        return [await first, *second]

    first, second = run(main())
    assert first.output_ids
    assert isinstance(second, EngineUnavailable) and "Duplicate request ID" in str(second)


@pytest.mark.usefixtures("offline_sglang")
def test_waiting_for_a_slot_never_gives_up_while_the_engine_is_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A busy engine is waited out, whatever the outage limit: the second request starts
    when the first ends (it used to give up at once: a zero timeout)."""
    engine = build(monkeypatch, {"decode_tokens_per_s": 20}, max_inflight=1)

    async def main() -> tuple[Any, Any]:
        first = asyncio.ensure_future(engine.generate(request(1)))
        await asyncio.sleep(0.05)
        second = await engine.generate(request(2), outage_s=0.0)
        return await first, second

    first, second = run(main())
    assert first.output_ids and second.output_ids


@pytest.mark.usefixtures("offline_sglang")
def test_a_cancelled_request_is_aborted_in_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build(monkeypatch, {"decode_tokens_per_s": 5})

    async def main() -> None:
        task = asyncio.ensure_future(engine.generate(request(1)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert engine._engine._scheduler.counters["aborted"] == 1  # type: ignore[attr-defined]
    assert engine.stats()["inflight"] == 0
    assert run(engine.generate(request(2, max_new_tokens=2))).output_ids  # the slot is free


@pytest.mark.usefixtures("offline_sglang")
def test_server_args_pass_through_and_a_wrong_name_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = build(monkeypatch, tp_size=8, sglang_args={"mem_fraction_static": 0.85})
    server_args = engine._engine.server_args  # type: ignore[attr-defined]
    assert server_args["tp_size"] == 8 and server_args["mem_fraction_static"] == 0.85
    assert engine.stats()["device"] == "tp_size=8"
    with pytest.raises(ValueError, match=r"rejected its arguments.*'mem_fraction'"):
        build(monkeypatch, sglang_args={"mem_fraction": 0.85})


@pytest.mark.usefixtures("offline_sglang")
def test_a_closed_engine_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build(monkeypatch)
    run(engine.close())
    with pytest.raises(EngineUnavailable, match="closed"):
        run(engine.generate(request(1)))


@pytest.mark.usefixtures("offline_sglang")
def test_the_prefix_cache_hit_rate_is_reported_in_stats_status_and_metrics(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A conversation's next turn repeats its last prompt: the engine's prefix cache
    serves that part, and `meta_info.cached_tokens` says how much."""
    engine = build(monkeypatch)
    runner = EngineRunner(engine)
    try:
        first = request(1, length=40)
        longer = GenerateRequest("req-2", [*first.prompt_ids, 7, 8, 9], first.sampling)
        results = [runner.call(engine.generate(r), timeout=30) for r in (first, longer)]
        stats = engine.stats()
        collector = GenerateCollector(ChunkContext(redis.Redis(), runner), lambda: True)
        registry = CollectorRegistry()
        registry.register(collector)
        exposition = generate_latest(registry).decode()
    finally:
        runner.close()
    cached = [r.cached_tokens for r in results]
    assert cached[0] == 0 and cached[1] is not None and cached[1] >= 39
    assert stats["prompt_tokens"] == 40 + 43 and stats["cached_tokens"] == sum(cached)
    assert stats["cache_hit_rate"] == pytest.approx(sum(cached) / 83)
    shown = _servers({"engine": "sglang-engine", "engine_stats": stats}).plain
    assert shown == f"sglang-engine (tp_size=1) cache {sum(cached) / 83:.0%}"
    line = 'regen_sglang_server_cache_hit_rate{server="sglang-engine:smollm2"}'
    assert f"{line} {sum(cached) / 83}" in exposition
