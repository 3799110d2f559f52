"""A producer that runs through a Redis rollback (restored from an older copy while it
enqueues) publishes again what the copy lost, from the cursor Redis has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from regen.producer.publish import ChunkPublisher, PublishOutcome
from tests.producer.test_enqueue import enqueue, queued_prompts
from tests.support.helpers import job_ids, user_rows, write_jsonl
from tests.tokenize.test_redis_restore import dump_all, restore_all


class RollbackDuringPublish:
    """Redis copied after the producer's `copy_after`-th publish and restored from that
    copy after its `restore_after`-th: the chunks published in between are lost while
    the producer runs. `published` counts every publish."""

    def __init__(
        self, r: redis.Redis, monkeypatch: pytest.MonkeyPatch, copy_after: int, restore_after: int
    ) -> None:
        self.published = 0
        copy: dict[bytes, bytes] = {}
        publish = ChunkPublisher.publish

        def publish_then_roll_back(
            publisher: ChunkPublisher, *args: Any, **kwargs: Any
        ) -> PublishOutcome:
            outcome = publish(publisher, *args, **kwargs)
            self.published += 1
            if self.published == copy_after:
                copy.update(dump_all(r))
            elif self.published == restore_after:
                restore_all(r, copy)
            return outcome

        monkeypatch.setattr(ChunkPublisher, "publish", publish_then_roll_back)


def test_a_producer_publishes_again_the_chunks_a_rollback_lost(
    redis_url: str, r: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", user_rows(24))
    # The 3rd and 4th chunks are lost.
    rollback = RollbackDuringPublish(r, monkeypatch, copy_after=2, restore_after=4)
    enqueue(redis_url, [path], chunk_size=4)
    queued = [prompt["id"] for prompt in queued_prompts(r)]
    assert len(queued) == 24 == len(set(queued)), "every prompt queued, once"
    assert job_ids(r, "j") == set(queued)
    assert rollback.published == 8  # 6 chunks, and the 2 lost ones again
