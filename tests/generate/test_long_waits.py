"""Waiting is not failing (docs/design/limits.md, "Timers at real lengths"): a prompt waits for
a busy engine however long, a chunk is given back only when no server is healthy, and a
request's read timeout grows with the tokens it asks for at the speed its server shows.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from regen.common import keys
from regen.common.backoff import Backoff
from regen.consumers.generate.chunk_life import policy
from regen.consumers.generate.engine import (
    EngineDown,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
)
from regen.consumers.generate.engines.sglang_http import READ_TIMEOUT_MARGIN, read_timeout_s
from regen.consumers.generate.engines.sglang_pool import SPEED_MIN_TOKENS, ServerState
from tests.support.generate_harness import (
    VISIBILITY_TIMEOUT_S,
    Worker,
    all_generated,
    attempts,
    enqueue_prompts,
)
from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import run_standin

REQUEST = GenerateRequest("r", [1, 2, 3], {"max_new_tokens": 8})
RESULT = GenerateResult([4, 2], "ok", {"type": "stop", "matched": 2}, 3, 2)


class ScriptedEngine:
    """Raises the scripted errors in turn, then answers; records each call's outage_s."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.outage_limits: list[float | None] = []

    async def generate(self, request: GenerateRequest, *, outage_s: float | None = None) -> Any:
        self.outage_limits.append(outage_s)
        if self.errors:
            raise self.errors.pop(0)
        return RESULT


def _retry(engine: ScriptedEngine, monkeypatch: pytest.MonkeyPatch) -> GenerateResult:
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:  # a fake clock: no real waiting
        slept.append(seconds)

    monkeypatch.setattr(policy.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(policy, "ENGINE_RETRY", Backoff(1.0, 60.0, jitter=0))
    runner = SimpleNamespace(engine=engine)
    return asyncio.run(policy.generate_with_retry(runner, REQUEST))  # type: ignore[arg-type]


def test_a_failing_healthy_engine_is_retried_without_a_chunk_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Twenty failures spaced up to a minute apart: far past any old chunk deadline.
    engine = ScriptedEngine(*(EngineUnavailable("bad answers") for _ in range(20)))
    assert _retry(engine, monkeypatch) is RESULT
    assert len(engine.outage_limits) == 21
    assert set(engine.outage_limits) == {policy.GIVE_BACK_AFTER_S}


def test_an_outage_gives_the_chunk_back(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ScriptedEngine(EngineDown("no SGLang server healthy for 75 s"))
    with pytest.raises(policy.ChunkDeferred, match="no SGLang server healthy"):
        _retry(engine, monkeypatch)
    assert len(engine.outage_limits) == 1


def test_the_read_timeout_scales_with_max_new_tokens_and_measured_speed() -> None:
    floor = 3600.0
    assert read_timeout_s(floor, 4096, None) == floor  # nothing measured yet
    assert read_timeout_s(floor, 4096, 50.0) == floor  # 82 s of decoding: the floor holds
    # 32K tokens of thinking at 10 tokens/s per request: 55 minutes; 4x that.
    assert read_timeout_s(floor, 32_768, 10.0) == READ_TIMEOUT_MARGIN * 3276.8


def test_a_server_s_speed_follows_its_replies_and_ignores_short_ones() -> None:
    server = ServerState("http://a", "http://a", cap=4)
    server.note_speed(SPEED_MIN_TOKENS - 1, 0.001)  # overhead, not decoding
    assert server.decode_tps is None
    server.note_speed(2000, 100.0)
    assert server.decode_tps == 20.0
    server.note_speed(2000, 50.0)  # faster now: the average moves part of the way
    assert server.decode_tps is not None and 20.0 < server.decode_tps < 40.0


@pytest.mark.slow
def test_answers_longer_than_the_lease_are_neither_given_back_nor_redelivered(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """One chunk of 4 prompts, 2 slots, each answer 10.5 s: the last two wait 10.5 s for
    a slot (past the old give-back at 0.75 x the 8 s lease) and the chunk is held 21 s,
    nearly three leases, renewed by the heartbeat the whole time."""
    spec = enqueue_prompts(redis_url, tmp_path, [f"Long answer {i}" for i in range(4)])
    started = time.monotonic()
    with (
        run_standin(output_len_dist="fixed:n=20", decode_tokens_per_s=2.0) as server,
        Worker(
            redis_url, tmp_path, "--engine", "sglang", "--server", server.url,
            "--max-inflight", "2", "--jobs", spec.name,
        ),
    ):  # fmt: skip
        wait_for(lambda: all_generated(r, spec), timeout=120, what="the long answers")
        held_s = time.monotonic() - started
        stats = server.stats()
    chunk_ids = [raw.decode() for raw in r.hkeys(keys.job_chunks(spec.name))]
    history = [attempts(r, spec.name, chunk) for chunk in chunk_ids]
    assert [[a["status"] for a in h] for h in history] == [["done"]]
    assert stats["requests_total"] == 4 and stats["completed"] == 4, stats
    assert stats.get("aborted_total", 0) == 0, stats
    assert held_s > 2 * VISIBILITY_TIMEOUT_S  # the chunk outlived two leases
