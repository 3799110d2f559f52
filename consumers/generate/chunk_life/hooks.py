"""What a delivery announces as it goes, for others to subscribe to: the worker's
metrics count how deliveries end, and crash points (common/crashpoints.py) kill the
process at a named step, with no line of theirs in the delivery's code. As dramatiq's
middleware subscribes to a message's life (dramatiq/middleware/middleware.py).

Subscribers run in the delivery's thread, at the step, in the order they subscribed;
one that raises stops the delivery there, as a crash at that step would.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from regen.common import crashpoints


class DeliveryEvent(str, Enum):
    # The values are also the crash points' names (REGEN_CRASHPOINT).
    AFTER_HAND_OFF = "generate.after_hand_off"  # results written, the chunk not acked
    BEFORE_ACK = "generate.before_ack"  # every prompt settled, the chunk not acked
    AFTER_END = "generate.after_end"  # the delivery ended (details: chunk, delivery)


# The steps a crash point can stop a worker at: after a write, before the next one.
CRASH_POINTS = (DeliveryEvent.AFTER_HAND_OFF, DeliveryEvent.BEFORE_ACK)

Subscriber = Callable[..., None]


class DeliveryHooks:
    """A worker's subscribers to its deliveries' events; crash points are subscribed
    from the start."""

    def __init__(self) -> None:
        self._subscribers: dict[DeliveryEvent, list[Subscriber]] = {e: [] for e in DeliveryEvent}
        for event in CRASH_POINTS:
            self.subscribe(event, _crash_point(event))

    def subscribe(self, event: DeliveryEvent, subscriber: Subscriber) -> None:
        self._subscribers[event].append(subscriber)

    def unsubscribe(self, event: DeliveryEvent, subscriber: Subscriber) -> None:
        self._subscribers[event].remove(subscriber)

    def emit(self, event: DeliveryEvent, **details: Any) -> None:
        for subscriber in list(self._subscribers[event]):
            subscriber(**details)


def _crash_point(event: DeliveryEvent) -> Subscriber:
    def crash(**_: Any) -> None:
        crashpoints.hit(event.value)

    return crash
