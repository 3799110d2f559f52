"""The drift check: does re-rendering a record's conversation with the chat template give
its `input_ids` back?

The conversation is rendered to text and compared in two parts. The prompt's ids up to
their last cut token (a special token the tokenizer always splits at, below) are taken
as the tokenizer's own encoding of their text: regen rendered them with this tokenizer
(the job's fingerprint, checked when the job is opened). So the rendered text must start
with exactly that text (a template that renders history differently from a prompt fails
here), and only the rest, the generation prompt and the answer, is tokenized again: the
same ids as tokenizing the whole text, because the tokenizer encodes the text on each
side of a cut token on its own. That is most of the check's cost saved: the system
prompt and the question are usually most of a record. Any doubt (no cut token, a
tokenizer this does not hold for, text that differs) takes the whole re-tokenization,
which also finds where the ids depart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from regen.common.chat_family import encode_text, pipeline, render_conversation_text
from regen.common.piece_encoding import encodes_piecewise


def cut_ids(tokenizer: Any) -> frozenset[int]:
    """The special tokens a rendering can be cut after (empty: never cut). The tokenizer
    must encode pieces on their own (`encodes_piecewise`), and each token must be
    matched wherever its text stands: not stripping or grabbing neighbouring text, not
    matched after normalization, and not part of a longer added token that could run on
    past it."""
    backend = pipeline(tokenizer)
    if backend is None or not encodes_piecewise(backend):
        return frozenset()
    added = tokenizer.added_tokens_decoder
    contents = [token.content for token in added.values()]
    return frozenset(
        token_id
        for token_id, token in added.items()
        if token.special
        and not (token.lstrip or token.rstrip or token.single_word or token.normalized)
        and not any(_runs_on_past(other, token.content) for other in contents)
    )


def _runs_on_past(other: str, content: str) -> bool:
    """Whether `other` holds a suffix of `content` with more text after it: a match of
    `other` could then span the end of `content`."""
    return other != content and any(content[start:] in other[:-1] for start in range(len(content)))


def drift_at(
    tokenizer: Any,
    cuts: frozenset[int],
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None,
    input_ids: list[int],
    n_prompt: int,
) -> int | None:
    """Where re-rendering the conversation first departs from input_ids, or None; raises
    ChatTemplateError.

    Compared over input_ids' length: templates may append tokens the model never
    generates after the end of turn (chatml's newline), and a truncated record has no
    end of turn at all.
    """
    text = render_conversation_text(tokenizer, messages, template_kwargs, tools)
    if _matches_after_cut(tokenizer, cuts, text, input_ids, n_prompt):
        return None
    rendered = encode_text(tokenizer, text)
    n = len(input_ids)
    if rendered[:n] == input_ids:  # compared in C
        return None
    return first_difference(rendered[:n], input_ids)


def _matches_after_cut(
    tokenizer: Any, cuts: frozenset[int], text: str, input_ids: list[int], n_prompt: int
) -> bool:
    """True when `text` starts with the prompt's text up to its last cut token and
    tokenizes, after it, to the rest of input_ids; False also when undecided."""
    cut = next((i + 1 for i in range(n_prompt - 1, -1, -1) if input_ids[i] in cuts), 0)
    backend = pipeline(tokenizer)  # decodes and encodes as transformers would
    if not cut or backend is None:  # None: its settings changed since cut_ids looked
        return False
    head = backend.decode(input_ids[:cut], skip_special_tokens=False)
    if not text.startswith(head):
        return False
    rest = backend.encode(text[len(head) :], add_special_tokens=False).ids
    return bool(rest[: len(input_ids) - cut] == input_ids[cut:])


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Index of the first difference between two unequal sequences (the shorter's length
    when one is a prefix of the other)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
