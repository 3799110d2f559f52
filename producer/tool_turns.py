"""Tool use in dataset rows: the tools a row offers, the calls its assistant turns make and
the results that answer them, in the OpenAI shape chat templates take.

- Tools: a row-level `tools` list of OpenAI tool objects (`{"type": "function",
  "function": {...}}`), or a JSON string of one, as LLaMA-Factory's ShareGPT (and glaive
  and xlam after it) store them. A bare function schema (`{"name", "description",
  "parameters"}`, their spelling) is wrapped as OpenAI's. An empty list is no tools.
- Calls: an assistant turn's `tool_calls`, its legacy `function_call`, or a ShareGPT
  `function_call` turn whose value is the JSON of `{"name", "arguments"}` or a list of
  them. Each becomes `{"id", "type": "function", "function": {"name", "arguments"}}` with
  `arguments` the JSON text of an object, OpenAI's shape. A call without an id gets
  `functions.NAME:INDEX`, the id Kimi's template and tool-call parsers use.
- Results: `tool` messages, legacy `function` messages and ShareGPT `observation` turns,
  each answering a call of the assistant turn before it. One without a `tool_call_id`
  answers the next unanswered call, in order, and is given that call's id.

Shapes a template cannot render raise `BadToolTurn` with one of the codes below (the
input stage's `Reason` lists them too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

BAD_TOOLS = "bad_tools"  # `tools` is not a list of objects (or the JSON of one)
BAD_TOOL_CALL = "bad_tool_call"  # a call without a function name, or not an object
BAD_TOOL_ARGUMENTS = "bad_tool_arguments"  # arguments that are not the JSON of an object
TOOL_WITHOUT_CALL = "tool_without_call"  # a tool result that answers no preceding call

# A turn as the row parser holds it: role, the template's extra message fields
# (tool_calls, tool_call_id, name), and where it is in the row (for messages).
ToolTurn = tuple[str, dict[str, Any], str]


class BadToolTurn(ValueError):
    """A tool part of a row that cannot be rendered: `reason` is one of the codes above."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def row_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The row's tools in OpenAI's shape, or None when it offers none."""
    value = row.get("tools")
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise BadToolTurn(BAD_TOOLS, f"'tools' is a string but not JSON: {exc}") from exc
    if not value:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise BadToolTurn(BAD_TOOLS, "'tools' is not a list of objects")
    return [_openai_tool(tool) for tool in value]


def _openai_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if "function" in tool or "type" in tool:
        return tool
    return {"type": "function", "function": tool}


def message_calls(item: dict[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The calls an OpenAI assistant message makes (`tool_calls`, or a legacy
    `function_call`), or None for a message that makes none."""
    if item.get("tool_calls"):
        calls = item["tool_calls"]
        if not isinstance(calls, list):
            raise BadToolTurn(BAD_TOOL_CALL, f"{where} has 'tool_calls' that is not a list")
        return [_call(call, index, where) for index, call in enumerate(calls)]
    if item.get("function_call"):
        return [_call({"function": item["function_call"]}, 0, where)]
    return None


def sharegpt_calls(value: object, where: str) -> list[dict[str, Any]]:
    """The calls of a ShareGPT `function_call` turn, whose value is JSON text."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise BadToolTurn(BAD_TOOL_CALL, f"{where} is a function call but not JSON") from exc
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise BadToolTurn(BAD_TOOL_CALL, f"{where} is a function call that calls nothing")
    return [_call({"function": call}, index, where) for index, call in enumerate(calls)]


def _call(call: object, index: int, where: str) -> dict[str, Any]:
    spot = f"{where} tool call {index}"
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise BadToolTurn(BAD_TOOL_CALL, f"{spot} is not an object with a 'function' object")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadToolTurn(BAD_TOOL_CALL, f"{spot} has no function name")
    call_id = call.get("id")
    return {
        "id": call_id if isinstance(call_id, str) and call_id else f"functions.{name}:{index}",
        "type": "function",
        "function": {"name": name, "arguments": _arguments(function.get("arguments"), spot)},
    }


def _arguments(value: object, spot: str) -> str:
    """The arguments as JSON text of an object: SGLang's chat path parses them into one
    before rendering and refuses anything else, so a row it would refuse is refused."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return orjson.dumps(value).decode()
    if isinstance(value, str):
        try:
            parsed = orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise BadToolTurn(
                BAD_TOOL_ARGUMENTS, f"{spot} has arguments that are not JSON"
            ) from exc
        if isinstance(parsed, dict):
            return value
    raise BadToolTurn(BAD_TOOL_ARGUMENTS, f"{spot} has arguments that are not a JSON object")


def link_results(turns: Sequence[ToolTurn]) -> None:
    """Check each tool result answers a call of the assistant turn before it, and give
    one without a `tool_call_id` the id of the next unanswered call (in place)."""
    unanswered: list[dict[str, Any]] = []
    for role, fields, where in turns:
        if role == "assistant":
            unanswered = list(fields.get("tool_calls") or [])
        elif role != "tool":
            unanswered = []
        elif not unanswered:
            raise BadToolTurn(TOOL_WITHOUT_CALL, f"{where} is a tool result with no call before it")
        elif "tool_call_id" not in fields:
            fields["tool_call_id"] = unanswered.pop(0)["id"]
        else:
            answered = [c for c in unanswered if c["id"] == fields["tool_call_id"]]
            if not answered:
                raise BadToolTurn(
                    TOOL_WITHOUT_CALL,
                    f"{where} answers call {fields['tool_call_id']!r}, which the assistant "
                    "turn before it does not make (or another result answered)",
                )
            unanswered.remove(answered[0])


def result_fields(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The `tool_call_id` and `name` a tool result message carries, as written."""
    fields = {}
    for field in ("tool_call_id", "name"):
        value = item.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadToolTurn(BAD_TOOL_CALL, f"{where} has a '{field}' that is not a string")
        fields[field] = value
    return fields


def key_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` as the prompt id sees them: arguments parsed, so that rows differing only
    in how they space their arguments' JSON (which renders the same) share one id."""
    calls = fields.get("tool_calls")
    if not calls:
        return fields
    parsed = [
        {
            **call,
            "function": {
                **call["function"],
                "arguments": orjson.loads(call["function"]["arguments"]),
            },
        }
        for call in calls
    ]
    return {**fields, "tool_calls": parsed}
