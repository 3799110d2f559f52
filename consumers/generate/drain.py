"""A generate worker's drain: the first SIGTERM (or SIGINT) moves every running answer
back to the queue and the worker exits within `--drain-timeout` (docs/design/placement.md, "Drain
and pause").

Celery's warm shutdown alone stops taking chunks and then waits for the running ones,
which at real lengths means minutes: past Slurm's and Kubernetes' 30 s grace, whose
SIGKILL then throws every running answer away. So the worker handles these signals
itself. The first sets the context's `draining`: the queue gate stops consuming, and each
delivery gives back the prompts it has not started, hands each running answer back with
its tokens so far (SGLang's /abort_request, as a hand-over does) and ends. Only once no
delivery is left does it start Celery's warm shutdown, which then has nothing to wait
for.

The order matters. Until the warm shutdown, Celery's consumer loop still runs: it sends
the deliveries' acks, and it reads the reply of a BRPOP it issued before the gate
stopped consuming. Such a reply may carry a chunk the drain just gave back; a live
loop puts it back on its queue (kombu requeues a message for a queue no one consumes),
where a process that exited mid-BRPOP would lose it for good (kombu's window). The
drain waits QUIET_S with nothing held, longer than kombu's BRPOP timeout.

A second signal exits at once; a drain past its timeout exits 1. Either way the chunks
still held come back when their leases end, as after a crash.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("regen.generate")

# Exit status of a drain cut short (a second signal, or its timeout): not a clean stop.
CUT_SHORT = 1
# How long nothing must be held before the worker stops: kombu's Redis BRPOP times out
# after 1 s, so a reply to one issued before the queues were cancelled has come by then.
QUIET_S = 2.0
CHECK_S = 0.1


class Drain:
    """The worker's SIGTERM and SIGINT handler (installed once Celery has put its own in
    place: install()). The handler only sets `draining` (the first time) or exits (the
    second); a thread of its own logs, waits until `quiet()` holds for QUIET_S, then
    calls `stop_worker()` (Celery's warm shutdown), and exits 1 at the timeout. A log
    call in a signal handler can deadlock on a lock the interrupted code holds."""

    def __init__(
        self,
        draining: threading.Event,
        timeout_s: float,
        quiet: Callable[[], bool],
        stop_worker: Callable[[], None],
        exit_now: Callable[[int], Any] = os._exit,
    ) -> None:
        self._draining = draining
        self._timeout_s = timeout_s
        self._quiet = quiet
        self._stop_worker = stop_worker
        self._exit_now = exit_now
        self._exited = threading.Event()  # the worker stopped on its own

    def install(self, **_: Any) -> None:
        """Take SIGTERM and SIGINT over from Celery (a receiver of its `worker_ready`
        signal: the main thread, after Celery installed its handlers)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        name = signal.Signals(signum).name
        if self._draining.is_set():
            os.write(2, f"regen: {name} again while draining: exiting now\n".encode())
            self._exit_now(CUT_SHORT)
            return
        self._draining.set()
        threading.Thread(target=self._watch, args=(name,), name="regen-drain", daemon=True).start()

    def _watch(self, name: str) -> None:
        log.warning(
            "%s: draining: no more chunks; running answers go back to the queue with "
            "their tokens so far; exit within %.0f s",
            name,
            self._timeout_s,
        )
        started = time.monotonic()
        deadline = started + self._timeout_s
        quiet_since: float | None = None
        while not self._exited.wait(CHECK_S):
            now = time.monotonic()
            if quiet_since is not None and now - quiet_since >= QUIET_S:
                log.info("drained in %.1f s: stopping", now - started)
                self._stop_worker()
                break
            quiet_since = (quiet_since or now) if self._quiet() else None
            if now >= deadline:
                break
        if self._exited.wait(max(0.0, deadline - time.monotonic())):
            return
        log.error("the drain ran past %.0f s: exiting; the chunks still held come back "
                  "when their leases end", self._timeout_s)  # fmt: skip
        self._exit_now(CUT_SHORT)

    def exited(self) -> None:
        """The worker stopped on its own: the timeout no longer applies."""
        self._exited.set()


def stop_celery_worker() -> None:
    """Start Celery's warm shutdown, as its own SIGTERM handler does: the consumer loop
    sees the flag and stops."""
    from celery.worker import state

    state.should_stop = 0
