"""Workers that refuse a job because their tokenizer differs from the job's.

A tokenizer's fingerprint covers its chat template (common/tokenizer_fingerprint.py), so
a host whose model folder holds another template (or another tokenizer) cannot make the
job's data: its worker refuses the job rather than render or check with it. The refusal
is kept per job and worker, so `regen status` and `regen verify` say which worker it is
and why (docs/design/records.md, Provenance).
"""

from __future__ import annotations

import time

import orjson
import redis

from regen.common import keys
from regen.common.connection import bytes_hash


def record(r: redis.Redis, job: str, worker: str, message: str) -> None:
    r.hset(keys.job_refusals(job), worker, orjson.dumps({"message": message, "time": time.time()}))


def read(r: redis.Redis, job: str) -> dict[str, str]:
    """Worker -> why it refuses the job."""
    raw = bytes_hash(r.hgetall(keys.job_refusals(job)))
    return {worker.decode(): orjson.loads(value)["message"] for worker, value in raw.items()}


def warnings(r: redis.Redis, job: str, live: set[str] | None = None) -> list[str]:
    """What status and verify say of them (of `live` workers only, when given)."""
    return [
        f"worker {worker} refuses this job: {message}"
        for worker, message in sorted(read(r, job).items())
        if live is None or worker in live
    ]
