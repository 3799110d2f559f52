"""How long a chunk is held and how often its work is tried: the timers and retry policy
of a chunk's life, each written here once (docs/design/delivery.md, Delivery protocol and
"Timers at real lengths").

- The lease: a delivery is restored to its queue one visibility timeout after its last
  renewal (kombu's sweep; the same setting in every process, common/celery_app.py), and
  a write waits out a Redis outage for at most that long (lease.py).
- The give-back: a chunk whose engine had no healthy server for GIVE_BACK_AFTER_S goes
  back to the queue (ChunkDeferred); busy servers never count.
- Engine retries: a request a healthy engine failed is retried with ENGINE_RETRY's waits
  (an SGLang server's own per-request retries and overload backoff are the engine's,
  engines/sglang_http.py).
- The attempt cap: a chunk whose earlier deliveries died or failed max_attempts times is
  dead-lettered by its next delivery (`attempts_spent`).
- The requeue pause: a delivery that failed waits REQUEUE_PAUSE_S before it is handed
  back, so a persistent error does not spin.
"""

from __future__ import annotations

import asyncio
import logging

from regen.common import settings
from regen.common.backoff import Backoff
from regen.consumers.generate.chunk_life.outcome import AttemptStatus
from regen.consumers.generate.chunk_life.state import Attempt
from regen.consumers.generate.engine import (
    EngineDown,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
)
from regen.consumers.generate.engine_loop import EngineRunner

log = logging.getLogger("regen.generate")


def lease_s() -> float:
    """The lease on a delivered chunk: kombu's visibility timeout, this process's setting."""
    return settings.current().visibility_timeout_s


# A chunk whose engine has had no healthy server for this long in a row is given back
# to the queue (results already handed off stay done), so a worker with a live server
# takes it. Busy servers never count: a prompt waits for a slot however long answers
# run, and the heartbeat renews the chunk's lease meanwhile (docs/design/limits.md, "Timers at
# real lengths").
GIVE_BACK_AFTER_S = 0.75 * settings.current().visibility_timeout_s
# Waits between tries of an engine that failed a request while a server is healthy
# (bad answers): from ~1 s up to a minute.
ENGINE_RETRY = Backoff(base_s=1.0, max_s=60.0)
# A delivery that failed with an unexpected error waits this long before it is handed
# back to the queue: a persistent error does not spin (tasks.py).
REQUEUE_PAUSE_S = 2.0


_DIED_OR_FAILED = (AttemptStatus.STARTED, AttemptStatus.FAILED)


def attempts_spent(history: list[Attempt], attempt: int, max_attempts: int) -> int | None:
    """How many earlier deliveries of the chunk died or failed, once that reaches
    `max_attempts` (its open prompts are then dead-lettered); None while it may run.
    A "started" entry other than this delivery's (`attempt`) is one whose worker died."""
    failed = [h for i, h in enumerate(history) if i != attempt and h["status"] in _DIED_OR_FAILED]
    return len(failed) if len(failed) >= max_attempts else None


class ChunkDeferred(Exception):
    """No server the chunk may use stayed healthy (or the engine closed), or the worker
    drains a chunk of conversations: give it back."""


async def generate_with_retry(runner: EngineRunner, request: GenerateRequest) -> GenerateResult:
    """Generate one prompt, waiting however long healthy servers stay busy; ChunkDeferred
    once none has been healthy for GIVE_BACK_AFTER_S (a dead server is not a bad prompt,
    and a busy one is not a dead one)."""
    failures = 0
    while True:
        try:
            return await runner.engine.generate(request, outage_s=GIVE_BACK_AFTER_S)
        except EngineDown as exc:
            raise ChunkDeferred(str(exc)) from exc
        except EngineUnavailable as exc:
            log.warning(
                "engine unavailable for %s (%s); retrying in ~%.0f s",
                request.rid,
                exc,
                ENGINE_RETRY.ceiling(failures),
            )
            await asyncio.sleep(ENGINE_RETRY.delay(failures))
            failures += 1
