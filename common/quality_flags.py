"""The names of the quality flags (computed in common/quality.py), apart from how they
are computed, so that the command line can list them without loading a tokenizer's
dependencies."""

from __future__ import annotations

import enum


class Flag(str, enum.Enum):
    EMPTY = "empty"
    THINKING_ONLY = "thinking_only"
    TRUNCATED = "truncated"
    REPETITION = "repetition"
    BAD_TOOL_CALL = "bad_tool_call"


FLAGS = tuple(flag.value for flag in Flag)
# What an export leaves out unless told otherwise: answers a drafter should not learn
# from. A truncated answer is kept: every token of it is still the target's own.
DEFAULT_DROP_FLAGS = tuple(flag for flag in FLAGS if flag != Flag.TRUNCATED)
