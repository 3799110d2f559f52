"""Wire the poison filter (poison.py) into kombu, at the one point that sees raw messages.

kombu's Redis channel pops a message with BRPOP and decodes it in `_brpop_read`, in the
same call, before anything else runs; that is also where an undecodable message stops
the worker. redis-py hands the BRPOP reply (list key, raw bytes) to the client's response
callback first, so the generate worker's transport gives its channels' clients a BRPOP
callback that runs the filter: a message it dead-letters reads as "nothing popped" (the
same reply as a BRPOP timeout), and kombu never decodes it. Nothing of it reaches
kombu's `unacked` hash, so there is nothing to ack; a worker killed between the BRPOP and
the DLQ write loses it, as kombu's own BRPOP loses a chunk killed before `unacked` holds
it.

Only the BRPOP path is screened: it is the only one a Celery worker consumes through
(the polling path and `basic_get` go through kombu's `_get`, which workers never call).

The same channel class also says "connection lost" where kombu would fail otherwise: a
chunk that ends after its channel was closed by a lost connection is acked or rejected
on that closed channel (see ScreeningChannel._create_client).

And it keeps, for each message it delivers, the bytes it popped and the list it popped
them from, in the worker's lease book (chunk_life), under the delivery tag kombu records
the delivery by: a copy of Redis taken between the pop and that record holds the message
nowhere, and the worker whose lease that rollback ends puts it back
(`ChunkLease.hand_back_if_forgotten`; docs/design/delivery.md, Delivery protocol).
"""

from __future__ import annotations

from typing import Any

import redis
from celery import Celery
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str

from regen.common import sentinel_url
from regen.consumers.generate.chunk_life import LeaseBook
from regen.consumers.generate.poison import PoisonFilter


def screening_transport(
    screen: PoisonFilter,
    book: LeaseBook | None = None,
    base: type[kombu_redis.Transport] = kombu_redis.Transport,
) -> type[kombu_redis.Transport]:
    """kombu's Redis transport `base` (plain, or Sentinel's), with every BRPOP reply
    passed through `screen` first (and each delivered message kept in `book` as
    popped)."""

    class RememberingQoS(kombu_redis.QoS):  # type: ignore[misc]
        def append(self, message: Any, delivery_tag: str) -> None:
            super().append(message, delivery_tag)
            # Right after its BRPOP reply, in the same call on the consumer's loop.
            popped, self.channel.admitted = self.channel.admitted, None
            if book is not None and popped is not None:
                book.popped(delivery_tag, *popped)

    class ScreeningChannel(base.Channel):  # type: ignore[misc,name-defined]
        QoS = RememberingQoS
        # The last message the screen let through: (list key, bytes), until kombu
        # records its delivery.
        admitted: tuple[bytes, bytes] | None = None

        def _create_client(self, asynchronous: bool = False) -> Any:
            if self.connection is None:
                # Celery closed this channel when its connection was lost (keeping what
                # it delivered unacked: chunk_life), and a chunk that ran on through
                # it is being acked or rejected on it now. kombu would fail building a
                # client here with AttributeError, which Celery takes for an unrecoverable
                # error and stops the worker. Lost is what the connection is: kombu logs
                # that and goes on, and the delivery stays unacked for its restore sweep
                # (docs/design/delivery.md, "Delivery protocol").
                raise redis.ConnectionError("the channel was closed: its connection was lost")
            client = super()._create_client(asynchronous=asynchronous)
            parse = client.response_callbacks.get("BRPOP")

            def screened(response: Any, **options: Any) -> Any:
                reply = parse(response, **options) if parse else response
                if not reply:
                    return reply
                key, raw = reply
                # The list key of a priority step carries a suffix, as in _brpop_read.
                queue = bytes_to_str(key).rsplit(self.sep, 1)[0]
                if not screen.admit(queue, raw):
                    return None
                self.admitted = (key, raw)
                return reply

            client.set_response_callback("BRPOP", screened)
            return client

    class ScreeningTransport(base):  # type: ignore[misc,valid-type]
        Channel = ScreeningChannel

    return ScreeningTransport


def install(app: Celery, screen: PoisonFilter, book: LeaseBook | None = None) -> None:
    """Make `app`'s connections (the worker's consumer among them) screen what they pop,
    keeping each delivered message in `book` as popped.

    On the transport the broker URL names: a sentinel:// URL needs kombu's Sentinel
    transport, which asks the sentinels for the primary (the plain one would send
    commands to a sentinel)."""
    sentinel = sentinel_url.is_sentinel(str(app.conf.broker_url))
    base = kombu_redis.SentinelTransport if sentinel else kombu_redis.Transport
    app.conf.broker_transport = screening_transport(screen, book, base)
