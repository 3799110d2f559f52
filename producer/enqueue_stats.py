"""What one enqueue run did, for its progress line and its summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EnqueueStats:
    rows_read: int = 0
    rows_resumed: int = 0
    enqueued: int = 0
    duplicates: int = 0
    rejected: int = 0
    chunks: int = 0
    # Prompts already committed or dead-lettered though not among the job's ids (Redis
    # lost them and `regen recover` rebuilt the ledger): recorded as enqueued, not queued.
    already_settled: int = 0
    # Conversations Redis lost while shards hold their first turns, published again to
    # resume after those turns (producer/lost_turns.py).
    conversations_resumed: int = 0
    waiting: int = 0
    high_water: int = 0
    throttled: bool = False
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def rate(self) -> float:
        return self.rows_read / max(time.monotonic() - self.started, 1e-9)
