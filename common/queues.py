"""How much work waits in Redis for a job: the producer's backpressure and `regen status`."""

from __future__ import annotations

import redis

from regen.common import keys
from regen.common.jobspec import JobSpec

# kombu's Redis transport keeps one list per priority step; a plain publish goes to the
# queue's own list, but count them all so a priority never hides work.
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = (3, 6, 9)


def queue_lists(queue: str) -> list[str]:
    return [queue, *(f"{queue}{_PRIORITY_SEP}{p}" for p in _PRIORITY_STEPS)]


def queued_chunks(r: redis.Redis, queue: str) -> int:
    pipe = r.pipeline(transaction=False)
    for name in queue_lists(queue):
        pipe.llen(name)
    return int(sum(pipe.execute()))


def pending_results(r: redis.Redis, job: str) -> int:
    """Results handed off by the generate stage and not yet committed to a shard."""
    return int(r.xlen(keys.results_stream(job)))


def waiting_chunks(r: redis.Redis, spec: JobSpec) -> int:
    """The job's window in Redis, in chunks: queued chunks plus the results backlog.

    Results count too, so a stalled tokenize stage also stops the producer instead of
    letting the results stream grow without bound.
    """
    backlog = pending_results(r, spec.name)
    return queued_chunks(r, spec.queue) + -(-backlog // spec.chunk_size)


def publishing(r: redis.Redis, job: str) -> bool:
    """Whether a producer is publishing the job's rows now: the job's queue is then not
    all that is left of it (producer/publishing_mark.py)."""
    return bool(r.exists(keys.job_publishing(job)))
