"""The tail: how much of a job's end does queueing the longest dataset answers first
remove? (not a test; a measurement, docs/design/producer.md, "Longest answers first").

A job ends on its last answers: a long one started last runs on with its server's other
slots idle. Each prompt here carries the dataset's own answer, and the new answer's
length follows it with noise (new = dataset x lognormal, sigma `--noise`, mean 1): the
stand-in answers as many tokens as the prompt asks (`[answer-length N]`). The same job
runs twice, side by side in one process, on a fresh Redis and fresh servers each time:
with `--order-window 0` (the file's order) and with the default window (8192 rows, the
first chunk at once and the rest longest dataset answer first). Both at the product's
other defaults (chunks of 64, `--max-inflight auto`), at real time scale (32 slots per
server, 20 ms per token, dataset answers averaging 2,000 tokens with a lognormal tail).

Prints for each order: the span (first request to last answer), the ideal (useful tokens
at the fleet's token rate), their ratio, the tail (from the last request's start to the
last answer: slots emptying with nothing left to start) and busy while work waits; then
the ratios default / file order.

    python bench/longest_first.py [--fleet one|two-speed] [--scale 1] [--noise 0.5]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from long_generations import (  # noqa: E402
    CONTEXT_LENGTH,
    DEFAULT_DELIVERY,
    busy_while_work_waits,
    standins,
    wait_done,
    wait_until_held,
)

from regen.common import defaults, jobspec  # noqa: E402
from regen.common.celery_app import make_app  # noqa: E402
from regen.producer.enqueue import Enqueuer  # noqa: E402
from regen.producer.spec import JobOptions, prepare_job  # noqa: E402
from tests.support.generate_harness import Worker, results  # noqa: E402
from tests.support.helpers import write_jsonl  # noqa: E402
from tests.support.redis_server import running_redis  # noqa: E402

JOB = "tail"
# ms per token of each server, the first one's worker started first.
FLEETS = {"one": [20.0], "two-speed": [80.0, 20.0]}
# Characters per token of the dataset's answers (English text runs ~4).
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Figures:
    order_window: int
    span_s: float
    ideal_s: float
    tail_s: float
    busy: list[float]

    @property
    def span_over_ideal(self) -> float:
        return self.span_s / self.ideal_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", choices=sorted(FLEETS), default="one")
    parser.add_argument("--scale", type=float, default=1.0, help="divide answer lengths by")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--slots", type=int, default=32, help="running slots per server")
    parser.add_argument("--mean-tokens", type=float, default=2000.0)
    parser.add_argument("--sigma", type=float, default=0.8, help="dataset answers' spread")
    parser.add_argument("--noise", type=float, default=0.5, help="new answer / dataset's")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = dataset(args)
    figures = [run(rows, window, args) for window in (0, defaults.ORDER_WINDOW)]
    as_read, default = figures
    print(
        f"default / file order: span {default.span_s / as_read.span_s:.3f}, "
        f"tail {default.tail_s / as_read.tail_s:.3f}"
    )


def dataset(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows whose dataset answer predicts, with noise, the length the stand-in answers."""
    rng = random.Random(args.seed)
    mean = args.mean_tokens / args.scale
    longest = int(mean * 8)

    def lognormal(mean: float, sigma: float) -> float:
        return rng.lognormvariate(-sigma * sigma / 2, sigma) * mean

    rows = []
    for i in range(args.prompts):
        old = max(1, min(longest, round(lognormal(mean, args.sigma))))
        new = max(1, min(longest, round(old * lognormal(1.0, args.noise))))
        rows.append({"messages": [
            {"role": "user", "content": f"Prompt {i}: explain item {i}. [answer-length {new}]"},
            {"role": "assistant", "content": "x" * (old * CHARS_PER_TOKEN)},
        ]})  # fmt: skip
    return rows


def run(rows: list[dict[str, Any]], order_window: int, args: argparse.Namespace) -> Figures:
    speeds = FLEETS[args.fleet]
    longest = int(args.mean_tokens / args.scale * 8)
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        url = stack.enter_context(running_redis(tmp / "redis")).url
        r = redis.Redis.from_url(url)
        prepared = prepare_job(
            JobOptions(job=JOB, model="smollm2", max_new_tokens=longest + 64,
                       context_length=CONTEXT_LENGTH)
        )  # fmt: skip
        jobspec.save(r, prepared.spec)
        path = write_jsonl(tmp / "rows.jsonl", rows)
        Enqueuer(r, make_app(url), prepared, high_water=10_000, order_window=order_window).run(
            [path]
        )
        servers = stack.enter_context(
            standins(speeds, args.slots, "fixed:n=1", answer_length_from_prompt=True)
        )
        for i, server in enumerate(servers):
            stack.enter_context(
                Worker(url, tmp, "--engine", "sglang", "--server", server.url, "--jobs", JOB,
                       "--loglevel", "WARNING", env=DEFAULT_DELIVERY)
            )  # fmt: skip
            if i == 0 and len(servers) > 1:  # the first worker meets the queue alone
                wait_until_held(r)
        wait_done(r, prepared.spec)
        logs = [server.slot_log() for server in servers]
        useful = sum(res.completion_tokens for res in results(r, JOB))
    entries = [e for log in logs for e in log]
    last_end = max(e["end"] for e in entries)
    figures = Figures(
        order_window=order_window,
        span_s=last_end - min(e["start"] for e in entries),
        ideal_s=useful / sum(args.slots * 1000.0 / ms for ms in speeds),
        tail_s=last_end - max(e["start"] for e in entries),
        busy=busy_while_work_waits(logs, args.slots),
    )
    busy = " ".join(f"{b:.3f}" for b in figures.busy)
    print(
        f"--order-window {order_window}: {len(rows)} prompts, fleet {args.fleet}, scale "
        f"1/{args.scale:g}, noise {args.noise}: span {figures.span_s:.0f} s over ideal "
        f"{figures.ideal_s:.0f} s = {figures.span_over_ideal:.2f}x, tail "
        f"{figures.tail_s:.0f} s, busy {busy}",
        flush=True,
    )
    return figures


if __name__ == "__main__":
    main()
