"""The read side of a job's exactly-once index: which ids a shard holds (or claims).

The tokenize stage's commit ledger (common/ledger/commit_ledger.py) writes the index; the
producer reads it to skip prompts already settled (after `regen recover`) without
reaching into a consumer (docs/design/exactly-once.md, Exactly-once commits).
"""

from __future__ import annotations

import redis

from regen.common import jobspec, keys
from regen.common.ledger.id_buckets import BucketedIds


def committed_index(r: redis.Redis, job: str) -> BucketedIds:
    """The job's committed index, with its spec's bucket count: a job whose spec Redis
    lacks, or one an older regen wrote, raises JobSpecError."""
    buckets = jobspec.load(r, job).id_buckets
    return BucketedIds(r, buckets, lambda b: keys.committed(job, b))
