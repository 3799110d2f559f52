"""A slow server's last answers move (docs/design/placement.md): a worker that left a job's end
hands its running answers over to faster peers, which continue them; nothing is thrown
away and each record is one answer, token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from aiohttp import web

from regen.common import jobspec
from regen.common.answer_ends import misplaced_end, request_end_ids
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.samples import sample_id
from regen.consumers.generate.engine import GenerateRequest, GenerateResult, server_rid
from regen.consumers.generate.engines.sglang_http import SGLangHTTPEngine
from regen.consumers.generate.engines.sglang_replies import Failure, parse_result
from regen.consumers.generate.placement.held_prompts import BEFORE_SEND_ON
from regen.consumers.generate.placement.resume import continued_sampling, joined
from regen.ops.reconcile import reconcile
from tests.contracts.test_sglang_router import needs_router, run_router
from tests.ops.test_metrics import scrape, value
from tests.support.generate_harness import (
    Worker,
    all_generated,
    enqueue_prompts,
    enqueued_ids,
    results,
)
from tests.support.helpers import wait_for
from tests.support.redis_server import running_redis
from tests.support.sglang_standin import StandinHandle, run_standin
from tests.support.sglang_standin.process import free_port


def result(output_ids: list[int], prompt_tokens: int, **fields: object) -> GenerateResult:
    return GenerateResult(
        output_ids=output_ids,
        text="t",
        finish_reason={"type": "stop", "matched": output_ids[-1]},
        prompt_tokens=prompt_tokens,
        completion_tokens=len(output_ids),
        cached_tokens=fields.pop("cached_tokens", 2),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


def test_a_continuation_joins_the_answer_so_far_and_moves_the_counts_across() -> None:
    # The server was sent the prompt (5 ids) and the answer so far (3 ids).
    continued = result([7, 8, 2], prompt_tokens=8, cached_tokens=6)
    whole = joined(continued, [4, 5, 6])
    assert whole.output_ids == [4, 5, 6, 7, 8, 2]
    assert whole.prompt_tokens == 5 and whole.completion_tokens == 6
    assert whole.resumed_tokens == 3
    assert whole.cached_tokens == 5  # never more than the prompt itself
    assert whole.text is None  # two decodes side by side may differ from the whole's
    assert whole.finish_reason == continued.finish_reason
    # Handed over again further on: the answer so far grows, the count with it.
    again = joined(joined(result([9], prompt_tokens=9), [4, 5, 6, 7]), [])
    assert again.output_ids == [4, 5, 6, 7, 9] and again.resumed_tokens == 4


def test_the_token_budget_shrinks_by_what_was_decoded_and_never_below_one() -> None:
    job = {"max_new_tokens": 100, "temperature": 0.6}
    assert continued_sampling(job, 0) == job
    assert continued_sampling(job, 40) == {**job, "max_new_tokens": 60}
    assert continued_sampling(job, 99)["max_new_tokens"] == 1
    assert job["max_new_tokens"] == 100  # the job's own params are left alone
    # An answer so far that spent its budget had ended: it is never continued (the old
    # code asked for max(1, ...) tokens, one more than the budget).
    with pytest.raises(ValueError, match="spent its budget"):
        continued_sampling(job, 100)


def test_a_prompt_travels_with_its_answer_so_far_and_plain_ones_as_before() -> None:
    plain = ChunkPrompt("p1", [1, 2], [{"role": "user", "content": "hi"}], {"row": 0})
    assert "resume_ids" not in plain.to_payload()
    moved = ChunkPrompt("p2", [1, 2], [], {"row": 1}, resume_ids=[5, 6])
    chunk = Chunk("j", "c1", [plain, moved])
    back = Chunk.from_payload(chunk.to_payload())
    assert back.prompts == [plain, moved]
    bad = chunk.to_payload()
    bad["prompts"][1]["resume_ids"] = [5, "6"]
    with pytest.raises(ValueError, match="'p2' is not a prompt"):
        Chunk.from_payload(bad)


def test_only_an_abort_the_worker_asked_for_is_an_answer_so_far() -> None:
    reply = (
        b'{"text": "so far", "output_ids": [4, 5], "meta_info": {"id": "r", '
        b'"finish_reason": {"type": "abort", "message": "Abort by request"}, '
        b'"prompt_tokens": 3, "completion_tokens": 2}}'
    )
    request = GenerateRequest("r", [1, 2, 3], {"max_new_tokens": 10})
    with pytest.raises(Failure, match="request aborted"):
        parse_result(reply, request, "s", 0.0)
    so_far = parse_result(reply, request, "s", 0.0, handed_over=True)
    assert so_far.handed_over and so_far.output_ids == [4, 5]


def test_an_asked_abort_without_output_ids_is_an_empty_answer_so_far_not_a_bad_server() -> None:
    """SGLang 0.5.1 and 0.5.3 answer the abort of a queued request with no output_ids
    ("Abort before prefill"); the old code took it for a malformed reply and marked the
    server down."""
    reply = (
        b'{"text": "", "meta_info": {"id": "r", "finish_reason": {"type": "abort", '
        b'"message": "Abort before prefill"}, "prompt_tokens": 0, "completion_tokens": 0}}'
    )
    request = GenerateRequest("r", [1, 2, 3], {"max_new_tokens": 10})
    so_far = parse_result(reply, request, "s", 0.0, handed_over=True)
    assert so_far.handed_over and so_far.output_ids == []
    with pytest.raises(Failure, match="request aborted"):  # not asked for: as before
        parse_result(reply.replace(b'"text"', b'"output_ids": [], "text"'), request, "s", 0.0)


def test_no_rid_sent_is_a_prefix_of_another() -> None:
    """SGLang aborts every request whose rid starts with the one named: the rids a
    worker sends (chunk, prompt or sample, delivery attempt, retry) are prefix-free, so
    an abort ends one request. Plain `C-P-1` was a prefix of `C-P-10` and `C-P-1~1`."""
    chunk = Chunk.make_id("job", ["p"])
    prompts = [
        "0123456789abcdef",
        sample_id("0123456789abcdef", 1),
        sample_id("0123456789abcdef", 12),
    ]
    rids = [
        server_rid(f"{chunk}-{prompt}-{attempt}", retry)
        for prompt in prompts
        for attempt in (1, 2, 10, 11, 123)
        for retry in (0, 1, 2, 10, 12)
    ]
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    with pytest.raises(ValueError):
        server_rid("c.1-p-1")


async def sent_and_running(
    engine: SGLangHTTPEngine, request: GenerateRequest, server: StandinHandle
) -> asyncio.Future[GenerateResult]:
    """`request` sent through `engine`, returned once `server` runs it."""
    running = asyncio.ensure_future(engine.generate(request))
    await asyncio.to_thread(
        wait_for, lambda: server.stats()["running"] == 1, 20, "the request to run"
    )
    return running


def test_a_fleet_of_053_and_056_hands_over_only_on_056_and_marks_no_server_down(
    tmp_path: Path,
) -> None:
    """One engine over a 0.5.3-style and a 0.5.6-style server, an answer running on
    each: asked to hand both over, it aborts only the 0.5.6 one (which returns its
    answer so far); the 0.5.3 one runs to its end. No server is marked down, and no
    answer runs again from scratch (the old code asked 0.5.3 too, whose reply without
    output_ids it took for a bad server)."""
    options = {"decode_tokens_per_s": 200, "output_len_dist": "fixed:n=600",
               "continuations_dir": str(tmp_path / "cont")}  # fmt: skip
    with (
        run_standin(version="0.5.3", **options) as old,
        run_standin(version="0.5.6", **options) as new,
    ):

        async def scenario() -> tuple[list[bool], list[GenerateResult], dict[str, Any]]:
            requests = [GenerateRequest(f"r{i}", [1, 2, 3, i], {"max_new_tokens": 1000})
                        for i in range(2)]  # fmt: skip
            async with SGLangHTTPEngine([old.url, new.url]) as engine:
                while not all(s["healthy"] for s in engine.stats()["servers"]):
                    await engine.wait_until_healthy(30)  # one at least: both, to route
                    await asyncio.sleep(0.05)  # the requests one to each
                running = [asyncio.ensure_future(engine.generate(r)) for r in requests]
                await asyncio.to_thread(
                    wait_for, lambda: old.stats()["running"] == new.stats()["running"] == 1,
                    20, "an answer running on each server",
                )  # fmt: skip
                handed = [await engine.hand_over(r.rid) for r in requests]
                return handed, list(await asyncio.gather(*running)), engine.stats()

        handed, answers, stats = asyncio.run(scenario())
        on_old = [a for a in answers if a.server == old.url]
        on_new = [a for a in answers if a.server == new.url]
        assert len(on_old) == len(on_new) == 1 and sorted(handed) == [False, True]
        assert not on_old[0].handed_over and len(on_old[0].output_ids) == 601
        assert on_new[0].handed_over and 0 < len(on_new[0].output_ids) < 601
        assert all(s["healthy"] and not s["failures_by_kind"] for s in stats["servers"])
        assert old.stats()["moved_total"] == 0 and new.stats()["moved_total"] == 1
        assert old.stats()["aborted_total"] == new.stats()["aborted_total"] == 0


def test_the_engine_hands_a_running_answer_over_with_what_it_decoded(tmp_path: Path) -> None:
    """SGLang's /abort_request on the stand-in: the request's own /generate returns the
    answer so far, which a second server (same seed) continues into the whole answer."""
    options = {"output_len_dist": "fixed:n=2000", "continuations_dir": str(tmp_path / "cont")}
    with (
        run_standin(decode_tokens_per_s=200, **options) as slow,
        run_standin(decode_tokens_per_s=100_000, **options) as fast,
    ):

        async def scenario() -> tuple[GenerateResult, GenerateResult, GenerateResult]:
            request = GenerateRequest("r1", [1, 2, 3, 4], {"max_new_tokens": 4000})
            async with SGLangHTTPEngine([slow.url]) as on_slow:
                running = await sent_and_running(on_slow, request, slow)
                await asyncio.sleep(0.5)  # some tokens decoded
                assert await on_slow.hand_over("r1")
                so_far = await running
                assert not await on_slow.hand_over("r1")  # nothing runs under it now
            async with SGLangHTTPEngine([fast.url]) as on_fast:
                rest = GenerateRequest(
                    "r1b",
                    request.prompt_ids + so_far.output_ids,
                    continued_sampling(request.sampling, len(so_far.output_ids)),
                )
                continued = joined(await on_fast.generate(rest), so_far.output_ids)
                whole = await on_fast.generate(dataclasses.replace(request, rid="r2"))
            return so_far, continued, whole

        so_far, continued, whole = asyncio.run(scenario())
        assert so_far.handed_over and 0 < len(so_far.output_ids) < 2000
        assert continued.output_ids == whole.output_ids
        assert continued.resumed_tokens == len(so_far.output_ids)
        assert slow.stats()["moved_total"] == 1 and slow.stats()["aborted_total"] == 0


@needs_router
def test_behind_sglangs_router_the_abort_goes_to_the_servers_it_routes_to(
    tmp_path: Path,
) -> None:
    """sglang-router 0.3 has no /abort_request (404) but passes the rid on: the engine
    asks the router for its servers and aborts the rid on each, and the answer so far
    comes back through the router."""
    options = {"decode_tokens_per_s": 500, "output_len_dist": "fixed:n=2000",
               "continuations_dir": str(tmp_path / "cont")}  # fmt: skip
    with (
        run_standin(**options) as busy,
        run_standin(**options) as other,
        run_router([busy, other], tmp_path) as router,
    ):

        async def scenario() -> tuple[bool, GenerateResult]:
            request = GenerateRequest("r1", [1, 2, 3, 4], {"max_new_tokens": 4000})
            async with SGLangHTTPEngine([router.url]) as engine:
                running = asyncio.ensure_future(engine.generate(request))
                await asyncio.to_thread(
                    wait_for, lambda: busy.stats()["running"] + other.stats()["running"] == 1,
                    20, "the request to run",
                )  # fmt: skip
                return await engine.hand_over("r1"), await running

        handed, so_far = asyncio.run(scenario())
        assert handed and so_far.handed_over and 0 < len(so_far.output_ids) < 2000
        assert busy.stats()["moved_total"] + other.stats()["moved_total"] == 1


def ask_a_fake_server_twice(
    version: str | None, abort_status: int | None
) -> tuple[bool, bool, GenerateResult, int]:
    """One request running on a bare aiohttp server that reports SGLang `version` (None:
    no info route) and answers /abort_request with `abort_status` (None: no such route);
    the engine asked twice to hand it over. (the two answers, the request's result, how
    many aborts reached the server)."""
    arrived, release = asyncio.Event(), asyncio.Event()
    aborts = []

    async def generate(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": 2},
                "prompt_tokens": 4, "completion_tokens": 2}  # fmt: skip
        return web.json_response({"text": "ok", "output_ids": [7, 2], "meta_info": meta})

    async def abort(request: web.Request) -> web.Response:
        aborts.append(await request.read())
        return web.Response(status=abort_status or 500)

    async def scenario() -> tuple[bool, bool, GenerateResult]:
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health_generate", lambda request: web.Response())
        if version is not None:
            app.router.add_get(
                "/server_info", lambda request: web.json_response({"version": version})
            )
        if abort_status is not None:
            app.router.add_post("/abort_request", abort)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            request = GenerateRequest("r1", [1, 2, 3, 4], {"max_new_tokens": 10})
            async with SGLangHTTPEngine([f"http://127.0.0.1:{port}"]) as engine:
                running = asyncio.ensure_future(engine.generate(request))
                await arrived.wait()
                first, second = await engine.hand_over("r1"), await engine.hand_over("r1")
                release.set()
                return first, second, await running
        finally:
            await runner.cleanup()

    first, second, answer = asyncio.run(scenario())
    return first, second, answer, len(aborts)


@pytest.mark.parametrize(
    ("version", "abort_status", "said", "aborts"),
    [
        # A proxy that serves /generate alone.
        ("0.5.6", None, "has no /abort_request", 0),
        # SGLang 0.5.3 answers a queued request's abort with no output_ids; 0.4.6's
        # /generate then hangs: neither is asked.
        ("0.5.3", 200, "reports SGLang 0.5.3", 0),
        ("0.4.6", 200, "reports SGLang 0.4.6", 0),
        # A server that says no version (and is no router) is not trusted with it.
        (None, 200, "reports SGLang no version", 0),
        # SGLang 0.5.23 with --admin-api-key refuses the worker's key.
        ("0.5.23", 401, "refuses /abort_request (HTTP 401", 1),
    ],
)
def test_a_server_that_cannot_hand_over_is_asked_no_more_and_its_answer_runs_on(
    caplog: pytest.LogCaptureFixture,
    version: str | None,
    abort_status: int | None,
    said: str,
    aborts: int,
) -> None:
    """The engine says why once, asks that server no more, and the answer runs to its
    end untouched (the old code asked a 0.5.3 server, whose empty reply then marked it
    down and re-ran the prompt from scratch)."""
    with caplog.at_level(logging.WARNING):
        first, second, answer, reached = ask_a_fake_server_twice(version, abort_status)
    assert not first and not second
    assert not answer.handed_over and answer.output_ids == [7, 2]
    assert reached == aborts
    warned = [m for m in caplog.messages if said in m]
    assert len(warned) == 1, caplog.messages


@dataclass
class Fleet:
    url: str
    r: redis.Redis
    spec: jobspec.JobSpec
    slow: StandinHandle
    fast: StandinHandle
    slow_worker: Worker
    slow_metrics_port: int


@contextmanager
def slow_then_fast(
    tmp_path: Path,
    slow_env: dict[str, str] | None = None,
    **slow_standin: Any,
) -> Iterator[Fleet]:
    """A slow server's worker alone first, then a 40x faster one's; yields once the slow
    worker has measured its speed on 8 warm-up answers (the first two chunks, started
    together) and runs long answers (30 s each there, 0.75 s on the fast server), with
    the fast worker started."""
    short = [f"[answer-length 40] Warm-up question {i}." for i in range(8)]
    long = [f"[answer-length 1500] Long question {i}." for i in range(24)]
    standin = {"answer_length_from_prompt": True, "continuations_dir": str(tmp_path / "cont")}
    with (
        running_redis(tmp_path / "redis") as redis_server,
        run_standin(
            max_running_requests=8, decode_tokens_per_s=50, **standin, **slow_standin
        ) as slow,
        run_standin(max_running_requests=16, decode_tokens_per_s=2000, **standin) as fast,
    ):
        url = redis_server.url
        r = redis.Redis.from_url(url)
        spec = enqueue_prompts(url, tmp_path, short + long, chunk_size=4, max_new_tokens=2000)
        common = ["--engine", "sglang", "--jobs", "g"]
        port = free_port()
        slow_args = [*common, "--max-inflight", "8", "--server", slow.url,
                     "--metrics-port", str(port)]  # fmt: skip
        with Worker(url, tmp_path, *slow_args, env=slow_env) as slow_worker:
            wait_for(lambda: slow.stats()["completed"] >= 8 and slow.stats()["running"] == 8,
                     timeout=120, what="the slow worker to run long answers")  # fmt: skip
            with Worker(url, tmp_path, *common, "--server", fast.url):
                yield Fleet(url, r, spec, slow, fast, slow_worker, port)
            assert "leaving the last prompts of" in slow_worker.log()


@pytest.mark.slow
def test_a_slow_worker_hands_its_running_answers_to_a_faster_one(tmp_path: Path) -> None:
    """Once both speeds are known the slow worker leaves the job's end and hands its
    running long answers over as the fast server's slots fall idle; the fast one
    continues them. Every prompt answered once, each moved answer equal token for token
    to the answer one server gives, nothing thrown away."""
    with slow_then_fast(tmp_path) as fleet:
        wait_for(lambda: all_generated(fleet.r, fleet.spec), timeout=240, what="the job")
        got = results(fleet.r, "g")
        assert sorted(x.id for x in got) == sorted(enqueued_ids(fleet.r, "g"))
        moved = [x for x in got if x.resumed_tokens]
        assert moved, "no answer was handed over"
        slow, fast = fleet.slow.stats(), fleet.fast.stats()
        assert slow["moved_total"] >= len(moved)
        samples = scrape(fleet.slow_metrics_port)
        # Each hand-over the worker counts is an abort the server made: of a running
        # answer, or of a request the abort reached before it took a slot.
        aborts = slow["moved_total"] + slow["moved_waiting_total"]
        assert value(samples, "regen_generate_handed_over_answers_total") == aborts, slow
        assert value(samples, "regen_generate_handed_over_tokens_total") == sum(
            x.resumed_tokens for x in moved
        )
        assert slow["aborted_total"] == 0 and fast["aborted_total"] == 0
        for x in moved:
            assert len(x.output_ids) == 1501 and x.completion_tokens == 1501
            assert x.prompt_tokens == len(x.prompt_ids)
            # One answer to the prompt: what a server gives it from scratch.
            body = {"input_ids": x.prompt_ids, "sampling_params": x.sampling, "rid": f"{x.id}-x"}
            assert fleet.fast.generate(body).json()["output_ids"] == x.output_ids
        report = reconcile(fleet.r, fleet.spec, None, read_shards=False)
        assert report.places["in_flight"] == len(got) and not report.problem_counts


@pytest.mark.slow
def test_an_abort_on_an_answers_last_step_ends_it_and_every_record_is_one_answer(
    tmp_path: Path,
) -> None:
    """The slow server lands half its aborts on an answer's last step, three tokens a
    step (speculative decoding): the reply carries the end of turn, and tokens past it,
    with finish "abort". The worker settles those answers as ended instead of moving
    them: every prompt once, no answer with an end token before its last or more than
    its budget, each one what a server gives it whole. The old code resumed past the
    end: an end of turn inside the answer, then more."""
    with slow_then_fast(tmp_path, abort_on_last_step=0.5, tokens_per_step=3) as fleet:
        wait_for(lambda: all_generated(fleet.r, fleet.spec), timeout=240, what="the job")
        got = results(fleet.r, "g")
        assert sorted(x.id for x in got) == sorted(enqueued_ids(fleet.r, "g"))
        slow = fleet.slow.stats()
        assert slow["moved_at_end_total"] >= 1, slow
        ends = request_end_ids(fleet.spec.end_token_ids, fleet.spec.sampling)
        assert ends, "the job spec names its end tokens"
        budget = fleet.spec.sampling["max_new_tokens"]
        for x in got:
            assert misplaced_end(x.output_ids, ends) is None, x.id
            assert len(x.output_ids) <= budget and x.output_ids[-1] in ends
            body = {"input_ids": x.prompt_ids, "sampling_params": x.sampling, "rid": f"{x.id}-x"}
            assert fleet.fast.generate(body).json()["output_ids"] == x.output_ids


@pytest.mark.slow
def test_a_worker_killed_holding_an_answer_so_far_loses_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    """SIGKILL at the worst point: an answer handed over (the slow server stopped it),
    its answer so far only in the dead worker's memory. The chunk comes back when its
    lease lapses and the fast worker runs that prompt again from the start: every
    prompt generated exactly once, nothing lost."""
    env = {"REGEN_CRASHPOINT": BEFORE_SEND_ON}
    with slow_then_fast(tmp_path, slow_env=env) as fleet:
        wait_for(lambda: fleet.slow.stats()["moved_total"] >= 1, timeout=120,
                 what="the slow worker to hand an answer over")  # fmt: skip
        wait_for(lambda: fleet.slow_worker.process.poll() is not None, timeout=30,
                 what="the slow worker to die at the crash point")  # fmt: skip
        wait_for(lambda: all_generated(fleet.r, fleet.spec), timeout=240, what="the job")
        got = results(fleet.r, "g")
        assert sorted(x.id for x in got) == sorted(enqueued_ids(fleet.r, "g"))
        # Nothing was given on with an answer so far: the worker died first.
        assert not any(x.resumed_tokens for x in got)
        report = reconcile(fleet.r, fleet.spec, None, read_shards=False)
        assert report.places["in_flight"] == len(got) and not report.problem_counts
