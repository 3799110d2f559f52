"""Where chunk leases meet Celery and kombu: who acknowledges a delivery, and what a lost
connection does to the chunks a worker holds (see lease.py and lease_book.py,
docs/design/delivery.md, Delivery protocol).
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer
from celery.worker.request import Request
from kombu.transport import virtual

from regen.consumers.generate.chunk_life.lease_book import LeaseBook


def make_request_class(book: LeaseBook) -> type[Request]:
    """Celery's request for a generate task, which leaves alone a delivery regen settled.

    regen acknowledges a finished chunk, gives one back or drops one whose lease was lost
    in Redis itself, checked against the lease (lease.py). Celery acknowledging or
    rejecting it too would act on kombu's keys by delivery tag, which a redelivery of the
    same message shares: after a lost lease that would remove the new holder's delivery.
    So for those only kombu's local count of held messages is updated (it bounds the
    prefetch). Anything regen did not settle (a malformed payload, a crash before the
    lease) is acknowledged or rejected by Celery as usual.
    """

    class LeasedRequest(Request):  # type: ignore[misc]  # Celery is untyped
        acknowledged: bool

        def acknowledge(self) -> None:
            self._forget_if_settled()
            super().acknowledge()

        def reject(self, requeue: bool = False) -> None:
            self._forget_if_settled()
            super().reject(requeue=requeue)

        def _forget_if_settled(self) -> None:
            message = self.message
            book.forget_popped(message.delivery_tag)
            if not self.acknowledged and book.take_settled(message.delivery_tag):
                # The base QoS's ack only forgets the delivery locally; the Redis QoS's
                # own ack would also remove it from Redis.
                virtual.QoS.ack(message.channel.qos, message.delivery_tag)
                self.acknowledged = True

    return LeasedRequest


class LeaseKeepingConsumer(Consumer):  # type: ignore[misc]  # Celery is untyped
    """Celery's consumer, except that a lost broker connection leaves held chunks held.

    On a lost connection Celery closes the channel, and kombu then pushes every message
    the channel delivered back onto its queue. For a generate worker those chunks are
    still running and keep their leases, so pushing them back would only make their work
    run twice (the second run wins the lease, the first drops its results). With Redis
    down the push fails anyway, and once Celery has collected the connection it fails
    with an AttributeError ('NoneType' object has no attribute 'hostname', in kombu's
    `_connparams`) that Celery reports as an unrecoverable error and stops the worker.
    """

    def on_connection_error_after_connected(self, exc: Exception) -> Any:
        task_consumer = getattr(self, "task_consumer", None)
        channel = getattr(task_consumer, "channel", None)
        if channel is not None:
            channel.do_restore = False
        return super().on_connection_error_after_connected(exc)
