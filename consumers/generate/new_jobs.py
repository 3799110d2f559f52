"""A generate worker's wake-up at a new job: `jobspec.save` publishes a new job's name on
keys.NEW_JOBS_CHANNEL, and the worker's watcher, which polls the job registry every
few seconds, waits on that channel between polls instead of sleeping, so an idle worker
takes a new job's queue within a moment of its spec being stored (docs/design/delivery.md,
Generate: following new jobs).

Only a wake-up: pub/sub drops messages while a subscriber is disconnected, so the poll
stays the rule and a lost message costs one poll interval, as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from regen.common import keys

log = logging.getLogger("regen.generate")

# The longest one blocking read of the channel: how soon a stop is seen.
READ_S = 0.5
# How often a lost subscription is tried again.
RESUBSCRIBE_S = 1.0


class NewJobs:
    """The watcher's subscription to new jobs (one connection per worker)."""

    def __init__(self, r: redis.Redis) -> None:
        self._r = r
        self._pubsub: redis.client.PubSub | None = None
        # The subscription was lost: announcements may have been missed meanwhile.
        self._lost = False

    def subscribe(self) -> None:
        """Subscribe now, before the registry is read, so that a job stored in between
        is announced; on a Redis error, `wait` tries again every RESUBSCRIBE_S."""
        if self._pubsub is not None:
            return
        try:
            pubsub = self._r.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(keys.NEW_JOBS_CHANNEL)
        except redis.RedisError as exc:
            log.warning("new jobs: not subscribed (%s); polling only", exc)
            return
        self._pubsub = pubsub

    def wait(self, timeout_s: float, stop: threading.Event) -> bool:
        """Until a new job is announced or the subscription is back after a loss
        (True: read the registry now), `timeout_s` passes or `stop` is set."""
        deadline = time.monotonic() + timeout_s
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.subscribe()
            if self._pubsub is None:  # Redis away: try again in a moment
                stop.wait(min(left, RESUBSCRIBE_S))
                continue
            if self._lost:  # back: read the registry for what was announced meanwhile
                self._lost = False
                return True
            try:
                message = self._pubsub.get_message(timeout=min(left, READ_S))
            except redis.RedisError as exc:
                log.warning("new jobs: subscription lost (%s); polling only until back", exc)
                self.close()
                self._lost = True
                continue
            if message is not None:
                return True
        return False

    def close(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(redis.RedisError):
                self._pubsub.close()
            self._pubsub = None
