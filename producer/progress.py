"""The producer's progress: a live line on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.text import Text

from regen.producer.enqueue import EnqueueStats

LOG_EVERY_S = 10.0


def _line(stats: EnqueueStats) -> str:
    state = (
        f"waiting for room ({stats.waiting}/{stats.high_water} chunks queued)"
        if stats.throttled
        else f"window {stats.waiting}/{stats.high_water} chunks"
    )
    resumed = f", resumed after {stats.rows_resumed} rows" if stats.rows_resumed else ""
    return (
        f"rows {stats.rows_read}{resumed} | enqueued {stats.enqueued} in {stats.chunks} chunks"
        f" | duplicates {stats.duplicates} | rejected {stats.rejected}"
        f" | {stats.rate():.0f} rows/s | {state}"
    )


class ProgressDisplay:
    """Callable progress sink for Enqueuer; a context manager around the run."""

    def __init__(self, console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        self._tty = self._console.is_terminal
        self._live: Live | None = None
        self._last_log = 0.0

    def __enter__(self) -> ProgressDisplay:
        if self._tty:
            self._live = Live(Text("starting..."), console=self._console, transient=False)
            self._live.__enter__()
        return self

    def __call__(self, stats: EnqueueStats) -> None:
        if self._live is not None:
            self._live.update(Text(_line(stats)))
            return
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            print(f"regen enqueue: {_line(stats)}", file=sys.stderr, flush=True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)


def summary(stats: EnqueueStats, job: str) -> str:
    lines = [f"job {job}: {_line(stats)}"]
    if stats.already_settled:
        lines.append(f"  in a shard or a DLQ, Redis had lost them: {stats.already_settled}")
    if stats.conversations_resumed:
        lines.append(f"  conversations Redis had lost, resumed after their committed turns: "
                     f"{stats.conversations_resumed}")  # fmt: skip
    for reason, count in sorted(stats.rejected_by_reason.items()):
        lines.append(f"  rejected {reason}: {count}")
    return "\n".join(lines)


def nothing_to_generate(stats: EnqueueStats, job: str, files: int) -> str:
    """The warning for a job left with no prompt to generate after an enqueue."""
    if not files:
        why = "no dataset file found (a folder holds none of the supported suffixes)"
    elif stats.rows_read == 0 and stats.rows_resumed == 0:
        why = "the datasets hold no rows"
    else:
        why = f"none of the {stats.rows_read:,} rows read became a prompt to generate"
    return f"warning: job {job} has no prompt to generate: {why}"
