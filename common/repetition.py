"""Does a generated answer end in a loop? (the `repetition` quality flag)

A large model sampling a long answer sometimes falls into a loop: the same span of tokens
again and again until `max_new_tokens` cuts it, in the thinking as often as in the answer.
A drafter trained on such a record learns to predict loops. The check works on the output
ids the tokenize stage already holds (no decoding) and looks only at the tail: a loop that
the model left again is text, not a failure.

The rule (docs/design/records.md, "Quality flags"): the output ends in a loop when, for some period
`p` (1 to `MAX_PERIOD` tokens), its last `span` tokens repeat with period `p` (each token
equal to the one `p` before it, allowing `MISMATCH_RATE` of them to differ: sampling at
temperature 1 varies a loop a little) and the span holds at least `MIN_REPEATS` copies and
`MIN_SPAN` tokens. Why these values:

- `MIN_REPEATS` = 4: clean answers do repeat a span twice (an answer that restates what its
  thinking drafted) and lists or tables repeat a shape, but not the same tokens four times
  in a row at the very end.
- `MIN_SPAN` = 64 tokens: a run of one token (`p` = 1) shorter than that is a ruler line
  or a row of dots in clean text; 64 tokens of one repeated token is ~250 characters.
- `MISMATCH_RATE` = 0.15: a loop whose copies differ in a counter or a word or two still
  reads as a loop; clean text never comes close (measured in `bench/repetition.py`:
  false positives on clean text and recall on made loops, with and without noise).
- `MAX_PERIOD` = 2048 tokens: a loop of whole paragraphs; `WINDOW` bounds the work to the
  last 8192 tokens, so the check costs the same for a 16K-token answer as for an 8K one.

Candidate periods come from where the tail's last few tokens occurred before (a loop's
period is the distance to its previous copy), checked at a few anchors near the end so a
varied last copy still yields its period; each candidate is then checked with numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_REPEATS = 4
MIN_SPAN = 64
MISMATCH_RATE = 0.15
MAX_PERIOD = 2048
WINDOW = 8192
# The n-gram that finds a candidate period, and how far from the end its anchors sit.
ANCHOR_TOKENS = 4
ANCHOR_OFFSETS = (0, 8, 24, 56)
# The shortest periods found at each anchor that are checked.
CANDIDATES_PER_ANCHOR = 6


@dataclass(frozen=True)
class Loop:
    """The loop an output ends in: its period and how many tail tokens it covers."""

    period: int
    span: int

    @property
    def repeats(self) -> float:
        return self.span / self.period


def tail_loop(ids: Sequence[int]) -> Loop | None:
    """The loop `ids` ends in, or None (see the module docstring for the rule)."""
    tail = np.asarray(ids[-WINDOW:], dtype=np.int64)
    n = len(tail)
    if n < MIN_SPAN:
        return None
    for period in _candidate_periods(tail):
        span = _periodic_span(tail, period)
        if span >= MIN_SPAN and span >= MIN_REPEATS * period:
            return Loop(period, span)
    return None


def _candidate_periods(tail: np.ndarray) -> list[int]:
    """Distances from anchors near the end back to earlier copies of their n-gram, the
    shortest first (a loop's own period before its multiples)."""
    n = len(tail)
    found: set[int] = set()
    for offset in ANCHOR_OFFSETS:
        end = n - offset  # the anchor is tail[end - ANCHOR_TOKENS : end]
        start = end - ANCHOR_TOKENS
        if start < 1:
            break
        # Positions i < start where tail[i : i + ANCHOR_TOKENS] equals the anchor.
        hits = tail[:start] == tail[start]
        for k in range(1, ANCHOR_TOKENS):
            hits &= tail[k : start + k] == tail[start + k]
        earlier = np.flatnonzero(hits)
        periods = start - earlier[::-1]  # nearest copy first
        found.update(int(p) for p in periods[periods <= MAX_PERIOD][:CANDIDATES_PER_ANCHOR])
    return sorted(found)


def _periodic_span(tail: np.ndarray, period: int) -> int:
    """How many tokens at the end of `tail` repeat with `period`: the period itself plus
    the longest run of comparisons back from the end whose mismatch rate stays within
    MISMATCH_RATE, up to its earliest match."""
    n = len(tail)
    if period >= n:
        return 0
    # differs[j]: tail[n-1-j] != tail[n-1-j-period], from the end backwards.
    differs = (tail[period:] != tail[:-period])[::-1]
    mismatches = np.cumsum(differs)
    lengths = np.arange(1, len(differs) + 1)
    within = np.flatnonzero(mismatches <= MISMATCH_RATE * lengths)
    if len(within) == 0:
        return 0
    # The run ends at its earliest matching comparison: the mismatches the rate lets it
    # run on into the text before the loop are not part of it.
    matching = np.flatnonzero(~differs[: within[-1] + 1])
    return 0 if len(matching) == 0 else int(matching[-1]) + 1 + period
