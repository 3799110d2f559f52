"""`import sglang` for tests: the offline Engine stand-in, on CPU (see offline_engine.py).

Only importable with `tests/support/sglang_standin/offline` on sys.path (tests put it there for
the worker processes they start); regen's own code never imports it.
"""

from tests.support.sglang_standin.offline_engine import Engine

__all__ = ["Engine"]
