"""The tokenize consumer's Prometheus metrics, read from its state at scrape time
(common/metrics.py serves them)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regen.common.metrics import WorkerMetrics
from regen.consumers.tokenize.consumer import ConsumerState


class TokenizeCollector(Collector):
    """A tokenize consumer's records, shards and dead letters per job, and its disk guard."""

    def __init__(self, state: ConsumerState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state
        # The consumer thread adds writers while we read: copy first (atomic in CPython).
        writers = dict(state.writers)
        job = ["job"]
        records = CounterMetricFamily(
            "regen_tokenize_records_written",
            "Records written into shard files, including any dropped before the commit (an "
            "abandoned shard, or ids another shard committed first).",
            labels=job,
        )
        tokens = CounterMetricFamily(
            "regen_tokenize_record_tokens", "Tokens (prompt + completion) in them.", labels=job
        )
        duplicates = CounterMetricFamily(
            "regen_tokenize_duplicates", "Results dropped as already in a shard.", labels=job
        )
        shards = CounterMetricFamily(
            "regen_tokenize_shards_committed", "Shards renamed into place.", labels=job
        )
        dead = CounterMetricFamily(
            "regen_tokenize_dead_lettered",
            "Results dead-lettered by a record check, by reason.",
            labels=["job", "reason"],
        )
        open_rows = GaugeMetricFamily(
            "regen_tokenize_open_shard_rows", "Records in the shard being written.", labels=job
        )
        for name, writer in sorted(writers.items()):
            counters = writer.counters
            records.add_metric([name], counters.records)
            tokens.add_metric([name], counters.tokens)
            duplicates.add_metric([name], counters.duplicates)
            shards.add_metric([name], counters.shards)
            for reason, count in sorted(dict(counters.by_reason).items()):
                dead.add_metric([name, reason], count)
            open_rows.add_metric([name], writer.open_rows)
        yield from (records, tokens, duplicates, shards, dead, open_rows)
        yield GaugeMetricFamily(
            "regen_tokenize_paused_for_disk",
            "1 while writing is paused because the shard disk is short of space.",
            value=int(state.paused_for_disk),
        )
        yield GaugeMetricFamily(
            "regen_tokenize_free_disk_bytes",
            "Free bytes on the shard disk at the last check.",
            value=state.free_bytes,
        )


def tokenize_metrics(name: str, redis_url: str, state: ConsumerState) -> WorkerMetrics:
    metrics = WorkerMetrics(name, "tokenize", redis_url)
    metrics.add(TokenizeCollector(state))
    return metrics
