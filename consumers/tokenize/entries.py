"""Reading a results-stream entry: a GeneratedResult, or why the entry is unreadable.

One unreadable entry (not JSON, not an object, a field missing or of the wrong type, no
result field at all) must not stop the stage, or it would crash-loop on that entry: it
is dead-lettered with its bytes (capped) and a reason, and acknowledged
(docs/design/tokenize.md, Tokenize). An entry written by a newer regen, with fields this one does
not know (in the result or beside it on the entry), is read without them: a rolling
upgrade that adds a field must not dead-letter the results of the upgraded workers.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson

from regen.common.record import Reason
from regen.common.results import FIELD, GeneratedResult

# Bytes of an unreadable entry kept in its dead letter (as the generate stage keeps a
# poison message's): enough to see what wrote it, bounded however large the entry.
RAW_LIMIT = 64 * 1024
# An id as a result encodes it: orjson writes the dataclass's fields in order, `id`
# first, so a result cut short still names its prompt.
_LEADING_ID = re.compile(rb'\{\s*"id"\s*:\s*"([^"\\:]{1,200})"')

_NONE = type(None)
# Every GeneratedResult field with the JSON types it may hold; bool is refused where
# an int is expected (JSON `true` is no token id). `text` is None from a server started
# with --skip-tokenizer-init (the record decodes the ids).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "job": (str,), "chunk": (str,), "prompt_ids": (list,),
    "messages": (list,), "source": (dict,), "output_ids": (list,), "text": (str, _NONE),
    "finish_reason": (dict,), "prompt_tokens": (int,), "completion_tokens": (int,),
    "cached_tokens": (int, _NONE), "latency_s": (float, int), "server": (str,),
    "worker": (str,), "attempt": (int,), "sampling": (dict,),
    "conversation_id": (str, _NONE), "turn": (int, _NONE), "tools": (list, _NONE),
    "server_version": (str, _NONE), "resumed_tokens": (int,),
}  # fmt: skip
# Fields older results lack (the dataclass's defaults fill them in).
REQUIRED = frozenset(FIELD_TYPES) - {
    "sampling",
    "conversation_id",
    "turn",
    "tools",
    "server_version",
    "resumed_tokens",
}
_TOKEN_LISTS = ("prompt_ids", "output_ids")


@dataclass(frozen=True)
class Unreadable:
    """An entry that gives no result: why, and what it held."""

    reason: Reason
    message: str
    raw: bytes  # the result field's value, or the whole entry when it has none
    prompt_id: str | None  # the prompt it names, when that can still be read

    def entry_id(self) -> str:
        """The DLQ entry id of an entry naming no prompt of the job: stable per content,
        so the same entry read twice (a redelivery) overwrites its dead letter. Its ':'
        marks it as no prompt's (docs/design/records.md, Dead-letter entries)."""
        return f"result:raw-{hashlib.blake2b(self.raw, digest_size=8).hexdigest()}"

    def payload(self) -> dict[str, Any]:
        kept = self.raw[:RAW_LIMIT]
        try:
            text, encoding = kept.decode(), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(kept).decode(), "base64"
        return {
            "raw": text,
            "encoding": encoding,
            "raw_bytes": len(self.raw),
            "truncated": len(self.raw) > RAW_LIMIT,
        }


def _wrong_type(name: str, value: Any) -> bool:
    """Whether a field's value is not of its type (token lists and messages item by item:
    a string among the ids would fail deep in the record's checks)."""
    kinds = FIELD_TYPES[name]
    if isinstance(value, bool):
        return bool not in kinds
    if not isinstance(value, kinds):
        return True
    items: list[Any] = value if isinstance(value, list) else []
    if name in _TOKEN_LISTS:
        return not all(type(x) is int for x in items)
    if name == "messages":
        return not all(isinstance(m, dict) for m in items)
    return False


def read_entry(fields: dict[bytes, bytes]) -> GeneratedResult | Unreadable:
    """The result an entry holds; unknown fields (of the entry, of the result) ignored."""
    raw = fields.get(FIELD)
    if raw is None:
        whole = orjson.dumps({k.decode(errors="replace"): v.decode(errors="replace")
                              for k, v in fields.items()})  # fmt: skip
        names = ", ".join(sorted(k.decode(errors="replace") for k in fields))
        return Unreadable(
            Reason.ENTRY_WITHOUT_RESULT, f"no {FIELD.decode()!r} field (fields: {names})", whole,
            None,
        )  # fmt: skip
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        found = _LEADING_ID.match(raw)
        pid = found[1].decode(errors="replace") if found else None
        return Unreadable(Reason.RESULT_NOT_JSON, f"not JSON: {exc}", raw, pid)
    if not isinstance(value, dict):
        kind = type(value).__name__
        return Unreadable(Reason.RESULT_NOT_AN_OBJECT, f"a JSON {kind}, not an object", raw, None)
    pid = value.get("id")
    pid = pid if isinstance(pid, str) and pid and ":" not in pid else None
    missing = sorted(REQUIRED - value.keys())
    if missing:
        message = f"fields missing: {', '.join(missing)}"
        return Unreadable(Reason.RESULT_MISSING_FIELDS, message, raw, pid)
    wrong = [name for name in FIELD_TYPES if name in value and _wrong_type(name, value[name])]
    if wrong:
        message = "wrong types: " + ", ".join(f"{n} ({type(value[n]).__name__})" for n in wrong)
        return Unreadable(Reason.RESULT_WRONG_TYPE, message, raw, pid)
    return GeneratedResult(**{name: value[name] for name in FIELD_TYPES if name in value})
