"""The generate worker's Prometheus metrics: its progress and its engine's view of each
server, read from its state at scrape time, and how its deliveries ended, counted from
their hooks (chunk_life/hooks.py; common/metrics.py serves them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regen.common.metrics import WorkerMetrics
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import Delivery, DeliveryEnd, DeliveryEvent


class GenerateCollector(Collector):
    """A generate worker's progress and its engine's view of each server."""

    def __init__(self, ctx: ChunkContext, engine_healthy: Callable[[], bool]) -> None:
        self._ctx = ctx
        self._engine_healthy = engine_healthy

    def collect(self) -> Iterator[Metric]:
        ctx = self._ctx
        counters = (
            ("regen_generate_prompts",
             "Prompts generated and handed to the tokenize stage by this worker.",
             ctx.prompts),
            ("regen_generate_output_tokens",
             "Tokens generated (completion tokens) in the prompts handed off.",
             ctx.tokens),
            ("regen_generate_handed_over_answers",
             "Running answers this worker handed over to faster servers, which continue "
             "them (docs/design/placement.md, A slow server's last answers move).",
             ctx.handed_over),
            ("regen_generate_handed_over_tokens",
             "Output tokens the answers handed over had decoded here (kept, not lost).",
             ctx.handed_over_tokens),
            ("regen_generate_restarted_answers",
             "Running answers this worker stopped and gave back to start again, their decode "
             "thrown away (a drain or pause where an answer could not move).",
             ctx.restarted),
        )  # fmt: skip
        for name, documentation, meter in counters:
            yield CounterMetricFamily(name, documentation, value=meter.total)
        yield GaugeMetricFamily(
            "regen_generate_inflight_prompts",
            "Prompts of the chunks this worker holds that are not finished yet.",
            value=ctx.inflight,
        )
        yield GaugeMetricFamily(
            "regen_generate_engine_healthy",
            "1 while the engine has a healthy server, i.e. the worker consumes chunks.",
            value=int(self._engine_healthy()),
        )
        stats = ctx.runner.engine.stats()
        servers = stats.get("servers", [])
        yield from _server_metrics(servers)
        # The in-process SGLang engine is one server of its own, named by its model.
        caches = [(s["url"], s) for s in servers] or (
            [(stats["model"], stats)] if "cache_hit_rate" in stats else []
        )
        yield from _cache_metrics(caches)
        yield from _affinity_metrics(stats.get("affinity"))


def _server_metrics(servers: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per-server series from the SGLang engine's stats (other engines have no servers)."""
    if not servers:
        return
    labels = ["server"]
    healthy = GaugeMetricFamily(
        "regen_sglang_server_healthy",
        "1 when the server passed its last health probe.",
        labels=labels,
    )
    inflight = GaugeMetricFamily(
        "regen_sglang_server_inflight",
        "Requests this worker has in flight on the server.",
        labels=labels,
    )
    limit = GaugeMetricFamily(
        "regen_sglang_server_inflight_limit",
        "Requests this worker may keep in flight on the server (fixed, or moved by "
        "--max-inflight auto); `reason` says why it last moved.",
        labels=["server", "reason"],
    )
    completed = CounterMetricFamily(
        "regen_sglang_server_requests_completed", "Requests the server completed.", labels=labels
    )
    failures = CounterMetricFamily(
        "regen_sglang_server_failures",
        "Failed requests by kind (each is retried; only a refusal dead-letters a prompt).",
        labels=["server", "kind"],
    )
    for server in servers:
        url = server["url"]  # redacted by the engine: no credentials reach the metrics
        healthy.add_metric([url], int(server["healthy"]))
        inflight.add_metric([url], server["inflight"])
        limit.add_metric([url, server.get("limit_reason", "")], server["max_inflight"])
        completed.add_metric([url], server["completed"])
        for kind, count in sorted(server["failures_by_kind"].items()):
            failures.add_metric([url, kind], count)
    yield from (healthy, inflight, limit, completed, failures)


def _cache_metrics(caches: list[tuple[str, dict[str, Any]]]) -> Iterator[Metric]:
    """Prefix-cache hits per server (engines/cache_tally.py), from `(server, stats)`."""
    if not caches:
        return
    labels = ["server"]
    prompt_tokens = CounterMetricFamily(
        "regen_sglang_server_prompt_tokens",
        "Prompt tokens of the completions that reported meta_info.cached_tokens.",
        labels=labels,
    )
    cached_tokens = CounterMetricFamily(
        "regen_sglang_server_cached_tokens",
        "Of those prompt tokens, the ones the server took from its prefix cache.",
        labels=labels,
    )
    hit_rate = GaugeMetricFamily(
        "regen_sglang_server_cache_hit_rate",
        "cached_tokens / prompt_tokens so far; absent until the server reports cached_tokens.",
        labels=labels,
    )
    for url, cache in caches:
        prompt_tokens.add_metric([url], cache["prompt_tokens"])
        cached_tokens.add_metric([url], cache["cached_tokens"])
        if cache["cache_hit_rate"] is not None:
            hit_rate.add_metric([url], cache["cache_hit_rate"])
    yield from (prompt_tokens, cached_tokens, hit_rate)


def _affinity_metrics(affinity: dict[str, int] | None) -> Iterator[Metric]:
    """How often a conversation's next turn went to the server of its last one."""
    if affinity is None:
        return
    requests = CounterMetricFamily(
        "regen_sglang_affinity_requests",
        "Requests with an affinity key (turns of a conversation): `kept` went to the key's "
        "last server, `moved` found it down, backing off or full and went elsewhere.",
        labels=["outcome"],
    )
    for outcome in ("kept", "moved"):
        requests.add_metric([outcome], affinity[outcome])
    yield requests


# A failed delivery goes back to the queue as a returned one does (tasks.py).
_LABELS = {
    DeliveryEnd.ACKED: "acked",
    DeliveryEnd.RETURNED: "returned",
    DeliveryEnd.FAILED: "returned",
    DeliveryEnd.DROPPED: "dropped",
}


class ChunkOutcomes:
    """Counts how this worker's deliveries ended (the delivery's AFTER_END hook)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.chunks = Counter(
            "regen_generate_chunks",
            "Chunk deliveries this worker ended: acked (every prompt handed off or "
            "dead-lettered), returned (given back to the queue: a drain, the engine stayed "
            "unavailable, or an error), or dropped (another delivery holds the chunk).",
            ["outcome"],
            registry=registry,
        )
        self.dead_lettered = Counter(
            "regen_generate_dead_lettered_prompts",
            "Prompts this worker dead-lettered: refused by a healthy server, or of a chunk "
            "past its attempts.",
            registry=registry,
        )
        for outcome in _LABELS.values():
            self.chunks.labels(outcome)

    def on_end(self, delivery: Delivery, **_: object) -> None:
        self.chunks.labels(_LABELS[delivery.end]).inc()
        self.dead_lettered.inc(delivery.dead_lettered)


def generate_metrics(
    name: str, redis_url: str, ctx: ChunkContext, engine_healthy: Callable[[], bool]
) -> WorkerMetrics:
    metrics = WorkerMetrics(name, "generate", redis_url)
    metrics.add(GenerateCollector(ctx, engine_healthy))
    outcomes = ChunkOutcomes(metrics.registry)
    ctx.hooks.subscribe(DeliveryEvent.AFTER_END, outcomes.on_end)
    metrics.on_close(lambda: ctx.hooks.unsubscribe(DeliveryEvent.AFTER_END, outcomes.on_end))
    return metrics
