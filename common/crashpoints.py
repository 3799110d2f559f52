"""Named points where a crash test can kill the process with SIGKILL.

Crash safety is only believable when a real process dies at the worst instant (after a
rename, before an ack) and the next one recovers. `REGEN_CRASHPOINT=name` makes the
process kill itself the first time it reaches that point; unset, `hit` costs one dict
lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "REGEN_CRASHPOINT"


def hit(name: str) -> None:
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
