"""`--max-inflight auto` against fixed limits (not a test; a measurement).

Starts the SGLang stand-in with its batch model (tests/support/sglang_standin/batching.py) in two
settings, and drives the real SGLang HTTP engine the way a generate worker's flow control
does (consumers/generate/placement/flow_control.py: the engine's capacity plus a slack outstanding):

- compute-bound: a decode pass takes longer the more requests run, tokens/s grows with
  the batch up to the server's 1024 running slots, and the KV cache never fills;
- KV-bound: the KV budget fits ~80 requests of 200-token prompts and long-tailed answers;
  beyond it the server queues, and over-filling it retracts (recomputes) requests.

Each run gets a fresh stand-in; tokens/s is what the server decoded after a warm-up that
is the same for every run: 30 s, in which auto finds the edge from the fixed default (in
the KV-bound setting ~17 s: the first back-offs, then the queue drains), since what
counts for a job that runs for days is the steady state. `--warmup 15` shows the cost
of that search too. It prints each fixed limit's tokens/s, then auto's, and the
ratios auto / best fixed and auto / the fixed default (defaults.MAX_INFLIGHT_PER_SERVER),
from the mean of `--repeat` rounds over all the limits (the 2-core machine is shared,
and one run's tokens/s moves by a few percent with its load).

    python bench/adaptive_inflight.py [--seconds 70] [--warmup 30] [--repeat 2] [--only kv]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.common import defaults
from regen.common.heartbeat import RateMeter
from regen.consumers.generate.engine import GenerateRequest
from regen.consumers.generate.engines.admission_policy import AdmissionPolicy
from regen.consumers.generate.engines.sglang_http import SGLangHTTPEngine
from regen.consumers.generate.placement.flow_control import slack
from tests.support.sglang_standin.process import StandinHandle, run_standin

OUTPUT_LEN = "lognormal:mean=300,sigma=0.8,min=8,max=1500"
SETTINGS: dict[str, dict[str, Any]] = {
    "compute": {
        "standin": dict(
            max_running_requests=1024, decode_step_s=0.02, decode_step_per_req_s=0.00003
        ),
        "prompt_len": 64,
        "fixed": [256, 512, 1024, 1536],
    },
    "kv": {
        "standin": dict(
            max_running_requests=1024,
            decode_step_s=0.02,
            decode_step_per_req_s=0.00003,
            prefill_s_per_token=0.00002,
            kv_budget_tokens=40_000,
        ),
        "prompt_len": 200,
        "fixed": [64, 96, 128, 256],
    },
}


@dataclass
class Run:
    tokens_per_s: float
    limit: int
    reason: str
    retracted: int


async def drive(
    engine: SGLangHTTPEngine, server: StandinHandle, prompt_len: int, args: argparse.Namespace
) -> float:
    """Keep capacity + slack requests outstanding for `args.seconds`; the tokens/s the
    server decoded after `args.warmup` (counted as decoded, not as answers finish: an
    answer takes ~10 s, and counting at the finish would credit a run with what it
    decoded before the window)."""
    rng = random.Random(0)
    finished = RateMeter()

    async def one(i: int) -> None:
        ids = [rng.randrange(100, 40_000) for _ in range(prompt_len)]
        await engine.generate(GenerateRequest(f"bench-{i}", ids, {"max_new_tokens": 2048}))
        finished.add()

    tasks: set[asyncio.Task[None]] = set()
    i = 0
    await engine.wait_until_healthy(60)
    start = time.monotonic()
    window: list[tuple[float, int]] = []
    while time.monotonic() < start + args.seconds:
        if not window and time.monotonic() >= start + args.warmup:
            decoded = (await asyncio.to_thread(server.stats))["decoded_total"]
            window.append((time.monotonic(), decoded))
        capacity = max(engine.capacity(), 1)
        want = capacity + slack(capacity, finished.rate())
        while len(tasks) < want:
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        await asyncio.sleep(0.05)
    decoded = (await asyncio.to_thread(server.stats))["decoded_total"]
    (window_start, decoded_before), now = window[0], time.monotonic()
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return (decoded - decoded_before) / (now - window_start)


def run_once(setting: dict[str, Any], limit: int | None, args: argparse.Namespace) -> Run:
    with run_standin(output_len_dist=OUTPUT_LEN, **setting["standin"]) as server:

        async def main() -> Run:
            engine = SGLangHTTPEngine(
                [server.url],
                max_inflight_per_server=limit or defaults.MAX_INFLIGHT_PER_SERVER,
                admission=AdmissionPolicy() if limit is None else None,
                health_interval_s=5.0,
            )
            async with engine:
                tps = await drive(engine, server, setting["prompt_len"], args)
                snapshot = engine.stats()["servers"][0]
            retracted = int(server.stats()["retracted_total"])
            return Run(tps, snapshot["max_inflight"], snapshot["limit_reason"], retracted)

        return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=70.0, help="length of each run")
    parser.add_argument("--warmup", type=float, default=30.0, help="not counted, every run")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over every limit")
    parser.add_argument("--only", choices=sorted(SETTINGS), help="one setting only")
    parser.add_argument("--fixed", type=int, nargs="*", help="fixed limits to sweep instead")
    parser.add_argument("--verbose", action="store_true", help="log each move of auto's limit")
    args = parser.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(message)s")
        logging.getLogger("regen.consumers.generate.engines.sglang_admission").setLevel("INFO")
    default = defaults.MAX_INFLIGHT_PER_SERVER
    for name, setting in SETTINGS.items():
        if args.only and name != args.only:
            continue
        print(f"== {name}-bound: stand-in {setting['standin']}", flush=True)
        limits: list[int | None] = [
            *sorted({*(setting["fixed"] if args.fixed is None else args.fixed), default}),
            None,
        ]
        # Rounds over every limit, so a change in the machine's load hits them alike.
        runs: dict[int | None, list[Run]] = {limit: [] for limit in limits}
        for _ in range(args.repeat):
            for limit in limits:
                run = run_once(setting, limit, args)
                runs[limit].append(run)
                label = "auto" if limit is None else f"fixed {limit}"
                print(f"  {label:>10}: {run.tokens_per_s:8.0f} tokens/s  retracted "
                      f"{run.retracted}  limit at the end {run.limit} ({run.reason})",
                      flush=True)  # fmt: skip
        mean = {k: sum(r.tokens_per_s for r in v) / len(v) for k, v in runs.items()}
        fixed = {k: v for k, v in mean.items() if k is not None}
        best = max(fixed, key=lambda k: fixed[k])
        for limit, tps in mean.items():
            label = "auto" if limit is None else f"fixed {limit}"
            print(f"{label:>10}: {tps:8.0f} tokens/s (mean of {args.repeat})")
        print(f"auto / best fixed ({best}): {mean[None] / fixed[best]:.3f}   "
              f"auto / default fixed ({default}): {mean[None] / fixed[default]:.3f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
