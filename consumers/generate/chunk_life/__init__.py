"""A generate chunk's life, from its delivery to its acknowledgement, in one place.

delivery.py reads a delivery top to bottom: it starts (lease_book.py: its attempt recorded,
its lease taken and then renewed with every heartbeat), checks the attempt cap
(policy.py), and has the generate stage's work run the open prompts (chunk_runner.py:
giving back to the queue what its worker cannot start soon, unstarted.py; settling each
prompt under the lease, handoff.py: the result handed off or the prompt dead-lettered,
with its `generated` mark, state.py). It then ends in exactly one way (outcome.py,
written by lease.py): acknowledged (`finish`), given back to the queue (`give_back`),
failed, or dropped because another delivery holds the chunk (`LeaseLost`, and its
message put back if Redis holds it nowhere). Its steps and its end are announced to the
worker's hooks (hooks.py), which metrics and crash points subscribe to. Celery and
kombu leave alone what regen settled (celery_delivery.py). docs/design/delivery.md has the
chunk's state diagram (Delivery protocol, "A chunk's states").

Modules, each with one job:
- delivery.py: one delivery from its receipt to its end (`deliver`);
- outcome.py: the attempt statuses stored in Redis and how a delivery ends;
- hooks.py: the delivery's events and their subscribers;
- state.py: the chunk's Redis keys and the scripts, the only code that writes them;
- lease.py: one delivery's lease: every lease-checked write, and how a delivery ends;
- lease_book.py: the leases a worker holds, started and renewed;
- policy.py: the timers and retry policy (lease length, give-back, engine retries,
  attempt cap, requeue pause);
- handoff.py: settling a delivery's prompts under its lease;
- unstarted.py: giving back the prompts a delivery cannot start soon, as new chunks;
- celery_delivery.py: where leases meet Celery's acknowledgements and kombu's restore.

Code outside this package imports from here, not from its modules.
"""

from regen.consumers.generate.chunk_life.celery_delivery import (
    LeaseKeepingConsumer,
    make_request_class,
)
from regen.consumers.generate.chunk_life.delivery import ChunkWork, deliver
from regen.consumers.generate.chunk_life.handoff import hand_off, write_dead_letters
from regen.consumers.generate.chunk_life.hooks import DeliveryEvent, DeliveryHooks
from regen.consumers.generate.chunk_life.lease import (
    Checkpoint,
    ChunkLease,
    HandOff,
    LeaseLost,
    QueuedChunk,
)
from regen.consumers.generate.chunk_life.lease_book import LeaseBook
from regen.consumers.generate.chunk_life.outcome import AttemptStatus, Delivery, DeliveryEnd
from regen.consumers.generate.chunk_life.policy import (
    GIVE_BACK_AFTER_S,
    REQUEUE_PAUSE_S,
    ChunkDeferred,
    attempts_spent,
    generate_with_retry,
)
from regen.consumers.generate.chunk_life.state import (
    CHUNK_STATE_TTL_S,
    Attempt,
    mark_generated,
    read_generated,
)
from regen.consumers.generate.chunk_life.unstarted import AFTER_GIVE_BACK, give_back_unstarted

# Crash points (common/crashpoints.py): a hand-off written, its chunk not acknowledged.
AFTER_HAND_OFF = DeliveryEvent.AFTER_HAND_OFF.value
BEFORE_ACK = DeliveryEvent.BEFORE_ACK.value

__all__ = [
    "AFTER_GIVE_BACK",
    "AFTER_HAND_OFF",
    "BEFORE_ACK",
    "CHUNK_STATE_TTL_S",
    "GIVE_BACK_AFTER_S",
    "REQUEUE_PAUSE_S",
    "Attempt",
    "AttemptStatus",
    "Checkpoint",
    "ChunkDeferred",
    "ChunkLease",
    "ChunkWork",
    "Delivery",
    "DeliveryEnd",
    "DeliveryEvent",
    "DeliveryHooks",
    "HandOff",
    "LeaseBook",
    "LeaseKeepingConsumer",
    "LeaseLost",
    "QueuedChunk",
    "attempts_spent",
    "deliver",
    "generate_with_retry",
    "give_back_unstarted",
    "hand_off",
    "make_request_class",
    "mark_generated",
    "read_generated",
    "write_dead_letters",
]
