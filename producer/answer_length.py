"""How long the dataset's own answer to a row is: what predicts the length of the answer
the target will write (docs/design/producer.md, "Longest answers first").

A row that carries the answers regen regenerates (the trailing assistant turns of a
conversation, the assistant turns `--turns all` regenerates one by one, an Alpaca
`output`, a bare prompt's `response`) says how much the question asks for: a proof
asks for pages, a greeting for a line, whichever model answers. Only the order of
prompts depends on it, so it is read leniently: the row has already been checked by
producer/rows.py, and anything this cannot read counts as no answer (None), never as
an error.

The length is in characters: the order needs only a measure that grows with the answer,
and characters cost nothing to count, unlike tokens.
"""

from __future__ import annotations

from typing import Any

from regen.producer.rows import ASSISTANT_SPELLINGS, CONVERSATION_FIELDS

# Where a row without a messages list keeps its answer: Alpaca's `output`, and the
# names prompt/answer datasets give it (prompt/completion, question/answer, ...).
BARE_ANSWER_FIELDS = ("output", "response", "completion", "answer")


def dataset_answer_chars(row: object, *, every_turn: bool) -> int | None:
    """The characters of the row's own answers: its trailing assistant turns, or with
    `every_turn` (`--turns all`) every assistant turn; None when it carries none."""
    if not isinstance(row, dict):
        return None
    for name in (*CONVERSATION_FIELDS, "prompt"):
        items = row.get(name)
        if isinstance(items, list):
            return _conversation_answers(items, every_turn)
    for name in BARE_ANSWER_FIELDS:  # Alpaca's `output`, a bare prompt's answer
        if row.get(name) is not None:
            return _chars(row[name])
    return None


def _conversation_answers(items: list[Any], every_turn: bool) -> int | None:
    answers = []
    for item in reversed(items):
        if not _is_assistant(item):
            if every_turn:
                continue
            break
        answers.append(_message_chars(item))
    known = [n for n in answers if n is not None]
    return sum(known) if known else None


def _is_assistant(item: object) -> bool:
    if not isinstance(item, dict):
        return False
    role = item.get("role") if item.get("role") is not None else item.get("from")
    return isinstance(role, str) and role.strip().lower() in ASSISTANT_SPELLINGS


def _message_chars(item: dict[str, Any]) -> int | None:
    content = item.get("content") if item.get("content") is not None else item.get("value")
    calls = item.get("tool_calls")
    chars = _chars(content)
    if calls:  # a turn that calls tools writes its calls
        chars = (chars or 0) + len(str(calls))
    return chars


def _chars(content: object) -> int | None:
    """A content's characters: a string, or the text parts of a list."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        return sum(len(t) for t in texts if isinstance(t, str))
    return None
