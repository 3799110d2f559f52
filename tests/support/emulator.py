"""A storage emulator (moto, Azurite, fake-gcs-server) as the bucket tests run it: a
process of its own, its output discarded, yielded once it answers HTTP, always killed."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from tests.support.helpers import wait_for


def answers(url: str, ok: Callable[[int], bool] = lambda status: status < 500) -> bool:
    """Whether `url` answers with a status `ok` takes (by default any but a server
    error: an unsigned request refused with 403 comes from a server that is up)."""
    try:
        return ok(httpx.get(url, timeout=2, trust_env=False).status_code)
    except httpx.HTTPError:
        return False


@contextmanager
def serving(argv: list[str], ready: Callable[[], bool], what: str) -> Iterator[None]:
    """Run `argv` until the block ends, entering it once `ready()` holds."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: process.poll() is None and ready(), timeout=60, what=what)
        yield
    finally:
        process.kill()
        process.wait()
