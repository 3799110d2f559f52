"""A generate chunk's life, from its delivery to its acknowledgement, in one place.

A delivery starts (book.py: its attempt recorded, its lease taken and then renewed with
every heartbeat), checks the attempt cap (policy.py), gives back to the queue the
prompts its worker cannot start soon (unstarted.py), runs the rest, waiting on the
engine as policy.py says, and settles each prompt under its lease (handoff.py: the result
handed off or the prompt dead-lettered, with its `generated` mark, state.py). It then
ends in exactly one way (lease.py): acknowledged (`finish`), given back to the queue
(`give_back`), or dropped because another delivery holds the chunk (`LeaseLost`, and its
message put back if Redis holds it nowhere). Celery and kombu leave alone what regen
settled (celery_delivery.py). docs/design.md has the chunk's state diagram (Delivery
protocol, "A chunk's states").

Modules, each with one job:
- state.py: the chunk's Redis keys and the scripts, the only code that writes them;
- lease.py: one delivery's lease: every lease-checked write, and how a delivery ends;
- book.py: the leases a worker holds, started and renewed;
- policy.py: the timers and retry policy (lease length, give-back, engine retries,
  attempt cap, requeue pause);
- handoff.py: settling a delivery's prompts under its lease;
- unstarted.py: giving back the prompts a delivery cannot start soon, as new chunks;
- celery_delivery.py: where leases meet Celery's acknowledgements and kombu's restore.

Code outside this package imports from here, not from its modules.
"""

from regen.consumers.generate.chunk_life.book import LeaseBook
from regen.consumers.generate.chunk_life.celery_delivery import (
    LeaseKeepingConsumer,
    make_request_class,
)
from regen.consumers.generate.chunk_life.handoff import (
    AFTER_HAND_OFF,
    BEFORE_ACK,
    hand_off,
    write_dead_letters,
)
from regen.consumers.generate.chunk_life.lease import (
    Checkpoint,
    ChunkLease,
    HandOff,
    LeaseLost,
    QueuedChunk,
)
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

__all__ = [
    "AFTER_GIVE_BACK",
    "AFTER_HAND_OFF",
    "BEFORE_ACK",
    "CHUNK_STATE_TTL_S",
    "GIVE_BACK_AFTER_S",
    "REQUEUE_PAUSE_S",
    "Attempt",
    "Checkpoint",
    "ChunkDeferred",
    "ChunkLease",
    "HandOff",
    "LeaseBook",
    "LeaseKeepingConsumer",
    "LeaseLost",
    "QueuedChunk",
    "attempts_spent",
    "generate_with_retry",
    "give_back_unstarted",
    "hand_off",
    "make_request_class",
    "mark_generated",
    "read_generated",
    "write_dead_letters",
]
