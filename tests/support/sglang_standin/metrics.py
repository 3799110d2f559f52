"""The stand-in's `GET /metrics`: SGLang's Prometheus names (python/sglang/srt/metrics/
collector.py, 0.5.x), rendered by prometheus_client so the text format is the real one.

Retractions: SGLang exposes the gauge `sglang:num_retracted_reqs` (requests retracted by
the last retracting pass, as of its last decode-stats log, which zeroes it) and (0.5.23,
not 0.5.6) the counter `sglang:num_retracted_requests_total`. Both are here unless
`--retraction-metric` names one (0.5.6: `gauge`). Without the batch model nothing
is ever retracted and token usage is 0.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tests.support.sglang_standin.scheduler import Scheduler


class SchedulerCollector(Collector):
    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self._scheduler = scheduler
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._scheduler
        batch = s.batch.stats if s.batch else None
        gauges = {
            "num_running_reqs": ("The number of running requests.", s.running),
            "num_queue_reqs": ("The number of requests in the waiting queue.", s.queued),
            "token_usage": ("The token usage.", s.batch.token_usage() if s.batch else 0.0),
            "gen_throughput": (
                "The generation throughput (token/s).",
                batch.gen_throughput if batch else s.throughput(),
            ),
        }
        retraction = self._scheduler.config.retraction_metric
        if retraction != "counter":
            gauges["num_retracted_reqs"] = (
                "The number of retracted requests.",
                batch.retracted_logged if batch else 0,
            )
        counters = {
            "prompt_tokens": ("Number of prefill tokens processed.", "prompt_tokens_total"),
            "generation_tokens": (
                "Number of generation tokens processed.",
                "generation_tokens_total",
            ),
        }
        for name, (doc, value) in gauges.items():
            yield self._family(GaugeMetricFamily, name, doc, value)
        for name, (doc, counter) in counters.items():
            yield self._family(CounterMetricFamily, name, doc, s.counters[counter])
        if retraction != "gauge":
            yield self._family(
                CounterMetricFamily,
                "num_retracted_requests",
                "Total number of retracted requests.",
                batch.retracted_total if batch else 0,
            )

    def _family(self, kind: type[Metric], name: str, doc: str, value: float) -> Metric:
        family = kind(f"sglang:{name}", doc, labels=["model_name"])
        family.add_metric([self._model_name], float(value))  # type: ignore[attr-defined]
        return family


def metrics_registry(scheduler: Scheduler, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(scheduler, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
