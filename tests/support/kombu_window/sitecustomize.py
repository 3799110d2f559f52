"""Loaded (as Python's sitecustomize) by a generate worker a test starts with this folder
on its PYTHONPATH: at kombu's first `QoS.append`, the round trip that records a popped
message in `unacked`, the worker SIGKILLs itself (REGEN_TEST_KOMBU_WINDOW=kill, the
default) or SIGSTOPs itself and, once continued, records it as kombu would (=stop). The
message it popped is in no place meanwhile (kombu's window between BRPOP and that
record)."""

from __future__ import annotations

import os
import signal
from typing import Any

from kombu.transport import redis as kombu_redis

_append = kombu_redis.QoS.append
_stopped = False


def _in_window(self: Any, message: Any, delivery_tag: Any) -> Any:
    global _stopped
    if os.environ.get("REGEN_TEST_KOMBU_WINDOW", "kill") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if not _stopped:
        _stopped = True
        os.kill(os.getpid(), signal.SIGSTOP)
    return _append(self, message, delivery_tag)


kombu_redis.QoS.append = _in_window  # type: ignore[method-assign]
