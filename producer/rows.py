"""Turn a raw dataset row into the prompt regen sends: normalized chat messages.

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

Trailing assistant turns are dropped (they are what gets regenerated); the history up to
and including the last user turn is kept. A system message may only come first.

Normalization, which defines what counts as a duplicate: Unicode NFC, ``\\r\\n`` to
``\\n``, leading and trailing whitespace stripped from each content, roles lower-cased.
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from functools import cached_property

import orjson

from regen.common.dlq import ReasonCode, Refused


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
    # Rendering the prompt for the job (producer.enqueue; producer.prompt_scan counts).
    TEMPLATE_ERROR = "template_error"
    PROMPT_TOO_LONG = "prompt_too_long"


class BadRow(Refused):
    """A row that cannot become a prompt: a `Reason` code and a message naming the spot."""


@dataclass(frozen=True)
class Prompt:
    """The normalized messages to send (roles system/user/assistant, ending on user) and
    the row's own id, kept as provenance only."""

    messages: list[dict[str, str]]
    source_id: str | None = None

    @cached_property
    def id(self) -> str:
        return prompt_id(self.messages)


def prompt_id(messages: list[dict[str, str]]) -> str:
    """Stable 16-hex-char id of normalized messages (as `to_prompt` returns them).

    Identical content always gets the same id, so re-enqueueing a dataset is idempotent
    and exact duplicates collapse to one prompt.
    """
    blob = orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)
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
}
_CONVERSATION_FIELDS = ("messages", "conversations", "conversation")
_BARE_FIELDS = ("question", "text")
_ID_FIELDS = ("id", "uuid", "conversation_id", "idx", "question_id")
# A turn: role, normalized non-empty content, and where it is in the row (for messages).
_Turn = tuple[str, str, str]


def to_prompt(value: object, *, system_prompt: str | None = None) -> Prompt:
    """Interpret one raw row; raises BadRow with a `Reason` code when it cannot."""
    if not isinstance(value, dict):
        raise BadRow(Reason.NOT_AN_OBJECT, f"row is a JSON {_kind(value)}, not an object")
    turns = _turns(value)
    roles = [role for role, _, _ in turns]
    if "user" not in roles:
        raise BadRow(Reason.NO_USER_TURN, "row has no user turn")
    if roles[-1] != "user":
        raise BadRow(Reason.BAD_ORDER, f"{turns[-1][2]} is the last turn but not a user turn")
    for role, _, where in turns[1:]:
        if role == "system":
            raise BadRow(Reason.BAD_ORDER, f"{where} is a system message; only the first may be")
    messages = [{"role": role, "content": content} for role, content, _ in turns]
    if roles[0] != "system":
        system = _system_field(value)
        if system is None and system_prompt is not None:
            system = _normalize(system_prompt)
        if system:
            messages.insert(0, {"role": "system", "content": system})
    return Prompt(messages=messages, source_id=_source_id(value))


def _turns(row: dict[str, object]) -> list[_Turn]:
    for field in _CONVERSATION_FIELDS:
        if row.get(field) is not None:
            return _conversation(field, row[field])
    if row.get("instruction") is not None:
        return [("user", _alpaca(row), "'instruction'")]
    if isinstance(row.get("prompt"), list):
        return _conversation("prompt", row["prompt"])
    for field in ("prompt", *_BARE_FIELDS):
        if row.get(field) is not None:
            where = f"'{field}'"
            return [("user", _nonempty(_text(row[field], where), where), where)]
    raise BadRow(
        Reason.UNKNOWN_SHAPE,
        "row has none of 'messages', 'conversations', 'instruction', 'prompt', 'question', "
        f"'text' (its keys: {', '.join(sorted(map(str, row))) or 'none'})",
    )


def _conversation(field: str, items: object) -> list[_Turn]:
    """The turns of a messages list, trailing assistant turns dropped unchecked (they
    are what gets regenerated) and empty system messages dropped."""
    if not isinstance(items, list):
        raise BadRow(Reason.WRONG_TYPE, f"row has '{field}' but it is a {_kind(items)}, not a list")
    roles = [_role(f"{field}[{index}]", item) for index, item in enumerate(items)]
    while roles and roles[-1] == "assistant":
        roles.pop()
    turns = []
    for index, role in enumerate(roles):
        item, where = items[index], f"{field}[{index}]"
        key = "value" if item.get("content") is None else "content"
        if item.get(key) is None:
            raise BadRow(Reason.WRONG_TYPE, f"{where} has no 'content' (or 'value')")
        content = _text(item[key], where)
        if role == "system" and not content:
            continue  # an empty system message is no system message
        turns.append((role, _nonempty(content, where), where))
    return turns


def _role(where: str, item: object) -> str:
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
    role = _ROLES.get(raw.strip().lower())
    if role is None:
        raise BadRow(
            Reason.UNSUPPORTED_ROLE,
            f"{where} has role {raw!r}; regen takes system, user and assistant turns only",
        )
    return role


def _text(content: object, where: str) -> str:
    """Normalized text of a content: a string, or a list of text parts."""
    if isinstance(content, str):
        return _normalize(content)
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
    return _normalize("\n".join(texts))


def _nonempty(content: str, where: str) -> str:
    if not content:
        raise BadRow(Reason.EMPTY_CONTENT, f"{where} is empty or whitespace only")
    return content


def _alpaca(row: dict[str, object]) -> str:
    parts = [_text(row["instruction"], "'instruction'")]
    if row.get("input") is not None:
        parts.append(_text(row["input"], "'input'"))
    return _nonempty("\n\n".join(part for part in parts if part), "'instruction' (with 'input')")


def _system_field(row: dict[str, object]) -> str | None:
    if row.get("system") is None:
        return None
    return _text(row["system"], "'system'") or None


def _source_id(row: dict[str, object]) -> str | None:
    for field in _ID_FIELDS:
        value = row.get(field)
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
