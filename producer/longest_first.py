"""The order prompts go on the queue: within each window of rows, the longest dataset
answers first (docs/design/producer.md, "Longest answers first").

A job ends on its last answers. If a long one starts last, it runs alone on a server
whose other slots have emptied, and the job waits for it: the tail. Started first, the
long answers run while the short ones fill the slots around them, and the job ends on
short answers. Where the dataset carries its own answers (producer/answer_length.py),
their lengths predict the new ones well enough to do that.

The order is sorted within a window of `order_window` prompts, never over the whole
job: a job stopped half-way has answered a fair half of its prompts (no more long ones
than short ones), its progress and ETA stay true, and the producer holds one window,
not the dataset. The first window is one chunk, published as read, so that the first
request goes out at once; the tail is decided by the last window, which is sorted.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

from regen.producer.pending_prompt import Pending

T = TypeVar("T")


class LongestFirst:
    def __init__(self, order_window: int, first: int) -> None:
        """`order_window` prompts a window (0: the file's order), after a first window
        of `first` (one chunk's prompts)."""
        self._sorted = order_window > 0
        self._full = max(first, order_window)
        self.window = first

    def grow(self) -> None:
        """After the first window: the full one."""
        self.window = self._full

    def chunks(self, prompts: Sequence[tuple[Pending, T]], size: int) -> list[list[T]]:
        """The window's prompts in chunks of up to `size`, longest answer first (a prompt
        whose row has no answer counts as a median one); the file's order if unsorted."""
        ordered = list(prompts)
        if self._sorted:
            known = [item.answer_chars for item, _ in ordered if item.answer_chars is not None]
            if known:
                median = statistics.median(known)
                # Stable: equal answers keep the file's order.
                ordered.sort(key=lambda pair: -_or(pair[0].answer_chars, median))
        return [
            [prompt for _, prompt in ordered[start : start + size]]
            for start in range(0, len(ordered), size)
        ]


def _or(value: int | None, default: float) -> float:
    return default if value is None else value
