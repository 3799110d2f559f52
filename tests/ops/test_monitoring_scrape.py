"""A real Prometheus (Debian's binary) scrapes a small running job, with the scrape jobs of
deploy/monitoring/prometheus.yaml pointed at it on loopback: every dashboard panel's
query and every metric an alert rule reads returns series. A panel or rule that names a
metric nobody exports fails here."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import yaml

from regen.common import jobspec, keys
from regen.common.celery_app import make_app
from regen.producer.enqueue import Enqueuer
from regen.producer.spec import JobOptions, prepare_job
from tests.ops.test_monitoring import MONITORING, dashboard
from tests.support.generate_harness import REPO, Worker
from tests.support.helpers import wait_for, write_jsonl
from tests.support.redis_server import RedisServer
from tests.support.sglang_standin.process import free_port, run_standin

PROMETHEUS = shutil.which("prometheus")
JOB = "watched"
PROMPTS = [f"Tell me fact number {i} about the sea." for i in range(10)]
# Refused by the stand-in's context (300 tokens): a generate dead letter.
LONG_PROMPT = "Please repeat: " + "words " * 400
# No prompt in it: an input dead letter of no prompt.
BAD_ROW = {"nothing": "here"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus is not installed (Debian: apt-get install prometheus; .ci/run does)",
    ),
]


def prometheus_config(targets: dict[str, str]) -> dict[str, Any]:
    """deploy/monitoring/prometheus.yaml with each scrape job's targets replaced by the
    loopback address of its process here, scraping every second."""
    config: dict[str, Any] = yaml.safe_load((MONITORING / "prometheus.yaml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(MONITORING / path) for path in config["rule_files"]]
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    assert {job["job_name"] for job in config["scrape_configs"]} == set(targets)
    return config


class Prometheus:
    def __init__(self, config: dict[str, Any], folder: Path) -> None:
        assert PROMETHEUS is not None
        path = folder / "prometheus.yaml"
        path.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "prometheus.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [PROMETHEUS, f"--config.file={path}", f"--storage.tsdb.path={folder / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(
            f"{self.url}/api/v1/query", params={"query": expr}, timeout=10, trust_env=False
        )
        body = response.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2, trust_env=False).is_success
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


# --- the expressions ----------------------------------------------------------------------

# Words in PromQL that are neither metrics nor labels.
_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "bool", "offset"}
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\([^)]*\)")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(?![A-Za-z0-9_:])\s*(\{[^}]*\})?(?!\s*\()")


def selectors(expr: str) -> list[str]:
    """Every vector selector in a PromQL expression (metric name and its matchers)."""
    expr = _GROUPING.sub("", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    found = []
    for match in _SELECTOR.finditer(expr):
        name = match.group(1)
        start = match.start()
        if name in _KEYWORDS or (start and expr[start - 1] in '{,=~!"'):
            continue
        if re.fullmatch(r"[0-9.e]+", name):
            continue
        found.append(name + (match.group(2) or ""))
    return found


def test_selectors_are_picked_out_of_an_expression() -> None:
    expr = (
        'sum by (job) (regen_job_prompts{place=~"waiting|in_flight"}) > 0\nand on (job)\n'
        'increase(regen_job_committed_prompts_total[5m]) == 0 or up{job="x"} == 0'
    )
    assert selectors(expr) == [
        'regen_job_prompts{place=~"waiting|in_flight"}',
        "regen_job_committed_prompts_total",
        'up{job="x"}',
    ]


def alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


# --- the job ------------------------------------------------------------------------------


def enqueue(url: str, tmp: Path) -> None:
    rows = [{"prompt": p} for p in [*PROMPTS, LONG_PROMPT]] + [BAD_ROW]
    path = write_jsonl(tmp / f"{JOB}.jsonl", rows)
    prepared = prepare_job(JobOptions(job=JOB, model="smollm2", max_new_tokens=48, chunk_size=4))
    r = redis.Redis.from_url(url)
    jobspec.save(r, prepared.spec)
    Enqueuer(r, make_app(url), prepared, high_water=10_000).run([path])


def finished(r: redis.Redis) -> bool:
    places = sum(r.hlen(keys.dlq(JOB, stage)) for stage in ("generate",))
    committed = int(r.hget(keys.job_counters(JOB), keys.COMMITTED_PROMPTS) or 0)
    return committed == len(PROMPTS) and places == 1 and not r.xlen(keys.results_stream(JOB))


@pytest.fixture(scope="module")
def prometheus(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """A finished job whose workers, job metrics and server still run, scraped by a real
    Prometheus."""
    url = redis_server.url.rsplit("/", 1)[0] + "/5"  # a database of its own
    r = redis.Redis.from_url(url)
    r.flushdb()
    tmp = tmp_path_factory.mktemp("monitoring-scrape")
    enqueue(url, tmp)
    # A worker that died: its heartbeat stays, stale (the "worker gone" alert reads it).
    dead = {"kind": "generate", "host": "gone-host", "last_seen": time.time() - 3600,
            "queues": []}  # fmt: skip
    r.hset(keys.WORKERS, "generate@gone-host:1", orjson.dumps(dead))
    ports = {name: free_port() for name in ("generate", "tokenize", "metrics")}
    with run_standin(context_length=300, output_len_dist="uniform:min=5,max=30") as server:
        generate = Worker(url, tmp, "--engine", "sglang", "--server", server.url, "--jobs", JOB,
                          "--metrics-port", str(ports["generate"]))  # fmt: skip
        tokenize = Worker(url, tmp, "--out", str(tmp / "out"), "--min-free-mb", "0",
                          "--shard-rows", "4", "--idle-commit", "0.3",
                          "--metrics-port", str(ports["tokenize"]), kind="tokenize")  # fmt: skip
        metrics_log = open(tmp / "metrics.log", "wb")  # noqa: SIM115 (closed below)
        metrics = subprocess.Popen(
            [sys.executable, "-m", "regen", "metrics", "serve", "--redis-url", url,
             "--host", "127.0.0.1", "--port", str(ports["metrics"]), "--refresh", "1"],
            cwd=REPO, stdout=metrics_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        prom = None
        try:
            wait_for(lambda: finished(r), timeout=180, what="the job to finish")
            targets = {
                "regen-generate": f"127.0.0.1:{ports['generate']}",
                "regen-tokenize": f"127.0.0.1:{ports['tokenize']}",
                "regen-metrics": f"127.0.0.1:{ports['metrics']}",
                "sglang": server.url.removeprefix("http://"),
            }
            prom = Prometheus(prometheus_config(targets), tmp)
            wait_for(prom.ready, what="Prometheus ready")
            yield prom
        finally:
            if prom is not None:
                prom.stop()
            metrics.send_signal(signal.SIGTERM)
            metrics.wait(timeout=60)
            metrics_log.close()
            tokenize.stop()
            generate.stop()


def returns_series(prom: Prometheus, exprs: list[str]) -> list[str]:
    """The expressions that return nothing once the scrapes have had time to come in:
    polled until all return series or the wait ends (a rate needs two scrapes)."""
    missing: list[str] = []

    def none_missing() -> bool:
        missing[:] = [e for e in exprs if not prom.query(e)]
        if missing:
            time.sleep(1)  # the next scrape: no use asking again sooner
        return not missing

    with contextlib.suppress(AssertionError):  # the caller shows which are missing
        wait_for(none_missing, timeout=60, what="every query to return series")
    return missing


def test_every_scrape_target_is_up(prometheus: Prometheus) -> None:
    wait_for(lambda: len(prometheus.query("up == 1")) == 4, what="all four targets up")


def test_every_dashboard_panel_query_returns_series(prometheus: Prometheus) -> None:
    exprs = [
        target["expr"].replace("$job", JOB)
        for panel in dashboard()["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]
    assert returns_series(prometheus, exprs) == []


def test_every_metric_an_alert_reads_returns_series(prometheus: Prometheus) -> None:
    exprs = [s for expr in alert_exprs().values() for s in selectors(expr)]
    assert len(exprs) >= len(alert_exprs())
    assert returns_series(prometheus, exprs) == []


def test_the_job_metrics_say_the_job_is_done(prometheus: Prometheus) -> None:
    # Prometheus started after the job finished, and nothing else reads the job metrics:
    # each scrape of them reads the finished job. Wait for the first to be stored (its
    # `up` sample lands with its series, in one commit).
    wait_for(
        lambda: bool(prometheus.query('up{job="regen-metrics"} == 1')),
        what="a scrape of the job metrics",
    )

    def value(expr: str) -> float:
        (sample,) = prometheus.query(expr)
        return float(sample["value"][1])

    assert value(f'regen_job_prompts{{job="{JOB}", place="done"}}') == len(PROMPTS)
    assert value(f'regen_job_prompts{{job="{JOB}", place="dead_lettered"}}') == 1
    assert value(f'regen_job_prompts_enqueued{{job="{JOB}"}}') == len(PROMPTS) + 1
    assert value(f'regen_job_remaining_shard_bytes{{job="{JOB}"}}') == 0
    assert value(f'regen_job_eta_seconds{{job="{JOB}"}}') == 0
    assert value('regen_workers{host="gone-host", state="stale"}') == 1
    # The job's own `job` label survives the scrape (honor_labels), `up` keeps the scrape job's.
    assert value(f'regen_job_shards{{job="{JOB}"}}') >= 3
