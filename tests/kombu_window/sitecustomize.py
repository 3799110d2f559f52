"""Loaded (as Python's sitecustomize) by a generate worker a test starts with this folder
on its PYTHONPATH: the worker SIGKILLs itself at kombu's first `QoS.append`, the round
trip that records a popped message in `unacked`, so the message it popped is in no place
(kombu's window between BRPOP and that record)."""

from __future__ import annotations

import os
import signal

from kombu.transport import redis as kombu_redis


def _die(*args: object, **kwargs: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


kombu_redis.QoS.append = _die  # type: ignore[method-assign]
