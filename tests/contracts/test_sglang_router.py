"""regen behind SGLang's own router: the real `sglang-router` binary in front of stand-ins.

The router's error bodies are taken from the router itself, so a change in how it reports
a dead worker fails here rather than in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import redis
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from regen.cli_status import verify
from regen.common import dlq, keys
from regen.consumers.generate.engine import PromptRejected
from regen.consumers.generate.engines.admission_policy import AdmissionPolicy, parse_metrics
from regen.consumers.generate.engines.sglang_http import SGLangHTTPEngine
from regen.consumers.generate.engines.sglang_replies import Failure, classify_error
from regen.consumers.generate.engines.sglang_router import (
    RouterError,
    parse_worker_list,
    router_worker_urls,
)
from tests.ops.test_metrics import scrape
from tests.support.generate_harness import Worker, enqueue_prompts, result_ids
from tests.support.helpers import committed_count, wait_for
from tests.support.sglang_standin.process import StandinHandle, free_port, run_standin

# The console script next to this Python (a venv run without activation), else on PATH.
ROUTER_BIN = shutil.which("sglang-router", path=str(Path(sys.executable).parent)) or shutil.which(
    "sglang-router"
)
needs_router = pytest.mark.skipif(
    ROUTER_BIN is None,
    reason="the sglang-router binary is not installed (pip install sglang-router; "
    "it is in the dev extra)",
)


class Router:
    """`sglang-router launch` as a subprocess on free ports, its log in a file."""

    def __init__(self, worker_urls: list[str], log_dir: Path, *flags: str) -> None:
        assert ROUTER_BIN is not None
        port, self.prometheus_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"router-{port}.log"
        argv = [ROUTER_BIN, "launch", "--worker-urls", *worker_urls, "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-port", str(self.prometheus_port),
                "--log-level", "warn", *flags]  # fmt: skip
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=30.0, trust_env=False)

    def healthy_workers(self) -> int:
        """How many workers the router counts healthy (0 until it serves)."""
        assert self.process.poll() is None, self.log_path.read_text(errors="replace")
        with contextlib.suppress(httpx.TransportError):
            response = self.http.get("/readiness")
            return int(response.json().get("healthy_workers", 0))
        return 0

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def run_router(workers: list[StandinHandle], log_dir: Path, *flags: str) -> Iterator[Router]:
    """A router in front of `workers`, returned once it counts all of them healthy."""
    router = Router([w.url for w in workers], log_dir, "--policy", "cache_aware", *flags)
    try:
        wait_for(lambda: router.healthy_workers() == len(workers), timeout=60,
                 what="the router to register its workers")  # fmt: skip
        yield router
    finally:
        router.close()


@contextlib.contextmanager
def two_servers_behind_a_router(
    log_dir: Path,
) -> Iterator[tuple[StandinHandle, StandinHandle, Router]]:
    with run_standin() as a, run_standin() as b, run_router([a, b], log_dir) as router:
        yield a, b, router


# --- what regen makes of the router's own errors -------------------------------------------
# Bodies as sglang-router 0.3.2 sends them (docs/design/sglang.md, "Behind SGLang's router").
UPSTREAM_500 = (
    b'{"error":{"type":"Internal Server Error","code":"call_upstream_request_error",'
    b'"message":"error sending request for url (http://w1:30000/generate)."}}'
)
NO_WORKERS_503 = (
    b'{"error":{"type":"Service Unavailable","code":"no_available_workers",'
    b'"message":"No available workers (all circuits open or unhealthy)"}}'
)


@pytest.mark.parametrize(
    ("status", "body"),
    [(500, UPSTREAM_500), (503, NO_WORKERS_503),
     (504, b'{"error":{"code":"call_upstream_timeout","message":"timed out"}}')],
)  # fmt: skip
def test_a_router_that_reached_no_worker_is_a_down_gateway_not_a_bad_answer(
    status: int, body: bytes
) -> None:
    failure = classify_error(status, body, "http://router:30000")
    assert isinstance(failure, Failure)
    assert (failure.kind, failure.down, failure.bad) == ("gateway", True, False)


def test_a_workers_own_answer_passed_through_the_router_keeps_its_meaning() -> None:
    overloaded = b'{"object":"error","message":"queue full","type":"503","code":503}'
    assert classify_error(503, overloaded, "r").kind == "overloaded"  # type: ignore[union-attr]
    relayed = b'{"error":{"code":"call_upstream_status_error","message":"HTTP 500"}}'
    assert classify_error(500, relayed, "r").kind == "server_error"  # type: ignore[union-attr]
    too_long = b'{"error":{"message":"The input (400 tokens) is longer than the model\'s"}}'
    assert isinstance(classify_error(400, too_long, "r"), PromptRejected)


def test_a_worker_list_names_each_server_once() -> None:
    # --dp-aware lists one entry per data-parallel rank (observed with 0.3.2).
    ranks = b'{"workers":[{"url":"http://h:1@1"},{"url":"http://h:1@0"},{"url":"http://g:2"}]}'
    assert parse_worker_list(ranks, "r") == ["http://h:1", "http://g:2"]
    assert parse_worker_list(b'{"urls":["http://h:1","http://g:2"]}', "r") == [
        "http://h:1",
        "http://g:2",
    ]
    with pytest.raises(RouterError, match="not a worker list"):
        parse_worker_list(b'{"workers": "none"}', "r")


# --- the real router ---------------------------------------------------------------------
@pytest.mark.slow
@needs_router
def test_the_router_lists_its_servers_and_a_server_is_no_router(tmp_path: Path) -> None:
    with two_servers_behind_a_router(tmp_path) as (a, b, router):
        assert sorted(asyncio.run(router_worker_urls(router.url))) == sorted([a.url, b.url])
        with pytest.raises(RouterError, match="not SGLang's router"):
            asyncio.run(router_worker_urls(a.url))
        router.close()
        with pytest.raises(RouterError, match="cannot ask"):
            asyncio.run(router_worker_urls(router.url, timeout_s=5))


@pytest.mark.slow
@needs_router
def test_auto_reads_the_metrics_of_the_servers_behind_the_router(tmp_path: Path) -> None:
    """The router's port has no /metrics: `--max-inflight auto` reads its servers'."""
    with two_servers_behind_a_router(tmp_path) as (_, _, router):
        assert router.http.get("/metrics").status_code == 404

        async def read() -> tuple[int, bytes]:
            async with SGLangHTTPEngine([router.url], admission=AdmissionPolicy()) as engine:
                (server,) = engine.servers()
                return await engine.read_metrics(server)

        status, body = asyncio.run(read())
        assert status == 200
        running = [
            sample.labels
            for family in text_string_to_metric_families(body.decode())
            for sample in family.samples
            if sample.name == "sglang:num_running_reqs"
        ]
        assert len(running) == 2  # one reading per server behind the router
        assert parse_metrics(body.decode()).running == 0


@pytest.mark.slow
@needs_router
def test_a_router_with_its_only_server_dead_is_a_down_gateway(tmp_path: Path) -> None:
    with (
        run_standin() as server,
        # Health checks every second, so the router notices the death within the test.
        run_router([server], tmp_path, "--health-check-interval-secs", "1") as router,
    ):
        server.kill()
        body = {"input_ids": [1, 2], "rid": "x", "sampling_params": {"max_new_tokens": 4}}
        reply = router.http.post("/generate", json=body)
        failure = classify_error(reply.status_code, reply.content, router.url)
        assert isinstance(failure, Failure), reply.text
        assert (failure.kind, failure.down, failure.bad) == ("gateway", True, False), reply.text
        wait_for(lambda: router.healthy_workers() == 0, timeout=30, what="the router to notice")

        async def engine_health() -> bool:
            async with SGLangHTTPEngine([router.url]) as engine:
                return await engine.health()

        # regen's probe (/health_generate) follows the router's view of its workers.
        assert asyncio.run(engine_health()) is False


@pytest.mark.slow
@needs_router
@pytest.mark.parametrize(
    "router_retries",
    # The router's own retries hide a dead worker from regen; without them regen sees
    # its in-flight requests fail and retries them itself.
    [True, False],
    ids=["router-retries", "regen-retries"],
)
def test_a_server_killed_behind_the_router_loses_and_dead_letters_nothing(
    redis_url: str, r: redis.Redis, tmp_path: Path, router_retries: bool
) -> None:
    prompts = [f"Question {i} about glaciers" for i in range(40)]
    enqueue_prompts(redis_url, tmp_path, prompts, chunk_size=4)
    out = tmp_path / "out"
    metrics_port = free_port()
    slow = {"decode_tokens_per_s": 20, "output_len_dist": "uniform:min=10,max=40"}
    with (
        run_standin(**slow) as a,
        run_standin(**slow) as doomed,
        # Prompts sharing a chat template prefix all go to the server holding it until
        # the load gap passes --balance-abs-threshold (64 by default): a small one
        # spreads them, as the README advises.
        run_router([a, doomed], tmp_path, "--balance-abs-threshold", "2",
                   *([] if router_retries else ["--disable-retries"])) as router,
        Worker(redis_url, tmp_path, "--engine", "sglang", "--server", router.url, "--jobs", "g",
               "--max-inflight", "8", "--metrics-port", str(metrics_port)) as generate,
        Worker(redis_url, tmp_path, "--out", str(out), "--shard-rows", "5", "--idle-commit",
               "0.3", "--min-free-mb", "0", kind="tokenize") as tokenize,
    ):  # fmt: skip

        def both_served_and_doomed_busy() -> bool:
            doomed_stats = doomed.stats()
            return (
                a.stats()["completed"] > 0
                and doomed_stats["completed"] > 0
                and (doomed_stats["inflight"] > 0)
            )

        wait_for(both_served_and_doomed_busy, timeout=120,
                 what="both servers to have answered and the doomed one to be busy")  # fmt: skip
        assert len(result_ids(r, "g")) < len(prompts), "the job finished before the kill"
        doomed.kill()  # SIGKILL, with requests in flight on it

        def committed() -> int:
            exits = [generate.process.poll(), tokenize.process.poll()]
            assert exits == [None, None], f"a worker exited: {exits}"
            return committed_count(r, "g")

        wait_for(lambda: committed() == len(prompts) and not r.hlen(keys.KOMBU_UNACKED),
                 timeout=240, what="every prompt committed after the kill")  # fmt: skip
        failures = {
            dict(labels)["kind"]: count
            for (name, labels), count in scrape(metrics_port).items()
            if name == "regen_sglang_server_failures_total"
        }
    # A worker lost behind the router is an outage, never a bad answer that counts
    # towards giving a prompt up.
    assert not {"server_error", "bad_response"} & set(failures), failures
    if not router_retries:  # the kill reached regen, as the router's "no worker" answer
        assert failures.get("gateway", 0) > 0, failures
    result = CliRunner().invoke(verify, ["--redis-url", redis_url, "--job", "g", "--json"])
    assert result.exit_code == 0, result.output
    report = orjson.loads(result.output)
    assert report["ok"] and report["enqueued"] == len(prompts)
    # Every prompt in a shard; none dead-lettered, missing, waiting or in flight.
    assert {place: n for place, n in report["places"].items() if n} == {"done": len(prompts)}
    assert dlq.count(r, "g", "generate") == dlq.count(r, "g", "tokenize") == 0
