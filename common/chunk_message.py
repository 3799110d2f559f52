"""A chunk's Celery task message, built exactly as Celery and kombu would send it, but
not sent: the caller pushes it in its own Redis script, with the bookkeeping that must
go in the same atomic step (the producer's publish and requeue, producer/publish.py; a
generate worker giving back a chunk's unstarted prompts, chunk_life).

Celery publishes outside any transaction, so regen lets Celery and kombu build the
message (headers, properties, delivery tag, priority list key) and captures the Redis
commands instead of running them (docs/design/producer.md, Atomic publish).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from celery import Celery

from regen.common.celery_app import GENERATE_TASK


class _CapturedPublish:
    """Takes the place of kombu's Redis publish batch and keeps its commands."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.commands: list[tuple[str, tuple[Any, ...]]] = []

    def publish(self, message: Any, **kwargs: Any) -> Any:
        # kombu's own PublishBatch routes through basic_publish the same way, so the
        # message gets exactly the delivery tag, body encoding and queue key of a send.
        return self.channel.basic_publish(message, _publish_batch=self, **kwargs)

    def add(self, name: str, *args: Any) -> None:
        self.commands.append((name, args))

    def flush(self) -> None:
        """Nothing to send: the caller runs the commands in its own transaction."""

    def discard(self) -> None:
        self.commands.clear()

    def close(self) -> None:
        """Nothing held."""


@dataclass(frozen=True)
class RenderedChunk:
    # (list key, message) for each LPUSH kombu would run: the chunk's queue list.
    pushes: list[tuple[str, bytes]]
    # Any other command (Celery's task-sent event, a fanout PUBLISH), to run once the
    # chunk is in.
    after: list[tuple[str, tuple[Any, ...]]]


class ChunkMessages:
    """Renders chunks of the generate task into their queue's Redis commands. Safe to
    share between threads (a generate worker's chunks run on several)."""

    def __init__(self, app: Celery) -> None:
        self._app = app
        self._connection = app.connection_for_write()
        self._producer = app.amqp.Producer(self._connection)
        self._capture: _CapturedPublish | None = None
        self._lock = threading.Lock()
        self._producer.channel.create_publish_batch = self._new_capture

    def _new_capture(self, max_size: int) -> _CapturedPublish:
        self._capture = _CapturedPublish(self._producer.channel)
        return self._capture

    def render(self, chunk_id: str, payload: dict[str, Any], queue: str) -> RenderedChunk:
        with self._lock:
            with self._producer.batch():
                self._app.send_task(
                    GENERATE_TASK,
                    args=[payload],
                    task_id=chunk_id,
                    queue=queue,
                    producer=self._producer,
                )
            assert self._capture is not None
            commands, self._capture = self._capture.commands, None
        pushes = [(args[0], args[1]) for name, args in commands if name == "lpush"]
        if not pushes:
            raise RuntimeError(f"kombu produced no LPUSH for a chunk publish: {commands}")
        return RenderedChunk(pushes, [(name, args) for name, args in commands if name != "lpush"])

    def close(self) -> None:
        self._connection.release()
