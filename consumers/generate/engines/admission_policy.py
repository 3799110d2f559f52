"""`--max-inflight auto`: how many requests to keep in flight on one SGLang server, steered
by the server's own Prometheus metrics (docs/design/sglang.md, "SGLang contract" and "Reasons
behind the choices").

Pure logic: `parse_metrics` reads `/metrics` text, `AdmissionController.observe` turns one
reading into a new limit and a short reason. The engine polls (sglang_admission.py).

The aim is the most generated tokens/s. A server is fastest when every running slot it
can hold (its max_running_requests, or the requests its KV cache fits) is busy and a few
more wait to take a freed slot; anything beyond that waits in its queue for nothing, and
past the KV budget the server retracts (preempts and later recomputes) requests. So the
controller, like TCP's congestion control:
- grows while the server's queue stays short, its token usage below the brim and the
  limit is actually used: multiplicatively until the first back-off (to find the scale
  fast), then additively (to sit near the edge without swinging over it);
- backs off on retractions, on token usage at the brim, and on a queue longer than the
  slack a server needs: to what the server ran at its most lately, plus that slack;
- undoes a growth after which tokens/s fell, and does not try that limit again for a while.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from regen.common import defaults

# SGLang's names (python/sglang/srt/metrics/collector.py, 0.5.x). A counter's samples
# carry `_total`. With data parallelism a server reports one series per rank: counts add
# up, token usage is the fullest rank's.
#
# Retractions come two ways (docs/design/sglang.md, "SGLang contract"): 0.5.23 counts them in
# the counter RETRACTED_TOTAL (its increase between readings is what happened); 0.5.6
# has only the gauge RETRACTED_LATELY, the requests its last retracting pass retracted,
# published at each decode-stats log (every 40 decode passes) and zeroed at the next log
# without one. A gauge is a current count, not a total: its value is the news, and a
# difference of two readings means nothing. With both, the counter is read.
RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
TOKEN_USAGE = "sglang:token_usage"
GEN_THROUGHPUT = "sglang:gen_throughput"
GENERATED_TOTAL = "sglang:generation_tokens_total"
RETRACTED_TOTAL = "sglang:num_retracted_requests_total"
RETRACTED_LATELY = "sglang:num_retracted_reqs"


class MetricsUnavailable(Exception):
    """The server's /metrics cannot steer admission (absent, or without SGLang's names)."""


@dataclass(frozen=True)
class ServerLoad:
    """One reading of a server's /metrics."""

    running: float
    queued: float
    token_usage: float | None = None
    gen_throughput: float | None = None
    generated_total: float | None = None
    retracted_total: float | None = None
    # The gauge (0.5.6): retracted by the last retracting pass since the last stats log.
    retracted_lately: float | None = None


def parse_metrics(text: str) -> ServerLoad:
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.startswith("sglang:"):
                    continue
                old = values.get(sample.name)
                if old is None:
                    values[sample.name] = sample.value
                elif sample.name == TOKEN_USAGE:
                    values[sample.name] = max(old, sample.value)
                else:
                    values[sample.name] = old + sample.value
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsUnavailable(f"unparseable /metrics: {exc}") from None
    missing = [name for name in (RUNNING, QUEUED) if name not in values]
    if missing:
        raise MetricsUnavailable(f"/metrics lacks {', '.join(missing)}")
    return ServerLoad(
        running=values[RUNNING],
        queued=values[QUEUED],
        token_usage=values.get(TOKEN_USAGE),
        gen_throughput=values.get(GEN_THROUGHPUT),
        generated_total=values.get(GENERATED_TOTAL),
        retracted_total=values.get(RETRACTED_TOTAL),
        retracted_lately=values.get(RETRACTED_LATELY),
    )


@dataclass(frozen=True)
class AdmissionPolicy:
    # Never more in flight than this (--max-inflight-cap), never fewer than `floor`.
    cap: int = defaults.MAX_INFLIGHT_CAP
    # Where a server starts, and what it falls back to without usable metrics.
    fixed: int = defaults.MAX_INFLIGHT_PER_SERVER
    floor: int = 4
    # Multiplicative growth until the first back-off, then additive steps of this share.
    slow_start_factor: float = 1.5
    additive_share: float = 0.05
    back_off_factor: float = 0.85
    # Waiting requests a server wants, to refill freed slots at once: this share of its
    # running requests, at least `queue_slack_min`; over twice that is too long.
    # Erring high is cheap (a few more requests wait) and erring low is not (slots idle).
    queue_slack_share: float = 0.1
    queue_slack_min: int = 8
    # Token usage at which growth stops, and at which a queue beyond the slack is shed.
    usage_hold: float = 0.95
    usage_back_off: float = 0.99
    # A back-off keeps what the server ran at its most over this window (plus the
    # slack): running requests dip for a while after a retraction (SGLang admits
    # cautiously then), and following the dip down would leave its KV cache part empty.
    running_window_s: float = 30.0
    # A growth after which tokens/s stayed lower by more than this share for `settle_s`
    # is undone...
    throughput_drop: float = 0.10
    # ...and that limit is not tried again for this long.
    ceiling_s: float = 60.0
    # A move is judged once our in-flight has followed it and this long has passed
    # (SGLang updates gen_throughput every 40 decode passes); a higher limit that work
    # does not fill within `reach_s` is judged anyway.
    settle_s: float = 2.0
    reach_s: float = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.cap:
            raise ValueError("max_inflight_cap must be >= 1 (and >= the floor)")


class AdmissionController:
    """One server's in-flight limit; `reason` says why it last moved."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self.limit = max(policy.floor, min(policy.fixed, policy.cap))
        self.reason = "start: fixed default"
        self._last: ServerLoad | None = None
        self._last_at = 0.0
        self._slow_start = True
        # (limit, tokens/s) just before the last growth, until that growth is judged,
        # and since when tokens/s has been lower than that.
        self._growth: tuple[int, float, float | None] | None = None
        # (lowered?, when) of the last move, until our in-flight has followed it.
        self._moved: tuple[bool, float] | None = None
        self._settled_at = -math.inf
        self._running: deque[tuple[float, float]] = deque()
        self._ceiling: tuple[int, float] | None = None  # (limit, until) after a bad growth
        self._rose = False  # the last growth judged raised tokens/s

    def unavailable(self, why: str) -> bool:
        """No usable metrics: the fixed default. True when the limit or reason moved."""
        self._last, self._growth = None, None
        reason = f"fixed: no /metrics ({why})"
        return self._move(max(1, min(self.policy.fixed, self.policy.cap)), reason)

    def observe(self, load: ServerLoad, inflight: int, now: float) -> bool:
        """Adjust the limit to one reading, with `inflight` of ours on the server at the
        time; True when the limit or reason moved."""
        p = self.policy
        last, last_at = self._last, self._last_at
        self._last, self._last_at = load, now
        throughput = _throughput(load, last, now - last_at)
        retracted = _retracted(load, last)
        usage = load.token_usage or 0.0
        slack = max(p.queue_slack_min, p.queue_slack_share * load.running)
        if not self._settled(inflight, slack, now):
            return False
        # What the server runs at most, lately: its slots, or what its KV cache fits.
        self._running.append((now, load.running))
        while self._running[0][0] < now - p.running_window_s:
            self._running.popleft()
        fits = max(running for _, running in self._running) + slack
        if retracted > 0:
            # The server admitted more than its KV cache holds: shed what it cannot run,
            # never below what it ran lately (a retraction then is its own estimate's).
            target = max(fits, self.limit * p.back_off_factor)
            return self._back_off(target, f"retracted {retracted:g}")
        if load.queued > 2 * slack or (usage >= p.usage_back_off and load.queued > slack):
            # Our requests beyond what the server runs wait in its queue for nothing: shed
            # them (at most half at once, as the queue may be partly someone else's).
            why = (
                f"queue {load.queued:g}" if usage < p.usage_back_off else f"token usage {usage:.2f}"
            )
            if usage >= p.usage_hold:
                # A full KV cache: what runs now is what fits. The window's peak is the
                # admissions it later retracted, and keeping it would hold the queue for
                # the window's length.
                fits = load.running + slack
            return self._back_off(max(fits, self.limit / 2), why)
        if self._growth is not None and throughput is not None:
            before_limit, before_tps, dropped_since = self._growth
            if throughput >= before_tps * (1 - p.throughput_drop):
                self._growth, self._rose = None, throughput > before_tps
            elif dropped_since is None or now - dropped_since < p.settle_s:
                # Newly admitted requests are prefilled first, which slows decoding for
                # a moment: only a drop that lasts undoes the growth.
                self._growth = (before_limit, before_tps, dropped_since or now)
                return False
            else:
                self._ceiling = (self.limit, now + p.ceiling_s)
                return self._back_off(before_limit, "throughput down")
        # Grow with the queue under half the slack: a band up to twice the slack, so a
        # back-off (to the slack) is not followed by a growth at once.
        short = load.queued <= slack / 2
        if not short or usage >= p.usage_hold or inflight < self.limit - slack:
            return False
        if self._ceiling is not None and now < self._ceiling[1]:
            room = self._ceiling[0] - 1
        else:
            room, self._ceiling = p.cap, None
        factor = p.slow_start_factor if self._slow_start else 1 + p.additive_share
        new = min(room, max(self.limit + 1, math.floor(self.limit * factor)))
        if new <= self.limit:
            return False
        self._growth = None if throughput is None else (self.limit, throughput, None)
        return self._move(new, "grow: throughput up" if self._rose else "grow: queue short")

    def _settled(self, inflight: int, slack: float, now: float) -> bool:
        """Whether the last move has shown in the server's metrics: our in-flight has
        followed the limit (a lower one drains only as requests finish; a higher one
        fills as work arrives, or is given up on after `reach_s`), then `settle_s` more
        has passed. Judging sooner would blame the new limit for the old one's load."""
        p = self.policy
        if self._moved is not None:
            down, moved_at = self._moved
            reached = inflight <= self.limit if down else inflight >= self.limit - slack
            if not reached and (down or now - moved_at < p.reach_s):
                return False
            self._moved, self._settled_at = None, now
        return now - self._settled_at >= p.settle_s

    def _back_off(self, target: float, why: str) -> bool:
        self._slow_start = False
        self._growth = None
        new = max(self.policy.floor, min(self.policy.cap, math.floor(target)))
        if new >= self.limit:
            return False
        return self._move(new, f"back off: {why}")

    def _move(self, limit: int, reason: str) -> bool:
        moved = (limit, reason) != (self.limit, self.reason)
        if limit != self.limit:
            self._moved = (limit < self.limit, self._last_at)
        self.limit, self.reason = limit, reason
        return moved


def _delta(now: float | None, before: float | None) -> float:
    """A counter's increase (0 after a server restart reset it, or when either is absent)."""
    if now is None or before is None or now < before:
        return 0.0
    return now - before


def _retracted(load: ServerLoad, last: ServerLoad | None) -> float:
    """Requests the server retracted since `last`: the counter's increase where it has
    the counter (0.5.23), else the gauge's value (0.5.6; see RETRACTED_LATELY). The
    gauge holds its value until the next stats log, so two readings may see the same
    pass: the second is not acted on before the first back-off has shown (`_settled`)."""
    if load.retracted_total is not None:
        return _delta(load.retracted_total, last.retracted_total if last else None)
    return max(0.0, load.retracted_lately or 0.0)


def _throughput(load: ServerLoad, last: ServerLoad | None, seconds: float) -> float | None:
    """Generated tokens/s: SGLang's own gauge, else the counter's rate since `last`."""
    if load.gen_throughput is not None:
        return load.gen_throughput
    if last is None or seconds <= 0 or load.generated_total is None:
        return None
    return _delta(load.generated_total, last.generated_total) / seconds
