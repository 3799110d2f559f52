"""The tool calls a generated turn ends in, split from the text before them.

Shared by the generate stage (a turn's answer in the next turn's history, `--turns all`)
and the tokenize stage (the record's assistant message), so both read a turn alike.

Calls get ids where the model wrote none (Hermes style: Qwen, SmolLM2): the next turn's
tool results answer calls by id (`tool_call_id`). An id is derived from the record the
call is in (its id: a prompt's, or a turn's `<conversation>-<turn>`) and the call's
place in it, so both stages, and every rerun, give a call the same id.
"""

from __future__ import annotations

from typing import Any

from regen.common.chat_family import ChatFamily
from regen.common.tool_calls import opening_marker, parse_calls


def split_calls(
    family: ChatFamily,
    tokenizer: Any,
    body_ids: list[int],
    text: str,
    *,
    skip_special_tokens: bool,
) -> tuple[str, list[dict[str, Any]] | None]:
    """(the text to split into reasoning and answer, the calls) of an output whose ids,
    stop token left out, are `body_ids` and whose server text is `text`.

    A special opening token (Kimi's) is not in the server's text, so the calls are found
    in the ids and decoded with their markers; a text marker (`<tool_call>`) is found in
    the text. Calls that do not parse leave the text whole and no calls. Where the
    template does not render calls, the text keeps them too: the turn must re-render to
    its ids.
    """
    open_id = family.tool_call_open_id
    if open_id is not None and open_id in body_ids:
        at = body_ids.index(open_id)
        head = tokenizer.decode(body_ids[:at], skip_special_tokens=skip_special_tokens)
        calls_text = tokenizer.decode(body_ids[at:], skip_special_tokens=False)
    else:
        at = text.find(opening_marker(family.tool_call_format))
        head, calls_text = text[:at], text[at:]
    calls = parse_calls(family.tool_call_format, calls_text) if at >= 0 else None
    if calls is None or not text.startswith(head):
        return text, None
    if not family.renders_tool_calls:
        return text, calls
    if family.tool_call_format == "hermes":
        # Qwen-style templates write one newline between the content and the first call.
        head = head.removesuffix("\n")
    return head, calls


def call_id(record_id: str, index: int) -> str:
    """The id of the `index`th call (0 first) of record `record_id`'s turn, for a call the
    model wrote without one."""
    return f"call_{record_id}_{index}"


def with_call_ids(calls: list[dict[str, Any]], record_id: str) -> list[dict[str, Any]]:
    """`calls`, each without an id given `call_id`'s (those with one kept as written)."""
    return [
        call if call.get("id") else {"id": call_id(record_id, index), **call}
        for index, call in enumerate(calls)
    ]


def turn_calls(
    family: ChatFamily,
    tokenizer: Any,
    *,
    record_id: str,
    tools: list[dict[str, Any]] | None,
    output_ids: list[int],
    text: str,
    finish_reason: dict[str, Any],
    skip_special_tokens: bool,
) -> tuple[str, list[dict[str, Any]] | None]:
    """`split_calls` of a finished output: only a prompt with tools is answered with
    calls, and only a turn that stopped (not cut at max_new_tokens) ends in them. The
    stop token, when one matched, is not part of the calls. Calls without ids get
    `with_call_ids`' of `record_id`."""
    if not tools or finish_reason.get("type") != "stop":
        return text, None
    matched = finish_reason.get("matched")
    is_token = isinstance(matched, int) and not isinstance(matched, bool)
    body = output_ids[:-1] if is_token and output_ids[-1:] == [matched] else output_ids
    text, calls = split_calls(
        family, tokenizer, body, text, skip_special_tokens=skip_special_tokens
    )
    return text, None if calls is None else with_call_ids(calls, record_id)
