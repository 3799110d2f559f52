"""How busy a generate worker keeps one SGLang server (not a test; a measurement).

Runs the SGLang stand-in with a fixed capacity (running slots) and a realistic spread of
output lengths, enqueues a job, starts one real `regen worker generate --engine sglang`,
and reports at steady state (after the first chunks, before the queue runs dry):

    utilization = busy slot-seconds / (capacity x wall seconds)

plus prompts/s. The target is >= 0.95: chunk boundaries must not leave slots idle while
the slowest prompts of a chunk finish.

    python bench/generate_utilization.py [--capacity 128] [--prompts 3000] ...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.common import keys
from tests.support.generate_harness import Worker, enqueue_prompts
from tests.support.redis_server import running_redis
from tests.support.sglang_standin.process import run_standin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=128, help="server running slots")
    parser.add_argument("--prompts", type=int, default=6000)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=400.0,
        help="per request, as a busy server decodes",
    )
    parser.add_argument("--output-len", default="lognormal:median=200,sigma=0.8,min=8,max=1500")
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="worker's per-server target (default: the capacity)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with running_redis(tmp / "redis") as redis_server:
            url = redis_server.url
            r = redis.Redis.from_url(url)
            prompts = [f"Benchmark prompt {i}: describe item {i}." for i in range(args.prompts)]
            spec = enqueue_prompts(
                url, tmp, prompts, job="bench", chunk_size=args.chunk_size, max_new_tokens=2048
            )
            with run_standin(
                max_running_requests=args.capacity,
                decode_tokens_per_s=args.decode_tokens_per_s,
                output_len_dist=args.output_len,
            ) as server:
                inflight = str(args.max_inflight or args.capacity)
                with Worker(
                    url,
                    tmp,
                    "--engine",
                    "sglang",
                    "--server",
                    server.url,
                    "--max-inflight",
                    inflight,
                    "--jobs",
                    "bench",
                    "--loglevel",
                    "WARNING",
                ):
                    measure(r, server, spec.name, args)


def results(r: redis.Redis, job: str) -> int:
    return int(r.xlen(keys.results_stream(job)))


def measure(r: redis.Redis, server: object, job: str, args: argparse.Namespace) -> None:
    stats = server.stats  # type: ignore[attr-defined]
    total = args.prompts
    # Steady state: from 10% of the prompts done to 80% (the tail runs out of chunks).
    while results(r, job) < total * 0.10:
        time.sleep(0.2)
    first, done_first, t_first = stats(), results(r, job), time.monotonic()
    while results(r, job) < total * 0.80:
        time.sleep(0.2)
    last, done_last, t_last = stats(), results(r, job), time.monotonic()
    busy = last["busy_slot_s"] - first["busy_slot_s"]
    wall = last["now"] - first["now"]
    utilization = busy / (last["capacity"] * wall)
    print(
        f"capacity {last['capacity']} slots, chunk size {args.chunk_size}, "
        f"output lengths {args.output_len}, {args.decode_tokens_per_s:.0f} tok/s per request"
    )
    print(
        f"steady state: {done_last - done_first} prompts in {t_last - t_first:.1f} s "
        f"= {(done_last - done_first) / (t_last - t_first):.1f} prompts/s"
    )
    print(
        f"server utilization: {utilization:.3f} (target >= 0.95); "
        f"peak running {last['peak_running']}"
    )


if __name__ == "__main__":
    main()
