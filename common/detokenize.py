"""The text SGLang's detokenizer makes of a reply's output ids.

Shared by the tokenize stage, which checks a server's `text` against it, and both
stages where a server sent no text at all (SGLang started with `--skip-tokenizer-init`
replies with `output_ids` only): there the text a turn's answer, reasoning and tool calls
are read from is this decode (docs/design/sglang.md, "SGLang contract"). Never the other way:
records are built from the ids, and text is never re-tokenized.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def detokenize(
    tokenizer: Any,
    output_ids: Sequence[int],
    finish_reason: Mapping[str, Any],
    sampling: Mapping[str, Any],
) -> str:
    """`output_ids` decoded as SGLang's `DetokenizerManager` does: it drops a matched
    stop token from the ids and cuts the text at the first occurrence of a matched stop
    string, both unless `no_stop_trim` and both only when `matched` is truthy (its test);
    it decodes with the request's `skip_special_tokens` (default true)."""
    matched = finish_reason.get("matched") if finish_reason.get("type") == "stop" else None
    trim = bool(matched) and not sampling.get("no_stop_trim", False)
    ids = list(output_ids[:-1] if trim and is_token(matched) else output_ids)
    decoded: str = tokenizer.decode(
        ids, skip_special_tokens=sampling.get("skip_special_tokens", True)
    )
    if trim and isinstance(matched, str):
        cut = decoded.find(matched)
        decoded = decoded if cut == -1 else decoded[:cut]
    return decoded


def is_token(matched: Any) -> bool:
    """Whether a finish reason's `matched` is a token id (not a stop string)."""
    return isinstance(matched, int) and not isinstance(matched, bool)
