"""Real SGLang versions and launch flags (docs/design/sglang.md, "SGLang contract"): 0.5.6's
retraction gauge, a server without `--enable-metrics`, and one started with
`--skip-tokenizer-init`, each against replies shaped as those versions shape them (the
stand-in's `retraction_metric`, `no_metrics` and `skip_tokenizer_init` options)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common.backoff import Backoff
from regen.common.chat_family import detect_family, render_prompt_ids
from regen.common.record import build_record
from regen.consumers.generate.engine import GenerateRequest, GenerateResult
from regen.consumers.generate.engines.admission_policy import (
    AdmissionController,
    AdmissionPolicy,
    ServerLoad,
    parse_metrics,
)
from regen.consumers.generate.engines.sglang_admission import AdmissionPoller
from regen.consumers.generate.engines.sglang_http import SGLangHTTPEngine
from regen.consumers.generate.engines.sglang_pool import ServerPool, ServerState
from regen.consumers.generate.job_chat import JobChat
from tests.common.test_record import IM_END, THINK_END, ids, make_ctx, make_result
from tests.generate.test_admission import SGLANG_METRICS, Clock
from tests.generate.test_sglang_inprocess_engine import build, offline_sglang  # noqa: F401 (a fixture)
from tests.generate.test_sglang_inprocess_engine import request as inprocess_request
from tests.generate.test_turns_stage import (
    ANSWER,
    TURNS,
    by_turn,
    enqueue,
    tokenize,
    verified,
    worker,
)
from tests.support.generate_harness import all_generated, results
from tests.support.helpers import wait_for
from tests.support.sglang_standin import run_standin

# What SGLang 0.5.6 serves: the retraction gauge, no counter (prometheus_client's text).
SGLANG_056_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 20.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.9
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="m"} 800.0
# HELP sglang:num_retracted_reqs The number of retracted requests.
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{model_name="m"} RETRACTED
"""


def metrics_056(retracted: int) -> str:
    return SGLANG_056_METRICS.replace("RETRACTED", f"{retracted}.0")


# --- 0.5.6: retractions only as a gauge ----------------------------------------------------


def test_the_056_gauge_is_read_and_the_counter_wins_where_both_are() -> None:
    load = parse_metrics(metrics_056(3))
    assert (load.retracted_total, load.retracted_lately) == (None, 3)
    both = SGLANG_METRICS + 'sglang:num_retracted_reqs{model_name="m"} 2.0\n'
    assert (parse_metrics(both).retracted_total, parse_metrics(both).retracted_lately) == (7, 2)


def gauge_reading(clock: Clock, retracted: float, **load: Any) -> bool:
    """One reading from a 0.5.6 server, whose retraction news is the gauge's value."""
    clock.now += 1.0
    load.setdefault("running", clock.controller.limit)
    reading = ServerLoad(queued=0, token_usage=0.5, gen_throughput=1000.0,
                         retracted_lately=retracted, **load)  # fmt: skip
    return clock.controller.observe(reading, clock.controller.limit, clock.now)


def test_a_056_server_retracting_backs_off_as_a_0523_one_does() -> None:
    c = AdmissionController(AdmissionPolicy(fixed=200))
    clock = Clock(c)
    assert not c.observe(ServerLoad(running=150, queued=0, retracted_lately=0), 10, 1.0)
    clock.now = 1.0
    assert gauge_reading(clock, 3, running=150)
    assert c.limit == 170 and c.reason == "back off: retracted 3"
    # The gauge back at 0 (no retraction since the last stats log): growth resumes.
    for _ in range(2):
        assert not gauge_reading(clock, 0)
    assert gauge_reading(clock, 0)
    assert c.limit == 178 and c.reason.startswith("grow")


def test_a_gauge_is_a_current_count_and_a_counter_a_total() -> None:
    """The same numbers mean different things: a counter standing at 5 says nothing
    happened since the last reading; a gauge standing at 5 says the last stats log saw
    a pass retract 5."""
    counter, gauge = AdmissionController(AdmissionPolicy()), AdmissionController(AdmissionPolicy())
    for now in (1.0, 2.0):
        counter.observe(ServerLoad(running=100, queued=0, retracted_total=5), 256, now)
        gauge.observe(ServerLoad(running=100, queued=0, retracted_lately=5), 256, now)
    assert not counter.reason.startswith("back off")
    assert gauge.reason == "back off: retracted 5"


def pool_of(*urls: str) -> ServerPool:
    async def probe(server: ServerState) -> bool:
        return True

    return ServerPool(list(urls), 32, probe, health_interval_s=10,
                      overload_backoff=Backoff(0.1, 1))  # fmt: skip


def test_the_poller_backs_a_056_server_off_on_its_gauge() -> None:
    async def run() -> None:
        pool = pool_of("http://old:1")
        (server,) = pool.servers
        replies = iter([metrics_056(0), metrics_056(4)])

        async def fetch(s: ServerState) -> tuple[int, bytes]:
            return 200, next(replies).encode()

        poller = AdmissionPoller(pool, AdmissionPolicy(fixed=32), fetch)
        server.inflight = 10  # a limit not in use does not grow
        assert not await poller.poll_once(server)
        server.inflight = 32
        assert await poller.poll_once(server)
        assert (server.cap, server.limit_reason) == (28, "back off: retracted 4")

    asyncio.run(run())


# --- no --enable-metrics: said once, loudly -------------------------------------------------


def test_missing_metrics_are_warned_once_naming_the_server_and_the_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="regen.consumers.generate.engines.sglang_admission")

    async def run() -> None:
        pool = pool_of("http://plain:1", "http://steered:1")
        plain, steered = pool.servers
        replies = {plain: [(404, b"")] * 4, steered: [(200, SGLANG_METRICS.encode())]}
        replies[plain] += [(200, SGLANG_METRICS.encode()), (404, b"")]

        async def fetch(server: ServerState) -> tuple[int, bytes]:
            return replies[server].pop(0)

        poller = AdmissionPoller(pool, AdmissionPolicy(fixed=32), fetch)
        await poller.poll_once(steered)
        for _ in range(4):  # the first reading, then the re-asks every 30 s
            await poller.poll_once(plain)
        assert (plain.cap, plain.limit_reason) == (32, "fixed: no /metrics (HTTP 404)")
        (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert warning.getMessage() == (
            "http://plain:1 has no usable /metrics (HTTP 404; SGLang serves them only when "
            "started with --enable-metrics): --max-inflight auto cannot steer there and keeps "
            "the fixed limit of 32 in flight, asking again every 30 s"
        )
        # Restarted with --enable-metrics, then without: news again, said again.
        plain.inflight = 32
        await poller.poll_once(plain)
        assert plain.limit_reason == "grow: queue short"
        await poller.poll_once(plain)
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2

    asyncio.run(run())


def test_a_server_without_metrics_is_asked_again_every_30_s_until_it_has_them() -> None:
    async def run() -> list[float]:
        pool = pool_of("http://plain:1")
        (server,) = pool.servers
        server.healthy = True
        replies = [(404, b""), (404, b""), (200, SGLANG_METRICS.encode()), (200, b"")]
        slept: list[float] = []

        async def fetch(s: ServerState) -> tuple[int, bytes]:
            return replies.pop(0)

        async def sleep(seconds: float) -> None:  # the fake clock: no time passes
            slept.append(seconds)
            if not replies:
                raise asyncio.CancelledError

        poller = AdmissionPoller(pool, AdmissionPolicy(), fetch, sleep=sleep)
        poller.start()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.gather(*poller._tasks)
        return slept

    assert asyncio.run(run()) == [1.0, 30.0, 30.0, 1.0, 30.0]


# --- the stand-in in each shape, through the real HTTP engine -------------------------------


def test_the_standin_serves_each_versions_shape() -> None:
    with (
        run_standin(retraction_metric="gauge") as old,
        run_standin(retraction_metric="counter") as new,
    ):
        old_text, new_text = old.get("/metrics").text, new.get("/metrics").text
    assert "sglang:num_retracted_reqs" in old_text
    assert "sglang:num_retracted_requests_total" not in old_text
    assert "sglang:num_retracted_requests_total" in new_text
    assert "sglang:num_retracted_reqs{" not in new_text
    assert parse_metrics(old_text).retracted_lately == 0


def test_a_server_without_metrics_or_text_serves_and_is_never_marked_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="regen.consumers.generate.engines.sglang_admission")
    request = GenerateRequest("r-1", [1, 2, 3, 4], {"max_new_tokens": 8})

    async def run(url: str) -> list[GenerateResult]:
        async with SGLangHTTPEngine([url], admission=AdmissionPolicy(fixed=16),
                                    admission_poll_s=0.05) as engine:  # fmt: skip
            done = [await engine.generate(request) for _ in range(3)]
            (server,) = engine.servers()
            while not server.limit_reason.startswith("fixed: no /metrics"):
                await asyncio.sleep(0.05)
            assert server.healthy and not server.failures
            return done

    with run_standin(no_metrics=True, skip_tokenizer_init=True) as server:
        assert server.get("/metrics").status_code == 404
        raw = server.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        assert "text" not in raw.json() and raw.json()["output_ids"]
        done = asyncio.run(run(server.url))
        assert server.stats()["status_200"] == 4  # one try each: no retries
    assert all(result.text is None and result.output_ids for result in done)
    (warning,) = caplog.records
    assert warning.levelno == logging.WARNING and server.url in warning.getMessage()


@pytest.mark.usefixtures("offline_sglang")
def test_the_in_process_engine_started_with_skip_tokenizer_init_serves_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = build(monkeypatch, sglang_args={"skip_tokenizer_init": True})

    async def once() -> GenerateResult:
        try:
            return await engine.generate(inprocess_request(1))
        finally:
            await engine.close()

    result = asyncio.run(once())
    assert result.text is None and result.output_ids
    assert result.completion_tokens == len(result.output_ids)


# --- --skip-tokenizer-init: the stages decode the ids ---------------------------------------


def test_a_record_without_server_text_is_the_record_with_it(kimi_tokenizer: Any) -> None:
    ctx = make_ctx(kimi_tokenizer)
    output = ids(kimi_tokenizer, "Let me think.", THINK_END, "The answer is 4.", IM_END)
    with_text = make_result(ctx, output)
    without = make_result(ctx, output)
    without.text = None
    assert build_record(without, ctx) == build_record(with_text, ctx)
    assert build_record(without, ctx)["messages"][-1]["content"] == "The answer is 4."


def test_the_next_turns_history_reads_an_answer_without_text(kimi_tokenizer: Any) -> None:
    chat = JobChat(kimi_tokenizer, detect_family(kimi_tokenizer), {})
    prompt = render_prompt_ids(kimi_tokenizer, [{"role": "user", "content": "2+2?"}], {})
    output = ids(kimi_tokenizer, "Adding.", THINK_END, "4.", IM_END)
    finish = {"type": "stop", "matched": IM_END}
    text = kimi_tokenizer.decode(output[:-1], skip_special_tokens=True)
    sampling = {"max_new_tokens": 32}

    def answer(text: str | None) -> dict[str, Any]:
        result = GenerateResult(output, text, finish, len(prompt), len(output))
        return chat.answer(prompt, result, None, sampling, record_id="c-0")

    assert answer(None) == answer(text) == {
        "role": "assistant", "content": "4.", "reasoning_content": "Adding.",
    }  # fmt: skip


@pytest.mark.slow
def test_turns_all_against_a_server_that_sends_no_text(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, kimi_tokenizer: Any
) -> None:
    spec = enqueue(redis_url, tmp_path, kimi_tokenizer_dir, "bare").spec
    with (
        run_standin(tokenizer=str(kimi_tokenizer_dir), trust_remote_code=True, think=True,
                    output_len_dist=ANSWER, skip_tokenizer_init=True) as server,
        worker(redis_url, tmp_path, server),
    ):  # fmt: skip
        wait_for(lambda: all_generated(r, spec), timeout=120, what="every turn generated")
    sent = {res.id: res for res in results(r, "bare")}
    assert len(sent) == TURNS and all(res.text is None for res in sent.values())
    found = tokenize(r, tmp_path / "out", "bare", TURNS)
    assert set(found) == set(sent)
    for record in found.values():
        assert record["input_ids"] == sent[record["id"]].prompt_ids + sent[record["id"]].output_ids
        assert record["drift"] is False
    turns = by_turn(found)
    (conversation,) = {cid for cid, turn in turns if turn == 2}
    for turn in (1, 2):
        answer = turns[conversation, turn - 1]["messages"][-1]
        assert answer["reasoning_content"] and answer["content"].strip()
        assert turns[conversation, turn]["messages"][-3] == answer  # the decoded answer
    assert verified(redis_url, "bare", tmp_path / "out")["ok"]
