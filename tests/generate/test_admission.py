"""`--max-inflight auto`: the admission controller's decisions, and reading SGLang's
/metrics text (pure logic: no server, no worker)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from regen.common import defaults
from regen.common.backoff import Backoff
from regen.consumers.generate.engines.admission_policy import (
    AdmissionController,
    AdmissionPolicy,
    MetricsUnavailable,
    ServerLoad,
    parse_metrics,
)
from regen.consumers.generate.engines.sglang_admission import AdmissionPoller
from regen.consumers.generate.engines.sglang_pool import ServerPool, ServerState

# What SGLang 0.5 serves (two data-parallel ranks), as prometheus_client renders it.
SGLANG_METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",dp_rank="0"} 100.0
sglang:num_running_reqs{model_name="m",dp_rank="1"} 50.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",dp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="m",dp_rank="1"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",dp_rank="0"} 0.5
sglang:token_usage{model_name="m",dp_rank="1"} 0.8
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="m",dp_rank="0"} 1000.0
sglang:gen_throughput{model_name="m",dp_rank="1"} 500.0
# HELP sglang:num_retracted_requests_total Total number of retracted requests.
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="m",dp_rank="0"} 7.0
sglang:num_retracted_requests_total{model_name="m",dp_rank="1"} 0.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 12345.0
"""


def test_sglang_metrics_add_up_over_ranks_and_usage_is_the_fullest() -> None:
    load = parse_metrics(SGLANG_METRICS)
    assert load == ServerLoad(
        running=150,
        queued=5,
        token_usage=0.8,
        gen_throughput=1500,
        generated_total=12345,
        retracted_total=7,
    )


@pytest.mark.parametrize(
    "text",
    [
        "<html>404 Not Found</html>",
        "# TYPE router_requests counter\nrouter_requests_total 3\n",  # not SGLang's names
        'sglang:num_running_reqs{model_name="m"} 1.0\n',  # no queue length
    ],
)
def test_metrics_that_cannot_steer_are_refused(text: str) -> None:
    with pytest.raises(MetricsUnavailable):
        parse_metrics(text)


class Clock:
    """Feeds readings to a controller, one poll interval apart."""

    def __init__(self, controller: AdmissionController) -> None:
        self.controller = controller
        self.now = 0.0
        self.generated = 0.0
        self.retracted = 0.0

    def read(self, inflight: int | None = None, **load: Any) -> bool:
        self.now += 1.0
        self.retracted += load.pop("retracted", 0)
        load.setdefault("queued", 0)
        load.setdefault("token_usage", 0.5)
        load.setdefault("gen_throughput", 1000.0)
        load.setdefault("running", self.controller.limit)
        reading = ServerLoad(retracted_total=self.retracted, **load)
        limit = self.controller.limit
        return self.controller.observe(reading, limit if inflight is None else inflight, self.now)

    def settle(self, **load: Any) -> None:
        """Readings with our in-flight at the limit until the last move counts as shown."""
        for _ in range(2):  # the read that sees it followed, then settle_s (2 s) more
            assert not self.read(**load)


def controller(**policy: Any) -> tuple[AdmissionController, Clock]:
    c = AdmissionController(AdmissionPolicy(**policy))
    return c, Clock(c)


def test_it_starts_at_the_fixed_default_and_grows_while_the_queue_stays_short() -> None:
    c, clock = controller()
    assert (c.limit, c.reason) == (defaults.MAX_INFLIGHT_PER_SERVER, "start: fixed default")
    assert clock.read(gen_throughput=1000.0)
    assert c.limit == 384 and c.reason == "grow: queue short"  # slow start: x1.5
    clock.settle(gen_throughput=1400.0)
    assert clock.read(gen_throughput=1400.0)
    assert c.limit == 576 and c.reason == "grow: throughput up"


def test_it_does_not_grow_a_limit_the_worker_does_not_use() -> None:
    c, clock = controller()
    for _ in range(5):
        assert not clock.read(inflight=100)
    assert c.limit == defaults.MAX_INFLIGHT_PER_SERVER


def test_a_growing_queue_sheds_the_requests_beyond_what_the_server_runs() -> None:
    c, clock = controller(fixed=400)
    assert clock.read(running=200, queued=200)
    # What it ran at most lately, plus the slack it needs (10% of it).
    assert c.limit == 220 and c.reason == "back off: queue 200"
    # The lower limit drains only as requests finish: no second cut meanwhile.
    assert not clock.read(inflight=300, running=200, queued=100)
    assert c.limit == 220


def test_a_queue_at_a_full_kv_cache_sheds_down_to_what_runs_now() -> None:
    c, clock = controller(fixed=256)
    assert not clock.read(inflight=100, running=200)  # 200 ran (the limit unused: no move)
    # The cache full, 95 running and a long queue: the 200 were admissions it retracted.
    assert clock.read(running=95, queued=150, token_usage=0.97)
    assert c.limit == 128 and c.reason == "back off: queue 150"  # half at most at once
    clock.settle(running=95, queued=60, token_usage=0.97)
    assert clock.read(running=95, queued=60, token_usage=0.97)
    assert c.limit == 104  # 95 and the slack of 9.5, not the window's 200 and 20
    # With room in the cache a dip is not followed: what ran lately stands.
    d, other = controller(fixed=400)
    assert not other.read(inflight=100, running=200)
    assert other.read(running=95, queued=150, token_usage=0.6)
    assert d.limit == 209


def test_retractions_back_off_and_then_growth_is_additive() -> None:
    c, clock = controller(fixed=200)
    assert not clock.read(inflight=10, running=150)  # no growth of an unused limit
    assert clock.read(retracted=3, running=150)
    assert c.limit == 170 and c.reason == "back off: retracted 3"
    clock.settle()
    assert clock.read()
    assert c.limit == 178  # +5% now, no longer x1.5


def test_retractions_while_the_server_runs_all_we_send_shed_nothing() -> None:
    c, clock = controller(fixed=100)
    assert not clock.read(inflight=10)
    assert not clock.read(retracted=2, running=100)
    assert c.limit == 100


def test_token_usage_at_the_brim_stops_growth_and_sheds_a_queue() -> None:
    c, clock = controller(fixed=100)
    assert not clock.read(token_usage=0.96, running=80)  # near full: hold
    assert c.limit == 100
    assert clock.read(token_usage=0.993, running=80, queued=12)
    assert c.limit == 88 and c.reason == "back off: token usage 0.99"


def test_a_growth_that_lowers_throughput_is_undone_and_not_retried_soon() -> None:
    c, clock = controller(fixed=100)
    assert clock.read(gen_throughput=1000.0)
    assert c.limit == 150
    clock.settle(gen_throughput=700.0)
    for _ in range(2):  # a drop must last settle_s (2 s): prefilling newcomers dips it
        assert not clock.read(gen_throughput=700.0)
    assert clock.read(gen_throughput=700.0)
    assert c.limit == 100 and c.reason == "back off: throughput down"
    clock.settle(gen_throughput=1000.0)
    for _ in range(30):  # additive growth, stopping short of the limit that hurt
        clock.read(gen_throughput=1000.0)
    assert 100 < c.limit < 150


def test_a_passing_dip_after_a_growth_is_not_blamed_on_it() -> None:
    c, clock = controller(fixed=100)
    assert clock.read(gen_throughput=1000.0)
    clock.settle(gen_throughput=700.0)
    assert not clock.read(gen_throughput=700.0)
    assert clock.read(gen_throughput=1100.0)
    assert c.limit == 225 and c.reason == "grow: throughput up"


def test_the_cap_is_never_exceeded() -> None:
    c, clock = controller(cap=300)
    for _ in range(20):
        clock.read(gen_throughput=1000.0 + clock.now)
    assert c.limit == 300
    assert AdmissionController(AdmissionPolicy(cap=8, fixed=256)).limit == 8


def test_without_metrics_it_falls_back_to_the_fixed_default_with_the_reason() -> None:
    c, clock = controller(fixed=64)
    clock.read()
    assert c.limit == 96
    assert c.unavailable("HTTP 404")
    assert (c.limit, c.reason) == (64, "fixed: no /metrics (HTTP 404)")
    assert not c.unavailable("HTTP 404")  # no news


def test_the_poller_sets_the_pools_limit_and_falls_back_on_404() -> None:
    async def probe(server: ServerState) -> bool:
        return True

    async def run() -> None:
        pool = ServerPool(
            ["http://a:1", "http://b:1"],
            256,
            probe,
            health_interval_s=10,
            overload_backoff=Backoff(0.1, 1),
        )
        replies = {"http://a:1": (200, SGLANG_METRICS.encode()), "http://b:1": (404, b"")}

        async def fetch(server: ServerState) -> tuple[int, bytes]:
            return replies[server.url]

        poller = AdmissionPoller(pool, AdmissionPolicy(fixed=32), fetch)
        a, b = pool.servers
        a.inflight = b.inflight = 32
        assert await poller.poll_once(a) and await poller.poll_once(b)
        assert (a.cap, a.limit_reason) == (48, "grow: queue short")
        assert (b.cap, b.limit_reason) == (32, "fixed: no /metrics (HTTP 404)")
        assert a.snapshot()["max_inflight"] == 48
        assert b.snapshot()["limit_reason"] == "fixed: no /metrics (HTTP 404)"

    asyncio.run(run())


def test_status_shows_each_servers_limit_and_why_it_last_moved() -> None:
    from regen.ops.status_view import _servers

    server = {"url": "http://a:1", "healthy": True, "probed": True, "inflight": 12,
              "max_inflight": 96, "limit_reason": "back off: queue 40"}  # fmt: skip
    text = _servers({"engine": "sglang", "engine_stats": {"servers": [server]}})
    assert text.plain == "http://a:1 up 12/96 (back off: queue 40)"
