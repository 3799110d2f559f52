"""Tokenize throughput to object storage against local disk, with 1, 2 and 4 workers (not
a test).

Each run: a fresh Redis and job, N `regen worker tokenize` processes started and ready
(heartbeats seen) before the clock starts, then results with 2K-token completions fed
onto the stream; the clock stops when every record is in a shard in place. The store is
a local folder, or a bucket on moto's S3 server (a Python process on this machine: it
measures regen's side of the protocol and moto's, not a real S3's bandwidth). Records/s
side by side. Knobs set: --shard-rows 500 and --idle-commit 1 (defaults 100,000 and 10 s),
so that a run of a few thousand records commits several shards of a few MB as it goes,
as a long job does, instead of one shard after a 10 s idle pause at its end.

    python bench/tokenize_store.py [--records 3000] [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.common import jobspec, keys
from regen.common.ledger.commit_ledger import CommitLedger
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import make_result, wait_for
from tests.support.redis_server import running_redis
from tests.support.s3_server import S3Server, s3_server

REPO = Path(__file__).resolve().parents[1]
FEED_BATCH = 200
JOB = "bench"
SHARD_ROWS = 500
IDLE_COMMIT_S = 1


def long_answer(tokens: int, tok: object, seed: int) -> str:
    words = [f"word{(seed * 31 + i) % 997}" for i in range(tokens)]
    ids = tok.encode(" ".join(words), add_special_tokens=False)[:tokens]  # type: ignore[attr-defined]
    return tok.decode(ids)  # type: ignore[attr-defined,no-any-return]


def run(records: int, tokens: int, workers: int, s3: S3Server | None) -> float:
    """Records per second of `workers` tokenize processes writing to a local folder, or
    to a fresh bucket on `s3`."""
    with tempfile.TemporaryDirectory() as tmp_name, running_redis(Path(tmp_name) / "r") as srv:
        tmp = Path(tmp_name)
        r = redis.Redis.from_url(srv.url)
        prepared = prepare_job(JobOptions(job=JOB, model="smollm2", max_new_tokens=4096))
        spec = jobspec.save(r, prepared.spec)
        tok = prepared.tokenizer
        templates = [make_result(tok, spec, i, long_answer(tokens, tok, i)) for i in range(20)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = str(tmp / "out")
        if s3 is not None:
            out = f"s3://{s3.new_bucket()}/out"
            env.update(s3.env)
        procs = []
        for i in range(workers):
            spool = {"REGEN_SPOOL_DIR": str(tmp / f"spool-{i}")}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "regen", "worker", "tokenize", "--out", out,
                 "--redis-url", srv.url, "--min-free-mb", "0", "--jobs", JOB,
                 "--shard-rows", str(SHARD_ROWS), "--idle-commit", str(IDLE_COMMIT_S)],
                env={**env, **spool}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        try:
            wait_for(lambda: r.hlen(keys.WORKERS) >= workers, timeout=120, what="workers up")
            started = time.monotonic()
            for start in range(0, records, FEED_BATCH):
                pipe = r.pipeline(transaction=False)
                for i in range(start, min(start + FEED_BATCH, records)):
                    result = replace(templates[i % len(templates)], id=f"bench{i:08d}")
                    pipe.xadd(keys.results_stream(JOB), result.to_fields())
                pipe.execute()
            ledger = CommitLedger(r, JOB)

            def all_in_place() -> bool:
                committed, claimed = ledger.count()
                return committed >= records and not claimed

            wait_for(all_in_place, timeout=1800, what="every record in a shard in place")
            return records / (time.monotonic() - started)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--completion-tokens", type=int, default=2048)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    print(f"{args.records} records of {args.completion_tokens} completion tokens; "
          f"{os.cpu_count()} cores")  # fmt: skip
    print("workers | local disk rec/s | S3 (moto) rec/s | S3 / local")
    with s3_server() as s3:
        for n in counts:
            local = run(args.records, args.completion_tokens, n, None)
            bucket = run(args.records, args.completion_tokens, n, s3)
            print(f"{n:7d} | {local:16.0f} | {bucket:15.0f} | {bucket / local:10.2f}")


if __name__ == "__main__":
    main()
