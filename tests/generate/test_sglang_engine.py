"""The SGLang HTTP engine against real stand-in server processes (and the stand-in itself).

Every failure here is a real one: HTTP errors the stand-in was told to return, sockets
it closed, processes killed with SIGKILL. Tests wait on conditions with deadlines,
never on sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from regen.consumers.generate.engine import (
    EngineDown,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    PromptRejected,
    server_rid,
)
from regen.consumers.generate.engines.sglang_http import SGLangHTTPEngine
from tests.support.sglang_standin import StandinHandle, run_standin, start_standin
from tests.support.sglang_standin.completer import Completer, load_tokenizer
from tests.support.sglang_standin.config import LengthDist
from tests.support.sglang_standin.process import free_port

pytestmark = pytest.mark.slow

# Short answers keep the file fast; the lognormal tail still varies lengths.
SHORT = "lognormal:mean=40,sigma=0.6,min=2,max=300"


@pytest.fixture(scope="module")
def standin() -> Iterator[StandinHandle]:
    """A shared stand-in: 4 slots + 4 queued, 1 s keep-alive, context 1024."""
    with run_standin(
        context_length=1024,
        max_running_requests=4,
        max_queued_requests=4,
        keep_alive_s=1.0,
        output_len_dist=SHORT,
    ) as handle:
        yield handle


@pytest.fixture
def server(standin: StandinHandle) -> StandinHandle:
    standin.fault(clear=True)
    return standin


@pytest.fixture(scope="module")
def tokenizer(standin: StandinHandle) -> Any:
    return load_tokenizer()  # the stand-in's own: its start cached the converted GGUF


def engine(*urls: str, **options: Any) -> SGLangHTTPEngine:
    """An engine tuned for tests: fast health probes and short backoffs."""
    settings: dict[str, Any] = dict(
        max_inflight_per_server=8, health_interval_s=0.3, backoff_base_s=0.02, backoff_max_s=0.3
    )
    return SGLangHTTPEngine(list(urls), **{**settings, **options})


def request(i: int, max_new_tokens: int = 200, length: int = 6) -> GenerateRequest:
    prompt = [(i * 7919 + k * 104729) % 40000 + 100 for k in range(length)]
    return GenerateRequest(f"req-{i}", prompt, {"max_new_tokens": max_new_tokens})


def expected(server: StandinHandle, req: GenerateRequest) -> dict[str, Any]:
    """What a stand-in answers for this prompt: a function of the prompt, tokenizer and
    length spread only, so the fast shared stand-in answers for the slow ones too."""
    body = {"input_ids": req.prompt_ids, "sampling_params": req.sampling, "rid": req.rid + "-x"}
    response = server.generate(body)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


async def until_async(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def assert_matches(result: GenerateResult, want: dict[str, Any], tokenizer: Any) -> None:
    assert result.output_ids == want["output_ids"]
    assert result.finish_reason == want["meta_info"]["finish_reason"]
    assert result.text == want["text"]
    body = result.output_ids[:-1] if result.finish_reason["type"] == "stop" else result.output_ids
    assert result.text == tokenizer.decode(body, skip_special_tokens=True)
    assert result.completion_tokens == len(result.output_ids)


# --- the stand-in itself ---------------------------------------------------------------


def test_standin_contract(server: StandinHandle, tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    prompt = [1, 9038, 2, 1, 4093, 198]
    out = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 500}}).json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
    } <= set(meta)
    # A stop keeps the matched token in output_ids and trims it from text.
    assert meta["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["output_ids"][-1] == eos and eos not in out["output_ids"][:-1]
    assert out["text"] == tokenizer.decode(out["output_ids"][:-1]) != ""
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (
        len(prompt),
        len(out["output_ids"]),
    )

    again = server.generate(
        {"input_ids": prompt, "rid": "other", "sampling_params": {"max_new_tokens": 500}}
    )
    assert again.json()["output_ids"] == out["output_ids"]  # deterministic, rid-independent

    capped = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}}).json()
    assert capped["output_ids"] == out["output_ids"][:3]
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    # No max_new_tokens: SGLang's default of 128.
    default = server.generate({"input_ids": prompt, "sampling_params": {"ignore_eos": True}}).json()
    assert len(default["output_ids"]) == 128 and eos not in default["output_ids"]

    stop_at = out["output_ids"][2]
    stopped = server.generate(
        {"input_ids": prompt, "sampling_params": {"stop_token_ids": [stop_at]}}
    ).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert stopped["output_ids"][-1] == stop_at and len(stopped["output_ids"]) <= 3

    batch = server.generate(
        {"input_ids": [prompt, [5, 6]], "sampling_params": {"max_new_tokens": 3}}
    )
    items = batch.json()
    assert len(items) == 2 and items[0]["output_ids"] == capped["output_ids"]
    bad_batch = server.generate({"input_ids": [prompt, [5, 10**9]]})
    assert bad_batch.status_code == 400 and "out of range" in bad_batch.json()["error"]["message"]
    assert server.generate({"input_ids": prompt, "stream": True}).status_code == 400

    info = server.get("/model_info").json()
    assert info["is_generation"] and info["model_path"] and info["tokenizer_path"]
    assert server.get("/server_info").json()["context_length"] == 1024
    metrics = server.get("/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "generation_tokens_total", "gen_throughput"):
        assert f"sglang:{name}{{" in metrics
    server.fault(healthy=False)
    assert server.get("/health_generate").status_code == 503
    server.fault(clear=True)
    assert server.get("/health").status_code == 200


def test_standin_lengths_follow_the_configured_spread(tokenizer: Any) -> None:
    def completer(spread: str, think: bool = False) -> Completer:
        return Completer(tokenizer, LengthDist.parse(spread), eos_id=None, think=think, seed=0)

    done = completer("fixed:n=10").complete([5, 6, 7], {"max_new_tokens": 100})
    assert len(done.output_ids) == 11 and done.output_ids[-1] == tokenizer.eos_token_id
    thinking = completer("fixed:n=200", think=True).complete([5], {"max_new_tokens": 999})
    assert "</think>" in thinking.text and not thinking.text.startswith("</think>")

    for spec in ("fixed:n=10", "uniform:min=3,max=9", "lognormal:mean=50,sigma=0.5"):
        assert LengthDist.parse(LengthDist.parse(spec).spec()) == LengthDist.parse(spec)
    spread = LengthDist.parse("lognormal:median=100,sigma=1.0,min=1,max=5000")
    lengths = sorted(spread.sample(random.Random(i)) for i in range(2000))
    median, p99 = lengths[1000], lengths[1980]
    assert 80 < median < 125 and p99 > 5 * median  # a long right tail, like real answers

    # A bench's prompt may ask for its length (its dataset's answer predicts it).
    asking = Completer(tokenizer, LengthDist.parse("fixed:n=10"), eos_id=None, think=False,
                       seed=0, length_from_prompt=True)  # fmt: skip
    prompt = tokenizer.encode("Explain it. [answer-length 37]", add_special_tokens=False)
    assert len(asking.complete(prompt, {"max_new_tokens": 100}).output_ids) == 38
    unasked = tokenizer.encode("Explain it.", add_special_tokens=False)
    assert len(asking.complete(unasked, {"max_new_tokens": 100}).output_ids) == 11


def test_standin_queue_full_and_context_length(server: StandinHandle) -> None:
    long_prompt = list(range(100, 1100))  # 1000 tokens, context 1024
    # Only an explicit max_new_tokens counts toward the context check, as in SGLang.
    assert server.generate({"input_ids": long_prompt}).status_code == 200
    too_long = server.generate(
        {"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 100}}
    )
    assert too_long.status_code == 400
    assert "maximum context length of 1024" in too_long.json()["error"]["message"]
    too_long = server.generate({"input_ids": list(range(100, 1124))})
    assert "longer than the model's context length" in too_long.json()["error"]["message"]

    async def fill_then_overflow() -> tuple[list[int], httpx.Response]:
        server.fault("delay", count=8, delay_s=1.0)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, trust_env=False) as client:
            held = [
                asyncio.create_task(client.post("/generate", json={"input_ids": [i + 5]}))
                for i in range(8)
            ]
            await until_async(
                lambda: (s := server.stats())["running"] == 4 and s["queued"] == 4,
                what="4 running + 4 queued",
            )
            overflow = await client.post("/generate", json={"input_ids": [3]})
            return [r.status_code for r in await asyncio.gather(*held)], overflow

    held, overflow = asyncio.run(fill_then_overflow())
    assert held == [200] * 8
    assert (
        overflow.status_code == 503 and overflow.json()["message"] == "The request queue is full."
    )
    stats = server.stats()
    assert stats["peak_running"] <= 4 and stats["busy_slot_s"] >= 4 * 1.0


# --- the engine --------------------------------------------------------------------------


def test_results_equal_the_servers_output_exactly(server: StandinHandle, tokenizer: Any) -> None:
    reqs = [request(i, max_new_tokens=[5, 60, 400][i % 3]) for i in range(30)]

    async def run() -> list[GenerateResult]:
        async with engine(server.url) as e:
            return await asyncio.gather(*(e.generate(r) for r in reqs))

    results = asyncio.run(run())
    for req, result in zip(reqs, results, strict=True):
        assert_matches(result, expected(server, req), tokenizer)
        assert result.server == server.url and result.prompt_tokens == len(req.prompt_ids)
        assert result.meta["id"] == server_rid(req.rid)  # the caller's rid, on a first try
    assert {r.finish_reason["type"] for r in results} == {"stop", "length"}


def test_injected_500_503_and_drops_are_retried(server: StandinHandle, tokenizer: Any) -> None:
    before = server.stats()
    for kind in ("500", "503", "drop", "malformed"):
        server.fault(kind, count=2)
    reqs = [request(100 + i) for i in range(6)]

    async def run() -> tuple[list[GenerateResult], dict[str, Any]]:
        async with engine(server.url, max_bad_answers=10) as e:
            return await asyncio.gather(*(e.generate(r) for r in reqs)), e.stats()

    results, stats = asyncio.run(run())
    for req, result in zip(reqs, results, strict=True):
        assert_matches(result, expected(server, req), tokenizer)
    after = server.stats()
    for kind in ("500", "503", "drop", "malformed"):
        assert after.get(f"fault_{kind}", 0) - before.get(f"fault_{kind}", 0) == 2
    failures = stats["servers"][0]["failures_by_kind"]
    assert failures["server_error"] == failures["overloaded"] == failures["disconnect"] == 2
    assert failures["bad_response"] == 2
    assert not after["pending_faults"]


def test_bad_answers_give_up_as_unavailable_not_rejected(server: StandinHandle) -> None:
    server.fault("malformed", count=3)

    async def run() -> None:
        async with engine(server.url, max_bad_answers=3) as e:
            await e.generate(request(7))

    with pytest.raises(EngineUnavailable, match="3 bad answers"):
        asyncio.run(run())


def test_too_long_prompt_is_rejected_while_others_succeed(server: StandinHandle) -> None:
    too_long = GenerateRequest("long", list(range(100, 1000)), {"max_new_tokens": 200})

    async def run() -> tuple[list[Any], dict[str, Any]]:
        async with engine(server.url) as e:
            jobs = [e.generate(request(200 + i)) for i in range(12)]
            jobs.insert(5, e.generate(too_long))
            return await asyncio.gather(*jobs, return_exceptions=True), e.stats()

    outcomes, stats = asyncio.run(run())
    rejected = outcomes.pop(5)
    assert isinstance(rejected, PromptRejected) and rejected.server == server.url
    assert "maximum context length of 1024" in rejected.message
    assert all(isinstance(o, GenerateResult) for o in outcomes)
    assert stats["servers"][0]["healthy"] and not stats["servers"][0]["failures_by_kind"]


def test_duplicate_rid_still_running_is_retried_with_a_new_rid(server: StandinHandle) -> None:
    server.fault("delay", count=1, delay_s=0.5)
    before = server.stats()

    async def run() -> tuple[GenerateResult, GenerateResult, dict[str, Any]]:
        async with engine(server.url) as e:
            first = asyncio.create_task(
                e.generate(GenerateRequest("dup", [11, 12], {"max_new_tokens": 9}))
            )
            await until_async(
                lambda: server.stats()["inflight"] == 1, what="first attempt on the server"
            )
            second = await e.generate(GenerateRequest("dup", [13, 14], {"max_new_tokens": 9}))
            return await first, second, e.stats()

    first, second, stats = asyncio.run(run())
    assert first.meta["id"] == "dup." and second.meta["id"] == "dup~1."
    assert stats["servers"][0]["failures_by_kind"] == {"duplicate_rid": 1}
    assert server.stats()["status_400"] == before.get("status_400", 0) + 1


def test_keepalive_connection_closed_by_idle_server_is_replaced(server: StandinHandle) -> None:
    async def run() -> list[int]:
        # Our pool keeps idle sockets 60 s; the stand-in closes them after 1 s (SGLang: 5 s).
        # No periodic probes, so nothing but the idle timeout touches the connections.
        async with engine(server.url, keepalive_expiry_s=60, health_interval_s=60) as e:
            await e.generate(request(300))
            opened = server.stats()["connections_total"]
            await until_async(lambda: server.stats()["open_connections"] == 0, what="idle close")
            await e.generate(request(301))
            return [opened, server.stats()["connections_total"]]

    opened, reopened = asyncio.run(run())
    assert reopened == opened + 1


def test_with_no_server_generate_gives_up_after_the_outage_limit() -> None:
    async def run() -> None:
        async with engine(f"http://127.0.0.1:{free_port()}", give_up_after_s=0.5) as e:
            assert not await e.health() and e.capacity() == 0 and e.healthy_servers() == []
            assert not await e.wait_until_healthy(0.2)
            with pytest.raises(EngineDown, match="no SGLang server healthy"):
                await e.generate(request(1))
            # The outage began at the first failed probe: a second request gives up at
            # once, and a per-call outage limit wins over the engine's.
            started = time.monotonic()
            with pytest.raises(EngineDown):
                await e.generate(request(2), outage_s=0.1)
            assert time.monotonic() - started < 0.5

    asyncio.run(run())


def test_a_busy_server_is_waited_out_past_the_outage_limit(server: StandinHandle) -> None:
    """One slot, taken by a 1.5 s answer: a second request with a 0.2 s outage limit
    waits for it rather than giving up, because the server is healthy."""

    async def run() -> int:
        async with engine(server.url, max_inflight_per_server=1) as e:
            assert await e.wait_until_healthy(10)
            server.fault("delay", count=1, delay_s=1.5)
            first = asyncio.ensure_future(e.generate(request(1)))
            await until_async(lambda: e.servers()[0].inflight == 1, what="first sent")
            second = await e.generate(request(2), outage_s=0.2)
            await first
            return second.completion_tokens

    assert asyncio.run(run()) > 0


def test_credentials_in_a_server_url_never_reach_logs_or_stats(
    server: StandinHandle, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = server.url.replace("http://", "http://user:s3cret@")

    async def run() -> tuple[GenerateResult, dict[str, Any]]:
        async with engine(url) as e:
            return await e.generate(request(3)), e.stats()

    result, stats = asyncio.run(run())
    assert result.server == stats["servers"][0]["url"] == url.replace("user:s3cret", "***")
    assert "HTTP Request" in caplog.text and "s3cret" not in caplog.text + repr(stats)


def test_killed_server_restarts_and_every_request_completes(
    server: StandinHandle, tokenizer: Any
) -> None:
    with run_standin(max_running_requests=4, decode_tokens_per_s=400, output_len_dist=SHORT) as s:
        reqs = [request(400 + i) for i in range(32)]

        async def run() -> tuple[list[GenerateResult], dict[str, Any]]:
            async with engine(s.url, max_inflight_per_server=4) as e:
                tasks = [asyncio.create_task(e.generate(r)) for r in reqs[:24]]
                await until_async(lambda: s.stats()["completed"] >= 6, what="some completions")
                s.kill()
                await until_async(lambda: not e.healthy_servers(), what="outage noticed")
                tasks += [asyncio.create_task(e.generate(r)) for r in reqs[24:]]
                assert not [t for t in tasks if t.done() and t.exception()], "a request failed"
                assert e.capacity() == 0
                # The new process answers /health_generate with 503 while "starting".
                await asyncio.to_thread(s.restart, startup_delay=1.0)
                return await asyncio.gather(*tasks), e.stats()

        results, stats = asyncio.run(run())
        for req, result in zip(reqs, results, strict=True):
            assert_matches(result, expected(server, req), tokenizer)
        assert stats["servers"][0]["healthy"]
        failures = stats["servers"][0]["failures_by_kind"]
        assert failures["disconnect"] >= 1 and failures["connect"] >= 1  # in flight, then new
        assert s.stats()["health_generate_503"] >= 1  # probed while starting, kept waiting


def test_two_servers_share_load_and_one_dying_shifts_it_all(
    server: StandinHandle, tokenizer: Any
) -> None:
    options: dict[str, Any] = dict(
        max_running_requests=4, decode_tokens_per_s=400, output_len_dist=SHORT
    )
    a, b = start_standin(**options), start_standin(**options)
    try:
        a.wait_ready()
        b.wait_ready()
        reqs = [request(500 + i) for i in range(48)]

        async def run() -> tuple[list[GenerateResult], dict[str, Any], dict[str, Any]]:
            async with engine(a.url, b.url, max_inflight_per_server=4) as e:
                tasks = [asyncio.create_task(e.generate(r)) for r in reqs]
                await until_async(
                    lambda: min(a.stats()["completed"], b.stats()["completed"]) >= 3,
                    what="both used",
                )
                a_stats = a.stats()
                a.kill()
                return await asyncio.gather(*tasks), a_stats, e.stats()

        results, a_stats, stats = asyncio.run(run())
        b_stats = b.stats()
        assert a_stats["peak_inflight"] <= 4 and b_stats["peak_inflight"] <= 4
        assert b_stats["peak_inflight"] == 4  # b was kept full, not trickled
        by_server = Counter(r.server for r in results)
        assert set(by_server) == {a.url, b.url} and by_server[b.url] > by_server[a.url]
        assert [s["healthy"] for s in stats["servers"]] == [False, True]
        for req, result in zip(reqs, results, strict=True):
            assert_matches(result, expected(server, req), tokenizer)
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_results_carry_the_servers_version_read_again_after_an_outage(tokenizer: Any) -> None:
    """Each result names the SGLang version its server reports; a server that comes back
    from an outage (a restart may be an upgrade) is asked again."""
    port = free_port()

    async def one(e: SGLangHTTPEngine, i: int) -> GenerateResult:
        return await e.generate(request(i, max_new_tokens=5))

    async def run() -> tuple[GenerateResult, GenerateResult]:
        async with engine(f"http://127.0.0.1:{port}") as e:
            with run_standin(port=port, output_len_dist=SHORT, version="0.5.6"):
                before = await one(e, 1)
            # Down: the engine's probes fail; then back as another version.
            await until_async(lambda: not e.stats()["servers"][0]["healthy"], what="down")
            with run_standin(port=port, output_len_dist=SHORT, version="0.5.23"):
                after = await one(e, 2)
            return before, after

    before, after = asyncio.run(run())
    assert (before.server_version, after.server_version) == ("0.5.6", "0.5.23")
