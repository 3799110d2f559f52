"""Wakes the worker's heartbeat whenever its idle slots change, so the other generate
workers see them within a second or two (peers.py), not at the next regular beat (up
to 10 s, a quarter of a slot's work at 40 s answers).

A delivery whose prompt finishes wakes the heartbeat at once when that leaves slots
idle (`ChunkContext.on_idle_slots`); but slots also fall idle with no prompt
finishing: the slot estimate grows (server_slots.py: the slow start finds 16, then
24, then 32 slots on an idle server), a server turns healthy, a delivery gives its
prompts back. And a peer that read idle slots which a new chunk has since filled
would give prompts back for them. So this thread looks every IDLE_LOOK_S and wakes
the heartbeat on any change; a worker that stays full (or idle) beats only on its
interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("regen.generate")

# How often the idle slots are looked at: a heartbeat asked for early comes at most
# once a heartbeat.WOKEN_BEAT_GAP_S anyway.
IDLE_LOOK_S = 1.0


class IdleBeat(threading.Thread):
    """Wakes the heartbeat when what `idle_slots()` returns changes (the idle slots, and
    the prompts the worker is short: peers.py)."""

    def __init__(
        self,
        idle_slots: Callable[[], object],
        wake: Callable[[], None],
        look_s: float = IDLE_LOOK_S,
    ) -> None:
        super().__init__(name="regen-idle-beat", daemon=True)
        self._idle_slots = idle_slots
        self._wake = wake
        self._look_s = look_s
        self._stop_event = threading.Event()

    def run(self) -> None:
        told = self._read()
        while not self._stop_event.wait(self._look_s):
            idle = self._read()
            if idle is not None and idle != told:
                self._wake()
                told = idle

    def stop(self) -> None:
        self._stop_event.set()

    def _read(self) -> object:
        try:
            return self._idle_slots()
        except Exception:  # never stops the worker; the regular beats go on
            log.debug("reading idle slots failed", exc_info=True)
            return None
