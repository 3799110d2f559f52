"""The window read of `regen recover --turns all`: messages no chunk are passed over."""

from __future__ import annotations

from pathlib import Path

import orjson
import redis

from regen.common import jobspec, keys
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.queues import queue_lists
from regen.consumers.tokenize.recover_turns import resume_after_shards
from regen.producer.spec import JobOptions, prepare_job


def test_poison_messages_in_the_window_are_passed_over(r: redis.Redis, tmp_path: Path) -> None:
    spec = jobspec.save(r, prepare_job(JobOptions(job="p", model="smollm2")).spec)
    queue = queue_lists(spec.queue)[0]
    body = orjson.dumps([[{"job": "p", "chunk": "c", "prompts": [1]}], {}, {}]).decode()
    bad_chunk = {"body": body, "properties": {}}
    r.lpush(queue, b"not json", orjson.dumps([1, 2]), orjson.dumps(bad_chunk))
    r.hset(keys.KOMBU_UNACKED, "tag", b"{}")
    resumed = resume_after_shards(r, CommitLedger(r, "p"), spec, tmp_path, set())
    assert (resumed.turns, resumed.conversations) == (0, 0)
