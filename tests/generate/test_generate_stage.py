"""The generate stage: real Celery workers driving the SGLang engine against stand-ins."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
import redis

from regen.common import dlq, jobspec, keys
from tests.support.generate_harness import (
    PROMPTS,
    Worker,
    all_acked,
    all_generated,
    deaths_until_dead_lettered,
    enqueue_prompts,
    enqueued_ids,
    result_ids,
    results,
)
from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import run_standin

pytestmark = pytest.mark.slow


def http_worker(url: str, tmp_path: Path, *servers: str, options: tuple[str, ...] = ()) -> Worker:
    """A worker with the SGLang HTTP engine on these stand-ins, serving job "g"."""
    server_args = [arg for server in servers for arg in ("--server", server)]
    return Worker(url, tmp_path, "--engine", "sglang", *server_args, "--jobs", "g", *options)


def test_results_are_exactly_the_servers_output(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS)
    with (
        run_standin() as server,
        http_worker(redis_url, tmp_path, server.url),
    ):
        wait_for(
            lambda: all_generated(r, spec),
            timeout=120,
            what="all chunks generated and acked",
        )
        beats = r.hgetall(keys.WORKERS)
        got = results(r, "g")
        expected = [server_output(server, res.prompt_ids, spec) for res in got]
    assert len(got) == len(PROMPTS)
    for result, want in zip(got, expected, strict=True):
        assert result.output_ids == want["output_ids"]
        assert result.text == want["text"]
        assert result.finish_reason == want["meta_info"]["finish_reason"]
        assert result.server == server.url
    assert beats and all(b"generate@" in name for name in beats)


def server_output(server: object, prompt_ids: list[int], spec: jobspec.JobSpec) -> dict:
    response = server.generate({"input_ids": prompt_ids, "sampling_params": spec.sampling})  # type: ignore[attr-defined]
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]


def test_transient_failures_are_retried(redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS)
    with (
        run_standin(fault=("500:2", "503:3", "drop:2")) as server,
        http_worker(redis_url, tmp_path, server.url),
    ):
        wait_for(
            lambda: all_generated(r, spec),
            timeout=180,
            what="all results despite injected faults",
        )
        stats = server.stats()
    assert dlq.count(r, "g", "generate") == 0
    served = sum(v for k, v in stats.items() if k.startswith("fault_"))
    assert served >= 7, stats


def test_a_prompt_too_long_for_the_server_is_dead_lettered_alone(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    long_prompt = "Please repeat: " + "words " * 400
    spec = enqueue_prompts(redis_url, tmp_path, [*PROMPTS[:5], long_prompt])
    with (
        run_standin(context_length=300) as server,
        http_worker(redis_url, tmp_path, server.url),
    ):
        wait_for(
            lambda: all_acked(r, spec) and len(result_ids(r, "g")) == 5,
            timeout=120,
            what="the chunk to finish",
        )
    (letter,) = list(dlq.entries(r, "g", "generate"))
    assert letter.reason == "rejected_by_server"
    assert "context length" in letter.message.lower() or "longer" in letter.message.lower()
    assert letter.payload["messages"][-1]["content"] == long_prompt  # as written
    assert letter.prompt_id not in result_ids(r, "g")


def test_a_server_that_dies_and_returns_pauses_the_worker_without_dead_letters(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS * 1 + [p + "?" for p in PROMPTS])
    with (
        run_standin(decode_tokens_per_s=40) as server,
        http_worker(redis_url, tmp_path, server.url) as worker,
    ):
        wait_for(lambda: len(result_ids(r, "g")) >= 2, timeout=120, what="first results")
        server.kill()
        # Requests in flight fail and the worker stops taking chunks until it is back.
        wait_for(
            lambda: "engine is UNHEALTHY" in worker.log(), timeout=60, what="the worker to pause"
        )
        assert worker.process.poll() is None
        server.restart()
        wait_for(
            lambda: all_generated(r, spec),
            timeout=240,
            what="the run to finish after the restart",
        )
    assert dlq.count(r, "g", "generate") == 0


def test_two_servers_share_the_load_and_one_dying_shifts_it(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    prompts = [f"Question {i} about rivers" for i in range(40)]
    spec = enqueue_prompts(redis_url, tmp_path, prompts)
    with (
        run_standin(decode_tokens_per_s=60, max_running_requests=4) as a,
        run_standin(decode_tokens_per_s=60, max_running_requests=4) as b,
        http_worker(redis_url, tmp_path, a.url, b.url, options=("--max-inflight", "4")),
    ):
        wait_for(lambda: len(result_ids(r, "g")) >= 8, timeout=120, what="first results")
        served = {res.server for res in results(r, "g")}
        assert served == {a.url, b.url}, served
        b.kill()
        wait_for(
            lambda: all_generated(r, spec),
            timeout=240,
            what="the survivor to finish the job",
        )
        stats_a = a.stats()
    assert dlq.count(r, "g", "generate") == 0
    assert stats_a["peak_running"] <= 4
    late = results(r, "g")[-5:]
    assert all(res.server == a.url for res in late)


def test_a_worker_killed_mid_chunk_has_its_chunk_redelivered(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS[:8], chunk_size=8)
    with run_standin(decode_tokens_per_s=30) as server:
        doomed = http_worker(redis_url, tmp_path, server.url)
        wait_for(lambda: len(result_ids(r, "g")) >= 1, timeout=120, what="a first result")
        doomed.kill()
        assert len(result_ids(r, "g")) < 8, "the chunk finished before the kill"
        with http_worker(redis_url, tmp_path, server.url):
            wait_for(
                lambda: all_generated(r, spec),
                timeout=180,
                what="the redelivered chunk to finish",
            )
    assert dlq.count(r, "g", "generate") == 0


def test_a_poison_chunk_is_dead_lettered_after_max_attempts(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(
        redis_url, tmp_path, ["POISON: this prompt kills the engine"], chunk_size=1
    )
    env = {"REGEN_TEST_POISON": "POISON"}
    args = ["--engine", "tests.support.poison_engine:make", "--jobs", "g", "--max-attempts", "3"]
    deaths = deaths_until_dead_lettered(r, "g", lambda: Worker(redis_url, tmp_path, *args, env=env))
    (letter,) = list(dlq.entries(r, "g", "generate"))
    assert letter.reason == "poison_chunk"
    assert deaths == 3 and len(letter.history) == 4
    wait_for(lambda: all_acked(r, spec), timeout=30, what="the poison chunk to be acked")


def test_a_long_outage_gives_chunks_back_without_spending_attempts(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS[:8], chunk_size=4)
    with (
        run_standin(decode_tokens_per_s=20) as server,
        http_worker(redis_url, tmp_path, server.url, options=("--max-attempts", "1")) as worker,
    ):
        wait_for(lambda: len(result_ids(r, "g")) >= 1, timeout=120, what="first results")
        server.kill()
        # Longer than the give-back point (3/4 of the visibility timeout).
        wait_for(lambda: "giving it back" in worker.log(), timeout=60, what="a chunk given back")
        server.restart()
        wait_for(
            lambda: all_generated(r, spec),
            timeout=240,
            what="the run to finish after the outage",
        )
    # With --max-attempts 1 any counted failure would have dead-lettered the chunk.
    assert dlq.count(r, "g", "generate") == 0
    # An outage gives back every chunk held: one line each, not a chained traceback each.
    assert "direct cause" not in worker.log()


def test_a_warm_shutdown_finishes_what_it_holds_and_loses_nothing(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    # More prompts than it may hold (4 slots and a slack of 2 take ~2 chunks of 4), so
    # most are still on the queue when it stops (flow_control.py).
    prompts = [f"Tell me fact number {i} about the sun." for i in range(40)]
    spec = enqueue_prompts(redis_url, tmp_path, prompts, chunk_size=4)
    with run_standin(decode_tokens_per_s=40) as server:
        worker = http_worker(redis_url, tmp_path, server.url, options=("--max-inflight", "4"))
        wait_for(lambda: len(result_ids(r, "g")) >= 1, timeout=120, what="first results")
        worker.stop()  # SIGTERM: stop taking chunks, finish (or return) those held
        assert worker.process.returncode == 0, worker.log()
        assert r.hlen("unacked") == 0, "a held chunk was neither finished nor returned"
        finished = result_ids(r, "g")
        assert finished and finished < enqueued_ids(r, "g"), "it kept taking chunks"
        with http_worker(redis_url, tmp_path, server.url):
            wait_for(
                lambda: all_generated(r, spec),
                timeout=180,
                what="the rest after the restart",
            )
    assert dlq.count(r, "g", "generate") == 0


def test_auto_in_flight_finishes_a_kv_bound_job_and_its_heartbeat_shows_the_moved_limit(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    """`--max-inflight auto` against a server whose KV budget holds ~5 of these answers:
    the limit starts at 256, the first prompts the worker starts (more than 5) outgrow the
    budget as they decode, the server retracts, the limit comes down, and every prompt
    still arrives exactly once.

    Every answer is 100 tokens, so retractions do not hang on timing: each wave of
    prompts the worker starts outgrows the budget as it decodes, again and again while
    the job runs (the first /metrics reading only sets the controller's baseline)."""
    prompts = [f"[answer-length 100] Question {i} about the tides" for i in range(24)]
    spec = enqueue_prompts(redis_url, tmp_path, prompts, max_new_tokens=100)

    def backed_off() -> list[tuple[int, str]]:
        """The heartbeat's limits that a back-off set."""
        limits = [
            (server["max_inflight"], server["limit_reason"])
            for raw in r.hvals(keys.WORKERS)
            for server in orjson.loads(raw).get("engine_stats", {}).get("servers", [])
        ]
        return [(limit, why) for limit, why in limits if why.startswith("back off")]

    standin = {"decode_step_s": 0.03, "kv_budget_tokens": 600, "answer_length_from_prompt": True}
    auto = ["--engine", "sglang", "--max-inflight", "auto", "--jobs", "g"]
    with (
        run_standin(**standin) as server,
        Worker(
            redis_url, tmp_path, *auto, "--server", server.url, env={"REGEN_HEARTBEAT_STALE_S": "4"}
        ) as worker,
    ):
        wait_for(lambda: all_generated(r, spec), timeout=180, what="all chunks generated and acked")
        # A heartbeat every ~1.3 s: the one after the back-off shows it.
        wait_for(backed_off, timeout=30, what="a backed-off limit in the heartbeat")
        moved = backed_off()
        stats = server.stats()
        first_move = re.search(r"in-flight limit of \S+: (\d+) \((.*)\)", worker.log())
    assert dlq.count(r, "g", "generate") == 0
    assert result_ids(r, "g") == enqueued_ids(r, "g")
    assert len(results(r, "g")) == len(prompts)  # none twice in the stream
    assert stats["retracted_total"] > 0 and stats["peak_running"] < len(prompts)
    # The limit started at the fixed 256: its first move is a back-off to 85% of that.
    assert first_move is not None
    assert int(first_move[1]) == 217 and first_move[2].startswith("back off: retracted")
    assert all(limit < 256 and "retracted" in why for limit, why in moved), moved
