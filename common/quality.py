"""Quality flags: what a trainer may want to leave out of a record, said in the record.

A record stays token-exact and on-policy whatever its flags: the flags say how the answer
went, so that an export can drop what a drafter should not learn from (docs/design/records.md,
"Quality flags"). They are computed by the tokenize stage from what it already holds:

- `empty`: no answer text, no tool call and no thinking.
- `thinking_only`: thinking that never closed, or closed with no answer after it.
- `truncated`: cut by `max_new_tokens` or the context (finish reason `length`).
- `repetition`: the output ends in a loop (common/repetition.py).
- `bad_tool_call`: the answer opens a tool call that does not parse, or calls a tool the
  prompt did not offer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from regen.common.chat_family import ChatFamily
from regen.common.quality_flags import Flag
from regen.common.repetition import tail_loop
from regen.common.tool_calls import opening_marker


def quality_flags(
    family: ChatFamily,
    *,
    finish: str,
    body_ids: Sequence[int],
    reasoning: str | None,
    answer: str,
    calls: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
) -> list[str]:
    """The flags of a generated turn, in `Flag`'s order; `body_ids` are its output ids
    less the stop token that ended it."""
    flags = []
    has_answer = bool(answer.strip()) or bool(calls)
    if not has_answer:
        flags.append(Flag.THINKING_ONLY if reasoning and reasoning.strip() else Flag.EMPTY)
    if finish == "length":
        flags.append(Flag.TRUNCATED)
    if tail_loop(body_ids) is not None:
        flags.append(Flag.REPETITION)
    if _bad_tool_call(family, body_ids, reasoning, answer, calls, tools):
        flags.append(Flag.BAD_TOOL_CALL)
    return [flag.value for flag in flags]


def _bad_tool_call(
    family: ChatFamily,
    body_ids: Sequence[int],
    reasoning: str | None,
    answer: str,
    calls: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
) -> bool:
    """The answer opens a call that did not parse, or a parsed call names a tool the
    prompt did not offer. Only the answer counts: thinking may discuss the call format.
    Kimi opens calls with a special token, which is not in the server's text: it is
    looked for in the ids after the think span; a text marker, in the answer."""
    if calls:
        offered = {tool.get("function", {}).get("name") for tool in tools or ()}
        return any(call.get("function", {}).get("name") not in offered for call in calls)
    open_id = family.tool_call_open_id
    if family.tool_call_format == "kimi" and open_id is not None:
        return open_id in _answer_ids(family, body_ids, thought=reasoning is not None)
    return opening_marker(family.tool_call_format) in answer


def _answer_ids(family: ChatFamily, ids: Sequence[int], *, thought: bool) -> Sequence[int]:
    """The ids after the think span: none when it never closed."""
    close = family.think_close_id
    if close is None or close not in ids:
        return () if thought else ids
    return ids[len(ids) - list(reversed(ids)).index(close) :]
