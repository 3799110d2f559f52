"""Turn a raw dataset row into the prompt regen sends: chat messages, and the tools
they may call.

Row shapes, detected per row (a key whose value is null counts as absent, because
Parquet files give every row every column):

- OpenAI ``messages``: a list of ``{"role", "content"}``; content is a string or a list
  of ``{"type": "text", "text": ...}`` parts, joined with newlines as vLLM does.
- ShareGPT ``conversations`` (or ``conversation``, as in LMSYS-Chat and WildChat): a list
  of ``{"from", "value"}`` or ``{"role", "content"}``.
- Alpaca: ``instruction`` plus an optional ``input``, joined by a blank line, as one user
  turn; ``output`` is dropped.
- A bare prompt: ``prompt`` (a string, or a messages list), else ``question``, else
  ``text``.

Any shape may carry a top-level ``system`` string (Alpaca and LLaMA-Factory's ShareGPT
do). The system message is, by precedence: the conversation's own, then the row's
``system`` field, then the CLI's ``system_prompt``. An empty system message counts as
none.

Tool use (the section below): a row-level ``tools`` list, assistant turns with
``tool_calls``, ``tool``/``function`` results, ShareGPT ``function_call`` and
``observation`` turns.

Trailing assistant turns are dropped (they are what gets regenerated); the history up to
and including the last user or tool-result turn is kept. A system message may only come
first.

Text is rendered as the dataset writes it. The dedupe key (the prompt id) normalizes it:
Unicode NFC, ``\\r\\n`` to ``\\n``, leading and trailing whitespace stripped from each
content, roles lower-cased. A job made before that rule (`jobspec.PROMPT_TEXT_STRIPPED`)
rendered the normalized text itself, and keeps doing so.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import orjson

from regen.common.conversation import BLOCKED
from regen.common.dlq import ReasonCode, Refused
from regen.common.jobspec import PROMPT_TEXT_AS_WRITTEN, PROMPT_TEXT_STRIPPED


class Reason(ReasonCode):
    """Every reason the input stage rejects a row or prompt for: the input DLQ's codes."""

    # Reading the file (producer.readers).
    INVALID_JSON = "invalid_json"
    UNDECODABLE = "undecodable"
    CORRUPT_FILE = "corrupt_file"
    # Interpreting the row (this module).
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_SHAPE = "unknown_shape"
    WRONG_TYPE = "wrong_type"
    UNSUPPORTED_ROLE = "unsupported_role"
    UNSUPPORTED_CONTENT = "unsupported_content"
    EMPTY_CONTENT = "empty_content"
    NO_USER_TURN = "no_user_turn"
    BAD_ORDER = "bad_order"
    # Tool use (the tool section below).
    BAD_TOOLS = "bad_tools"  # `tools` is not a list of objects (or the JSON of one)
    BAD_TOOL_CALL = "bad_tool_call"  # a call without a function name, or not an object
    BAD_TOOL_ARGUMENTS = "bad_tool_arguments"  # arguments that are not the JSON of an object
    TOOL_WITHOUT_CALL = "tool_without_call"  # a tool result that answers no preceding call
    # Rendering the prompt for the job (producer.enqueue; producer.prompt_scan counts).
    TEMPLATE_ERROR = "template_error"
    PROMPT_TOO_LONG = "prompt_too_long"
    # Refused by its size in bytes before tokenizing (`--max-row-bytes`).
    ROW_TOO_LARGE = "row_too_large"
    # A turn of a conversation Redis lost whose earlier turns are in shards without their
    # answers saved (`regen recover` saves them; producer/lost_turns.py).
    HISTORY_LOST = "history_lost"
    # A later turn of a conversation (`--turns all`) whose first turn was refused.
    BLOCKED = BLOCKED


# --- tool use -------------------------------------------------------------------------
# Tool use in dataset rows: the tools a row offers, the calls its assistant turns make and
# the results that answer them, in the OpenAI shape chat templates take.
#
# - Tools: a row-level `tools` list of OpenAI tool objects (`{"type": "function",
#   "function": {...}}`), or a JSON string of one, as LLaMA-Factory's ShareGPT (and glaive
#   and xlam after it) store them. A bare function schema (`{"name", "description",
#   "parameters"}`, their spelling) is wrapped as OpenAI's. An empty list is no tools.
# - Calls: an assistant turn's `tool_calls`, its legacy `function_call`, or a ShareGPT
#   `function_call` turn whose value is the JSON of `{"name", "arguments"}` or a list of
#   them. Each becomes `{"id", "type": "function", "function": {"name", "arguments"}}` with
#   `arguments` the JSON text of an object, OpenAI's shape. A call without an id gets
#   `functions.NAME:INDEX`, the id Kimi's template and tool-call parsers use.
# - Results: `tool` messages, legacy `function` messages and ShareGPT `observation` turns,
#   each answering a call of the assistant turn before it. One without a `tool_call_id`
#   answers the next unanswered call, in order, and is given that call's id.
#
# Shapes a template cannot render raise `BadToolTurn` with a tool code of `Reason`.


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
            raise BadToolTurn(Reason.BAD_TOOLS, f"'tools' is a string but not JSON: {exc}") from exc
    if not value:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise BadToolTurn(Reason.BAD_TOOLS, "'tools' is not a list of objects")
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
            raise BadToolTurn(Reason.BAD_TOOL_CALL, f"{where} has 'tool_calls' that is not a list")
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
            raise BadToolTurn(
                Reason.BAD_TOOL_CALL, f"{where} is a function call but not JSON"
            ) from exc
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise BadToolTurn(Reason.BAD_TOOL_CALL, f"{where} is a function call that calls nothing")
    return [_call({"function": call}, index, where) for index, call in enumerate(calls)]


def _call(call: object, index: int, where: str) -> dict[str, Any]:
    spot = f"{where} tool call {index}"
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise BadToolTurn(Reason.BAD_TOOL_CALL, f"{spot} is not an object with a 'function' object")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise BadToolTurn(Reason.BAD_TOOL_CALL, f"{spot} has no function name")
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
                Reason.BAD_TOOL_ARGUMENTS, f"{spot} has arguments that are not JSON"
            ) from exc
        if isinstance(parsed, dict):
            return value
    raise BadToolTurn(Reason.BAD_TOOL_ARGUMENTS, f"{spot} has arguments that are not a JSON object")


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
            raise BadToolTurn(
                Reason.TOOL_WITHOUT_CALL, f"{where} is a tool result with no call before it"
            )
        elif "tool_call_id" not in fields:
            fields["tool_call_id"] = unanswered.pop(0)["id"]
        else:
            answered = [c for c in unanswered if c["id"] == fields["tool_call_id"]]
            if not answered:
                raise BadToolTurn(
                    Reason.TOOL_WITHOUT_CALL,
                    f"{where} answers call {fields['tool_call_id']!r}, which the assistant "
                    "turn before it does not make (or another result answered)",
                )
            unanswered.remove(answered[0])


def result_fields(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The `tool_call_id` and `name` a tool result message carries, as written."""
    fields = {}
    for key in ("tool_call_id", "name"):
        value = item.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadToolTurn(Reason.BAD_TOOL_CALL, f"{where} has a '{key}' that is not a string")
        fields[key] = value
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


# --- rows -------------------------------------------------------------------------------
class BadRow(Refused):
    """A row that cannot become a prompt: a `Reason` code and a message naming the spot."""


@dataclass(frozen=True)
class Prompt:
    """The messages to send (roles system/user/assistant/tool, ending on user or tool), the
    tools they may call, and the row's own id, kept as provenance only.

    `key` is the normalized form of `messages` that the id hashes; None when `messages`
    are that form already.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    source_id: str | None = None
    key: list[dict[str, Any]] | None = field(default=None, repr=False)

    @cached_property
    def id(self) -> str:
        return prompt_id(self.messages if self.key is None else self.key, self.tools)


def prompt_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """Stable 16-hex-char id of normalized messages (a `Prompt`'s key) and their tools.

    Identical content always gets the same id, so re-enqueueing a dataset is idempotent
    and exact duplicates collapse to one prompt. Without tools the id is the one regen
    always gave those messages.
    """
    content: object = messages if not tools else {"messages": messages, "tools": tools}
    blob = orjson.dumps(content, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


# Role spellings seen in the wild -> the chat-template role.
_ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "function_call": "assistant",  # ShareGPT: its value is the call
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy tool result
    "observation": "tool",  # ShareGPT
}
# The spellings of an assistant turn (producer/answer_length.py reads the dataset's own).
ASSISTANT_SPELLINGS = frozenset(s for s, role in _ROLES.items() if role == "assistant")
CONVERSATION_FIELDS = ("messages", "conversations", "conversation")
_BARE_FIELDS = ("question", "text")
_ID_FIELDS = ("id", "uuid", "conversation_id", "idx", "question_id")


@dataclass(frozen=True)
class _Text:
    raw: str  # as the dataset writes it
    key: str  # normalized (see the module docstring)


@dataclass(frozen=True)
class _Turn:
    role: str
    text: _Text
    where: str  # where it is in the row, for messages
    # What else the template takes: tool_calls, or a result's tool_call_id and name.
    fields: dict[str, Any] = field(default_factory=dict)


def to_prompt(
    value: object, *, system_prompt: str | None = None, prompt_text: str = PROMPT_TEXT_AS_WRITTEN
) -> Prompt:
    """Interpret one raw row; raises BadRow with a `Reason` code when it cannot.

    `prompt_text` is the job's rule (`jobspec.PROMPT_TEXT_RULES`): which text is rendered.
    """
    if not isinstance(value, dict):
        raise BadRow(Reason.NOT_AN_OBJECT, f"row is a JSON {_kind(value)}, not an object")
    try:
        turns = _turns(value)
        tools = row_tools(value)
        _check_order(turns)
        link_results([(t.role, t.fields, t.where) for t in turns])
    except BadToolTurn as exc:
        raise BadRow(Reason(exc.reason), exc.message) from exc
    if turns[0].role != "system":
        system = _system_field(value)
        if system is None and system_prompt is not None:
            system = _Text(system_prompt, _normalize(system_prompt))
        if system is not None and system.key:
            turns.insert(0, _Turn("system", system, "system prompt"))
    stripped = prompt_text == PROMPT_TEXT_STRIPPED
    messages = [
        _message(turn, turn.text.key if stripped else turn.text.raw, turn.fields) for turn in turns
    ]
    key = [_message(turn, turn.text.key, key_fields(turn.fields)) for turn in turns]
    return Prompt(messages=messages, tools=tools, source_id=_source_id(value), key=key)


def _message(turn: _Turn, content: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"role": turn.role, "content": content, **fields}


def _check_order(turns: list[_Turn]) -> None:
    roles = [turn.role for turn in turns]
    if "user" not in roles:
        raise BadRow(Reason.NO_USER_TURN, "row has no user turn")
    if roles[-1] not in ("user", "tool"):
        raise BadRow(
            Reason.BAD_ORDER, f"{turns[-1].where} is the last turn but not a user or tool turn"
        )
    for turn in turns[1:]:
        if turn.role == "system":
            raise BadRow(
                Reason.BAD_ORDER, f"{turn.where} is a system message; only the first may be"
            )


def _turns(row: dict[str, object]) -> list[_Turn]:
    for name in CONVERSATION_FIELDS:
        if row.get(name) is not None:
            return _conversation(name, row[name])
    if row.get("instruction") is not None:
        return [_Turn("user", _alpaca(row), "'instruction'")]
    if isinstance(row.get("prompt"), list):
        return _conversation("prompt", row["prompt"])
    for name in ("prompt", *_BARE_FIELDS):
        if row.get(name) is not None:
            where = f"'{name}'"
            return [_Turn("user", _nonempty(_text(row[name], where), where), where)]
    raise BadRow(
        Reason.UNKNOWN_SHAPE,
        "row has none of 'messages', 'conversations', 'instruction', 'prompt', 'question', "
        f"'text' (its keys: {', '.join(sorted(map(str, row))) or 'none'})",
    )


def _conversation(name: str, items: object) -> list[_Turn]:
    """The turns of a messages list, trailing assistant turns dropped unchecked (they
    are what gets regenerated) and empty system messages dropped."""
    if not isinstance(items, list):
        raise BadRow(Reason.WRONG_TYPE, f"row has '{name}' but it is a {_kind(items)}, not a list")
    spellings = [_spelling(f"{name}[{index}]", item) for index, item in enumerate(items)]
    roles = [_ROLES[spelling] for spelling in spellings]
    while roles and roles[-1] == "assistant":
        roles.pop()
    turns = []
    for index, role in enumerate(roles):
        item, where = items[index], f"{name}[{index}]"
        turn = _item_turn(item, role, spellings[index] == "function_call", where)
        if turn is not None:
            turns.append(turn)
    return turns


def _item_turn(item: dict[str, Any], role: str, sharegpt_call: bool, where: str) -> _Turn | None:
    """One kept turn of a messages list; None for an empty system message."""
    key = "value" if item.get("content") is None else "content"
    calls: list[dict[str, Any]] | None = None
    if sharegpt_call:
        calls = sharegpt_calls(item.get(key), where)
    elif role == "assistant":
        calls = message_calls(item, where)
    if calls is not None:
        # A turn that calls tools may say nothing else (OpenAI gives it null content).
        no_text = sharegpt_call or item.get(key) is None
        text = _Text("", "") if no_text else _text(item[key], where)
        return _Turn(role, text, where, {"tool_calls": calls})
    if item.get(key) is None:
        raise BadRow(Reason.WRONG_TYPE, f"{where} has no 'content' (or 'value')")
    text = _text(item[key], where)
    if role == "system" and not text.key:
        return None  # an empty system message is no system message
    if role == "tool":  # a tool may well return nothing
        return _Turn(role, text, where, result_fields(item, where))
    return _Turn(role, _nonempty(text, where), where)


def _spelling(where: str, item: object) -> str:
    """The role as the row spells it, lower-cased; one of `_ROLES`."""
    if not isinstance(item, dict):
        raise BadRow(Reason.WRONG_TYPE, f"{where} is a {_kind(item)}, not an object")
    # ShareGPT says from/value, OpenAI role/content; a Parquet struct may hold all four
    # with nulls, so the non-null one is the one meant.
    key = "from" if item.get("role") is None else "role"
    raw = item.get(key)
    if raw is None:
        raise BadRow(Reason.WRONG_TYPE, f"{where} has no 'role' (or 'from')")
    if not isinstance(raw, str):
        raise BadRow(Reason.WRONG_TYPE, f"{where} has a '{key}' that is a {_kind(raw)}")
    spelling = raw.strip().lower()
    if spelling not in _ROLES:
        raise BadRow(
            Reason.UNSUPPORTED_ROLE,
            f"{where} has role {raw!r}; regen takes system, user, assistant and tool turns",
        )
    return spelling


def _text(content: object, where: str) -> _Text:
    """The text of a content: a string, or a list of text parts."""
    if isinstance(content, str):
        return _Text(content, _normalize(content))
    if not isinstance(content, list):
        raise BadRow(Reason.WRONG_TYPE, f"{where} has content that is a {_kind(content)}")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            raise BadRow(Reason.WRONG_TYPE, f"{where} content part {index} is not an object")
        kind = part.get("type") or "text"
        if kind != "text":
            raise BadRow(
                Reason.UNSUPPORTED_CONTENT,
                f"{where} content part {index} is of type {kind!r}; only text is supported",
            )
        if not isinstance(part.get("text"), str):
            raise BadRow(Reason.WRONG_TYPE, f"{where} content part {index} has no 'text' string")
        texts.append(part["text"])
    joined = "\n".join(texts)
    return _Text(joined, _normalize(joined))


def _nonempty(text: _Text, where: str) -> _Text:
    if not text.key:
        raise BadRow(Reason.EMPTY_CONTENT, f"{where} is empty or whitespace only")
    return text


def _alpaca(row: dict[str, object]) -> _Text:
    parts = [_text(row["instruction"], "'instruction'")]
    if row.get("input") is not None:
        parts.append(_text(row["input"], "'input'"))
    kept = [part for part in parts if part.key]
    # The key joins the normalized parts: the text regen always gave these rows' ids.
    text = _Text("\n\n".join(p.raw for p in kept), "\n\n".join(p.key for p in kept))
    return _nonempty(text, "'instruction' (with 'input')")


def _system_field(row: dict[str, object]) -> _Text | None:
    if row.get("system") is None:
        return None
    text = _text(row["system"], "'system'")
    return text if text.key else None


def _source_id(row: dict[str, object]) -> str | None:
    for name in _ID_FIELDS:
        value = row.get(name)
        # bool is an int subclass, and a flag is no id.
        if isinstance(value, str | int) and not isinstance(value, bool) and value != "":
            return str(value)
    return None


def _normalize(text: str) -> str:
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return text.replace("\r\n", "\n").strip()


def _kind(value: object) -> str:
    """JSON's name for a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
