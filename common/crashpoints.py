"""Named points where a crash test can kill the process with SIGKILL.

Crash safety is only believable when a real process dies at the worst instant (after a
rename, before an ack) and the next one recovers. `REGEN_CRASHPOINT=name` makes the
process kill itself the first time it reaches that point (read by common.settings);
unset, `hit` costs one attribute lookup.
"""

from __future__ import annotations

import os
import signal

from regen.common import settings


def hit(name: str) -> None:
    if settings.current().crashpoint == name:
        os.kill(os.getpid(), signal.SIGKILL)
