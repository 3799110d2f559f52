"""`--turns all` chunks commit as single-turn chunks do, under the chunk's lease: a
stale delivery writes nothing, a short Redis outage is waited out, the in-flight count
never leaks, and a delivery whose writes a Redis rollback lost is not acknowledged.

The chunks run in this process (run_chunk) on a scripted engine, against a real Redis."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from regen.common import dlq, jobspec, keys
from regen.common.chat_family import detect_family
from regen.common.chunk import Chunk
from regen.consumers.generate import turns
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import DeliveryEnd
from regen.consumers.generate.chunk_runner import run_chunk
from regen.consumers.generate.engine import GenerateRequest, GenerateResult, PromptRejected
from regen.consumers.generate.engine_loop import EngineRunner
from tests.generate.test_lease import TAG, deliver
from tests.producer.test_enqueue import enqueue
from tests.producer.test_turns import ROW, TOOL_ROW, USER_TURNS, conversation_row
from tests.support.generate_harness import results
from tests.support.helpers import queued_chunks, write_jsonl
from tests.support.redis_server import RedisServer
from tests.tokenize.test_redis_restore import dump_all, restore_all

Hook = Callable[[int], None]


class ScriptedEngine:
    """Answers each turn at once with "Answer k." (its end-of-turn token included, as
    SGLang returns it); `before` runs first, on the engine's loop thread, with the turn's
    index (it may block, or raise to fail the request)."""

    name = "scripted"

    def __init__(self, tokenizer: Any, before: Hook | None = None) -> None:
        self._tok = tokenizer
        self._eot = detect_family(tokenizer).end_of_turn_ids[0]
        self._before = before
        self.calls: list[int] = []

    async def generate(self, request: GenerateRequest, outage_s: float | None = None) -> Any:
        # rid: "<chunk>-<conversation>-<turn>-<attempt>"
        turn = int(request.rid.split("-")[-2])
        self.calls.append(turn)
        if self._before is not None:
            await asyncio.to_thread(self._before, turn)
        text = f"Answer {turn}."
        ids = [*self._tok.encode(text, add_special_tokens=False), self._eot]
        return GenerateResult(ids, text, {"type": "stop", "matched": self._eot}, 1, len(ids))

    async def health(self) -> bool:
        return True

    def capacity(self) -> int:
        return 8

    def stats(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


@pytest.fixture
def contexts(r: redis.Redis) -> Iterator[Callable[..., ChunkContext]]:
    """Makes a worker's context on a scripted engine; closes their loops after."""
    runners: list[EngineRunner] = []

    def make(tokenizer: Any, before: Hook | None = None, name: str = "w") -> ChunkContext:
        runner = EngineRunner(ScriptedEngine(tokenizer, before))  # type: ignore[arg-type]
        runners.append(runner)
        return ChunkContext(redis=r, runner=runner, worker=name)

    yield make
    for runner in runners:
        runner.close()


def turns_chunk(redis_url: str, r: redis.Redis, tmp_path: Path, rows: list[Any]) -> Chunk:
    """The one chunk of a `--turns all` job "j" of `rows`, as delivered (tag TAG)."""
    enqueue(redis_url, [write_jsonl(tmp_path / "d.jsonl", rows)], turns="all")
    (payload,) = queued_chunks(r, jobspec.load(r, "j").queue)
    deliver(r)
    return Chunk.from_payload(payload)


def handed_off(r: redis.Redis) -> Counter[str]:
    return Counter(result.id for result in results(r, "j"))


@pytest.mark.parametrize("stale_turn", ["answered", "rejected"])
def test_a_stale_delivery_writes_nothing_for_turns_the_new_one_committed(
    redis_url: str,
    r: redis.Redis,
    tmp_path: Path,
    smollm2_tokenizer: Any,
    contexts: Callable[..., ChunkContext],
    stale_turn: str,
) -> None:
    """Delivery 1 hands off turn 0 and freezes in turn 1 past its lease; delivery 2
    takes the chunk, runs turns 1 and 2 and acknowledges it (its `generated` set goes
    with the ack). Delivery 1 wakes up with turn 1's answer, or its rejection: neither
    a duplicate nor a dead letter of a turn delivery 2 committed may follow."""
    chunk = turns_chunk(redis_url, r, tmp_path, [ROW])
    (prompt,) = chunk.prompts
    frozen, wake = threading.Event(), threading.Event()

    def freeze_in_turn_1(turn: int) -> None:
        if turn == 1:
            frozen.set()
            wake.wait(60)
            if stale_turn == "rejected":
                raise PromptRejected("too long once rendered", server="s")

    stale = contexts(smollm2_tokenizer, freeze_in_turn_1, "stale")
    live = contexts(smollm2_tokenizer, name="live")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(run_chunk, stale, chunk, TAG)
        assert frozen.wait(60), "delivery 1 never reached turn 1"
        assert handed_off(r) == Counter(prompt.accounted_ids[:1])
        taken = run_chunk(live, chunk, TAG)  # the redelivery, with the same tag
        assert (taken.generated, taken.skipped, taken.dead_lettered) == (2, 1, 0)
        assert taken.end is DeliveryEnd.ACKED
        wake.set()
        assert first.result(60).end is DeliveryEnd.DROPPED
    assert handed_off(r) == Counter(prompt.accounted_ids), "each turn exactly once"
    assert dlq.count(r, "j", "generate") == 0
    assert stale.inflight == 0 and live.inflight == 0


@pytest.mark.parametrize("reply", ["refused", "lost"])
def test_a_turn_hand_off_waits_out_a_short_redis_outage(
    redis_url: str,
    r: redis.Redis,
    tmp_path: Path,
    smollm2_tokenizer: Any,
    contexts: Callable[..., ChunkContext],
    monkeypatch: pytest.MonkeyPatch,
    reply: str,
) -> None:
    """Redis drops the connection at the hand-off of turn 1: before the script runs
    ("refused"), or after it ran, the reply lost ("lost"). The hand-off is retried, the
    turn written once, and the conversation goes on from it."""
    chunk = turns_chunk(redis_url, r, tmp_path, [ROW])
    (prompt,) = chunk.prompts
    ctx = contexts(smollm2_tokenizer)
    evalsha = ctx.redis.evalsha
    failed: list[bool] = []

    def flaky_evalsha(sha: str, numkeys: int, *keys_and_args: Any) -> Any:
        # Turn 1's hand-off is the script call that carries turn 1's id.
        if not failed and prompt.accounted_ids[1] in keys_and_args:
            failed.append(True)
            if reply == "lost":
                evalsha(sha, numkeys, *keys_and_args)
            raise redis.ConnectionError("Connection reset by peer")
        return evalsha(sha, numkeys, *keys_and_args)

    monkeypatch.setattr(ctx.redis, "evalsha", flaky_evalsha)
    outcome = run_chunk(ctx, chunk, TAG)
    assert failed == [True]
    assert handed_off(r) == Counter(prompt.accounted_ids), "each turn exactly once"
    # The turn whose reply was lost counts as settled before, not generated now.
    assert outcome.generated == (3 if reply == "refused" else 2)
    assert ctx.inflight == 0


def test_turns_failing_together_leave_no_prompt_counted_in_flight(
    redis_url: str,
    r: redis.Redis,
    tmp_path: Path,
    smollm2_tokenizer: Any,
    contexts: Callable[..., ChunkContext],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two conversations' turns end at the same moment, both with an engine error: the
    first one's error ends the chunk while the other is finished but not yet taken; the
    in-flight count (flow control and metrics read it) still goes back to 0."""
    rows = [ROW, conversation_row("old one", "old two", users=USER_TURNS[1:])]
    chunk = turns_chunk(redis_url, r, tmp_path, rows)
    assert len(chunk.prompts) == 2

    def engine_bug(turn: int) -> None:
        raise RuntimeError("engine bug")

    ctx = contexts(smollm2_tokenizer, engine_bug)
    # Both turns finished when the chunk looks: as when they end within a moment.
    every = concurrent.futures.ALL_COMPLETED
    monkeypatch.setattr(
        turns, "wait", lambda fs, timeout, return_when: concurrent.futures.wait(fs, None, every)
    )
    failed = run_chunk(ctx, chunk, TAG)
    assert failed.end is DeliveryEnd.FAILED and "engine bug" in failed.reason
    assert isinstance(failed.error, RuntimeError)
    assert ctx.inflight == 0
    assert handed_off(r) == Counter()


def test_a_delivery_whose_turn_a_redis_rollback_lost_is_not_acknowledged(
    redis_url: str,
    r: redis.Redis,
    tmp_path: Path,
    smollm2_tokenizer: Any,
    contexts: Callable[..., ChunkContext],
) -> None:
    """Redis is restored from a copy taken after turn 0's hand-off, once turn 1 is handed
    off: turn 1 is lost with the copy. The delivery's hand-off of turn 2 and its ack are
    refused, so the chunk comes back, and its next delivery redoes turns 1 and 2."""
    chunk = turns_chunk(redis_url, r, tmp_path, [ROW])
    ids = chunk.prompts[0].accounted_ids
    copy: dict[bytes, bytes] = {}

    def at_turn(turn: int) -> None:
        if turn == 1:
            copy.update(dump_all(r))
        elif turn == 2:
            restore_all(r, copy)

    refused = run_chunk(contexts(smollm2_tokenizer, at_turn), chunk, TAG)
    assert refused.end is DeliveryEnd.DROPPED
    assert handed_off(r) == Counter(ids[:1])
    assert r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) is not None, "left for the sweep"
    again = run_chunk(contexts(smollm2_tokenizer, name="next"), chunk, TAG)
    assert (again.generated, again.skipped) == (2, 1)
    assert handed_off(r) == Counter(ids), "each turn exactly once"


def test_a_conversation_goes_on_through_a_redis_restart(
    tmp_path: Path, smollm2_tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis is SIGKILLed as turn 1's answer comes back and restarted on its AOF a
    second later: the hand-off waits it out, and the chunk ends with every turn once."""
    server = RedisServer.on_free_port(tmp_path / "redis")
    restarts: list[threading.Thread] = []
    runner: EngineRunner | None = None
    try:
        r = redis.Redis.from_url(server.url)
        chunk = turns_chunk(server.url, r, tmp_path, [ROW])

        def outage_at_turn_1(turn: int) -> None:
            if turn == 1 and not restarts:
                server.kill()
                restarts.append(threading.Timer(1.0, server.start))
                restarts[0].start()

        runner = EngineRunner(ScriptedEngine(smollm2_tokenizer, outage_at_turn_1))  # type: ignore[arg-type]
        ctx = ChunkContext(redis=r, runner=runner)
        outcome = run_chunk(ctx, chunk, TAG)
        assert restarts, "Redis was never killed"
        assert "Redis unreachable" in caplog.text, "the hand-off never met the outage"
        assert (outcome.generated, outcome.dead_lettered) == (3, 0)
        assert handed_off(r) == Counter(chunk.prompts[0].accounted_ids), "each turn once"
        assert r.zscore(keys.KOMBU_UNACKED_INDEX, TAG) is None, "acknowledged"
        assert ctx.inflight == 0
    finally:
        for restart in restarts:
            restart.join(30)
        if runner is not None:
            runner.close()
        server.kill()


def test_a_renewal_that_finds_the_lease_lost_stops_the_turns_at_once(
    redis_url: str,
    r: redis.Redis,
    tmp_path: Path,
    smollm2_tokenizer: Any,
    contexts: Callable[..., ChunkContext],
) -> None:
    """A turn still generating when the worker's heartbeat finds the chunk taken: the
    delivery ends now, not when that turn would have come back."""
    chunk = turns_chunk(redis_url, r, tmp_path, [ROW])
    sent, never = threading.Event(), threading.Event()

    def hang_in_turn_1(turn: int) -> None:
        if turn == 1:
            sent.set()
            never.wait(60)

    ctx = contexts(smollm2_tokenizer, hang_in_turn_1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_chunk, ctx, chunk, TAG)
        try:
            assert sent.wait(60), "turn 1 never sent"
            contexts(smollm2_tokenizer).leases.start("j", chunk.chunk_id, TAG, "other")
            ctx.leases.renew()  # the heartbeat
            # Turn 1 would hang 60 s: the chunk ends well before.
            assert running.result(30).end is DeliveryEnd.DROPPED
        finally:
            never.set()
    assert ctx.inflight == 0
    assert len(results(r, "j")) == 1  # turn 0 only


def _diverged_checkpoint(
    redis_url: str, r: redis.Redis, tmp_path: Path, deaths: int
) -> tuple[Chunk, list[str]]:
    """TOOL_ROW's chunk as a delivery that died between turn 0's hand-off and the dead
    letter of turn 1 leaves it: turn 0 settled, its answer (no tool call, where the
    dataset answers one) checkpointed, and `deaths` deliveries started and gone."""
    chunk = turns_chunk(redis_url, r, tmp_path, [TOOL_ROW])
    (prompt,) = chunk.prompts
    assert prompt.conversation is not None
    ids = prompt.accounted_ids
    r.sadd(keys.chunk_generated("j", chunk.chunk_id), ids[0])
    answer = {"role": "assistant", "content": "It is sunny, I think."}
    r.hset(keys.conversation_answers("j", chunk.chunk_id, prompt.conversation.id), "0",
           orjson.dumps(answer))  # fmt: skip
    started = orjson.dumps({"worker": "w", "time": 0.0, "status": "started"})
    for _ in range(deaths):
        r.rpush(keys.chunk_attempts("j", chunk.chunk_id), started)
    return chunk, ids


@pytest.mark.parametrize("deaths", [0, 3])
def test_a_redelivery_whose_checkpoint_does_not_fit_the_next_tool_result_dead_letters_it(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any,
    contexts: Callable[..., ChunkContext], deaths: int,
) -> None:  # fmt: skip
    """Found by the chaos harness (turns seed 18): the redelivery resumed the conversation
    on its checkpoint, the next turn's tool result did not fit that answer, and the
    ToolCallDiverged escaped: every delivery failed, then the poison cap's dead letter
    failed the same way, and the chunk looped forever. Now turn 1 is dead-lettered as
    the first delivery would have, the turn after it blocked, and the chunk is done."""
    chunk, ids = _diverged_checkpoint(redis_url, r, tmp_path, deaths)
    ctx = contexts(smollm2_tokenizer)
    ctx.max_attempts = 3
    outcome = run_chunk(ctx, chunk, TAG)
    assert (outcome.generated, outcome.skipped, outcome.dead_lettered) == (0, 1, 2)
    letters = {letter.entry_id: letter for letter in dlq.entries(r, "j", "generate")}
    assert set(letters) == set(ids[1:])
    assert letters[ids[1]].reason == "tool_call_diverged"
    assert "1 tool result" in letters[ids[1]].message
    assert letters[ids[2]].reason == "blocked"
    assert not r.hlen(keys.KOMBU_UNACKED), "the chunk is acknowledged"
    assert handed_off(r) == Counter(), "no turn generated again"
