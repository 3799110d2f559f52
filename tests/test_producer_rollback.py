"""A producer that runs through a Redis rollback (restored from an older copy while it
enqueues) publishes again what the copy lost, from the cursor Redis has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from regen.producer.publish import ChunkPublisher, PublishOutcome
from tests.helpers import job_ids, user_rows, write_jsonl
from tests.test_enqueue import enqueue, queued_prompts
from tests.test_redis_restore import dump_all, restore_all


def test_a_producer_publishes_again_the_chunks_a_rollback_lost(
    redis_url: str, r: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", user_rows(24))
    publish = ChunkPublisher.publish
    copy: dict[bytes, bytes] = {}
    published = 0

    def publish_then_roll_back(self: ChunkPublisher, *args: Any, **kwargs: Any) -> PublishOutcome:
        """Redis is copied after the 2nd chunk and restored from it after the 4th: the
        3rd and 4th are lost while the producer runs."""
        nonlocal published
        outcome = publish(self, *args, **kwargs)
        published += 1
        if published == 2:
            copy.update(dump_all(r))
        elif published == 4:
            restore_all(r, copy)
        return outcome

    monkeypatch.setattr(ChunkPublisher, "publish", publish_then_roll_back)
    enqueue(redis_url, [path], chunk_size=4)
    queued = [prompt["id"] for prompt in queued_prompts(r)]
    assert len(queued) == 24 == len(set(queued)), "every prompt queued, once"
    assert job_ids(r, "j") == set(queued)
    assert published == 8  # 6 chunks, and the 2 lost ones again
