"""The tokenize stage as its tests run it, on a local folder or a bucket alike: results
pushed as the generate stage hands them off, a TokenizeConsumer on a thread, or `regen
worker tokenize` as a process (to be killed), and the check that a job has settled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import redis

from regen.common import dlq, keys
from regen.consumers.tokenize.consumer import TokenizeConsumer, TokenizeOptions
from regen.consumers.tokenize.job_writer import ShardPolicy
from tests.support.helpers import committed_count

REPO = Path(__file__).resolve().parents[2]
FAST = ShardPolicy(max_rows=25, max_age_s=30, idle_s=0.3)
# Shortened from 120 s and 60 s: a claim's lease, and how old a heartbeat is when its
# consumer counts as dead (beats come every quarter of it).
SHARD_LEASE_S, HEARTBEAT_STALE_S = 4, 3


def push(r: redis.Redis, results: list[Any]) -> None:
    for result in results:
        r.xadd(keys.results_stream(result.job), result.to_fields())


def settled(r: redis.Redis, job: str, expected: int) -> bool:
    """Every result committed or dead-lettered and nothing left on the stream."""
    done = r.hlen(keys.shards(job)) and not r.hlen(keys.pending_shards(job))
    in_dlq = dlq.count(r, job, "tokenize")
    return (
        bool(done)
        and committed_count(r, job) + in_dlq == expected
        and not r.xlen(keys.results_stream(job))
    )


class InProcess:
    """A TokenizeConsumer on a thread of the test process."""

    def __init__(self, r: redis.Redis, options: TokenizeOptions, name: str) -> None:
        self.consumer = TokenizeConsumer(r, options, name)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.consumer.run, args=(self.stop,))

    def __enter__(self) -> InProcess:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def options(out: Path | str, **overrides: Any) -> TokenizeOptions:
    """A folder or a bucket URL (`s3://...`) as `--out`."""
    values: dict[str, Any] = {"out_dir": out, "policy": FAST, "min_free_bytes": 0,
                              "block_ms": 100, "claim_idle_s": 2.0}  # fmt: skip
    values.update(overrides)
    return TokenizeOptions(**values)


def tokenize_worker(
    url: str,
    out: Path | str,
    crashpoint: str | None = None,
    spool: Path | None = None,
    extra: tuple[str, ...] = ("--claim-idle", "3"),
) -> subprocess.Popen[bytes]:
    """`regen worker tokenize` as a process of its own, with 25-row shards; `crashpoint`
    makes it SIGKILL itself there (common/crashpoints.py); `spool` is its own temp folder
    for a bucket's shards, as on a host of its own. The store's variables come from the
    test's environment."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "REGEN_SHARD_LEASE_S": str(SHARD_LEASE_S),
           "REGEN_HEARTBEAT_STALE_S": str(HEARTBEAT_STALE_S)}  # fmt: skip
    env.pop("REGEN_CRASHPOINT", None)
    if crashpoint:
        env["REGEN_CRASHPOINT"] = crashpoint
    if spool is not None:
        env["REGEN_SPOOL_DIR"] = str(spool)
    return subprocess.Popen(
        [sys.executable, "-m", "regen", "worker", "tokenize", "--out", str(out),
         "--redis-url", url, "--shard-rows", "25", "--idle-commit", "0.3",
         "--min-free-mb", "0", *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
