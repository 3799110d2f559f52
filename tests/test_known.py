"""The producer's lookup of the ids a job already has (producer/known.py), on a real Redis."""

from __future__ import annotations

import redis

from regen.common import keys
from regen.producer.known import Known, KnownIds


def test_each_place_an_id_can_be_in_is_found_and_settled_ids_rejoin_the_job(
    r: redis.Redis,
) -> None:
    r.sadd(keys.job_ids("j"), "enqueued")
    r.hset(keys.committed("j"), "committed", "shard-1")
    for stage in keys.STAGES:
        r.hset(keys.dlq("j", stage), f"dead-in-{stage}", "{}")
    r.sadd(keys.dlq_purged("j"), "purged")
    r.sadd(keys.job_ids("other"), "new")  # another job's ids are not this job's
    settled = ["committed", "purged", *(f"dead-in-{stage}" for stage in keys.STAGES)]
    ids = ["enqueued", "new", *settled]
    assert KnownIds(r, "j").lookup(ids) == [Known.IN_JOB, Known.NEW] + [Known.SETTLED] * 5
    # A settled id is put back among the job's ids: asked again, it is in the job.
    assert r.smembers(keys.job_ids("j")) == {s.encode() for s in ["enqueued", *settled]}
    assert KnownIds(r, "j").lookup(["committed", "new"]) == [Known.IN_JOB, Known.NEW]
