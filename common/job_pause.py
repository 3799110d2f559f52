"""Pausing a job (`regen pause JOB [--now]`, `regen resume JOB`; docs/design/placement.md,
"Drain and pause").

A pause is one key per job, written by the operator's commands alone and read by the
generate workers, `regen status` and the job metrics. While it is set, every worker stops
taking the job's chunks and gives back the prompts it holds unstarted; with `--now` it
also moves the job's running answers back to the queue, each with its tokens so far, as
a drain does. The queue keeps what was given back: `regen resume` lets the workers take
it again, and nothing decoded is decoded again.
"""

from __future__ import annotations

import redis

from regen.common import jobspec, keys
from regen.common.connection import bytes_set

PAUSED = "paused"  # take none of the job's prompts; running answers finish
NOW = "now"  # and move its running answers back to the queue


def pause(r: redis.Redis, job: str, *, now: bool = False) -> None:
    jobspec.load(r, job)  # a clear error for a job that does not exist
    r.set(keys.job_paused(job), NOW if now else PAUSED)


def resume(r: redis.Redis, job: str) -> bool:
    """Let the workers take the job again; False when it was not paused."""
    jobspec.load(r, job)
    return bool(r.delete(keys.job_paused(job)))


def paused_jobs(r: redis.Redis, jobs: list[str]) -> dict[str, str]:
    """Each of `jobs` that is paused, with its mode (one round trip)."""
    if not jobs:
        return {}
    values = r.mget([keys.job_paused(job) for job in jobs])
    return {
        job: value.decode() if isinstance(value, bytes) else str(value)
        for job, value in zip(jobs, values, strict=True)
        if value is not None
    }


def paused_now(r: redis.Redis) -> dict[str, str]:
    """Every paused job of this Redis, with its mode."""
    return paused_jobs(r, sorted(m.decode() for m in bytes_set(r.smembers(keys.JOBS))))
