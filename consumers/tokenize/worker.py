"""`regen worker tokenize`: run a tokenize consumer until SIGTERM/SIGINT, then commit."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from regen.common import connection, gc_tuning
from regen.common.heartbeat import Heartbeat, RateMeter, worker_name
from regen.consumers.tokenize.consumer import TokenizeConsumer, TokenizeOptions
from regen.consumers.tokenize.job_folder import is_bucket
from regen.consumers.tokenize.metrics import tokenize_metrics

log = logging.getLogger("regen.tokenize")


def run_worker(
    redis_url: str | None, options: TokenizeOptions, metrics_port: int | None = None
) -> None:
    """`metrics_port`: serve Prometheus metrics there; None: no metrics endpoint."""
    url = connection.resolve_url(redis_url)
    r = connection.client(url)
    r.ping()  # a refused login or no Redis fails here, before any thread starts
    name = worker_name("tokenize")
    consumer = TokenizeConsumer(r, options, name)
    stop = threading.Event()
    # First signal: commit open shards and exit (a warm stop). Unacked results of a
    # harder stop are simply read again by the next consumer.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tokens = RateMeter()
    last_total = [0]

    def snapshot() -> dict[str, Any]:
        total = sum(w.counters.tokens for w in consumer.state.writers.values())
        tokens.add(total - last_total[0])
        last_total[0] = total
        return {
            "kind": "tokenize",
            "out_dir": str(options.out_dir)
            if is_bucket(options.out_dir)
            else str(Path(options.out_dir).resolve()),
            "paused_for_disk": consumer.state.paused_for_disk,
            "free_bytes": consumer.state.free_bytes,
            "tokens_per_s": tokens.rate(),
            "behind": dict(consumer.state.behind),
            "jobs": {
                job: {**w.counters.__dict__, "open_rows": w.open_rows}
                for job, w in consumer.state.writers.items()
            },
        }

    heartbeat = Heartbeat(r, name, snapshot)
    metrics = None
    if metrics_port is not None:
        metrics = tokenize_metrics(name, url, consumer.state)
        metrics.serve(metrics_port)
    heartbeat.start()
    log.info(
        "tokenize worker %s writing to %s, Redis %s", name, options.out_dir, connection.redact(url)
    )
    gc_tuning.tune_for_throughput()
    try:
        consumer.run(stop)
    finally:
        heartbeat.stop()
        if metrics is not None:
            metrics.close()
