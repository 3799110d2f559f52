"""Where an answer ends, as SGLang decides it (docs/design/sglang.md, "Where an answer ends").

SGLang ends a request on the step that decodes any of these tokens, unless the request
sets `ignore_eos` (then on none of them): the request's `stop_token_ids`, the model's
`eos_token_id` from config.json and generation_config.json, the tokenizer's eos, and
`<|eom_id|>` where the tokenizer has it (`schedule_batch.Req.check_finished`,
`ModelConfig._get_hf_eos_token_id`, `attach_additional_stop_token_ids`, 0.5.6). Its
length check comes first: the step that reaches `max_new_tokens` ends it as "length"
whatever token it decoded.

An abort lands after a step appends its tokens and before those checks, so an answer
aborted on its last step comes back as "abort" carrying its end (with speculative
decoding, maybe tokens past it). regen therefore settles such a reply here exactly as
the next check would have, and the tokenize stage refuses a record whose answer holds an
end before its last token or runs over its budget, whatever made it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# SGLang stops on Llama 3's tool-use end as well (hf_transformers_utils.py).
EXTRA_STOP_TOKENS = ("<|eom_id|>",)


def server_end_ids(
    tokenizer: Any, end_of_turn_ids: Iterable[int], folder: Path | None
) -> list[int]:
    """The ids a server running this model ends an answer on (without the request's own
    `stop_token_ids`): the tokenizer's eos and its extra stop tokens, the model's eos
    ids from its config files (where `folder` has them), and the chat template's end of
    turn (`end_of_turn_ids`), sorted."""
    ids = set(end_of_turn_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    added: dict[str, int] = getattr(tokenizer, "get_added_vocab", dict)()
    ids.update(added[token] for token in EXTRA_STOP_TOKENS if token in added)
    for name in ("config.json", "generation_config.json"):
        path = folder / name if folder is not None else None
        if path is not None and path.is_file():
            ids.update(_eos_ids(json.loads(path.read_text(encoding="utf-8"))))
    return sorted(ids)


def _eos_ids(config: Mapping[str, Any]) -> list[int]:
    value = config.get("eos_token_id")
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value] if isinstance(value, list) else []


def request_end_ids(model_end_ids: Iterable[int], sampling: Mapping[str, Any]) -> frozenset[int]:
    """The ids that end one request's answer: the model's and the request's
    `stop_token_ids`; none with `ignore_eos`, as in SGLang."""
    if sampling.get("ignore_eos"):
        return frozenset()
    return frozenset(model_end_ids) | frozenset(
        int(t) for t in sampling.get("stop_token_ids") or ()
    )


def where_it_ends(
    output_ids: list[int], ends: frozenset[int], budget: int
) -> tuple[int, dict[str, Any]] | None:
    """Where SGLang would have ended an answer that decoded `output_ids` (an abort's,
    maybe past its end): (its length, its finish_reason), or None when it had not ended.

    The first end token within the budget ends it ("stop", matched that token; "length"
    if it is also the budget's last token, SGLang's length check coming first); else the
    budget does ("length")."""
    for position, token in enumerate(output_ids[:budget]):
        if token in ends:
            length = position + 1
            if length >= budget:
                return length, {"type": "length", "length": budget}
            return length, {"type": "stop", "matched": token}
    if len(output_ids) >= budget:
        return budget, {"type": "length", "length": budget}
    return None


def misplaced_end(output_ids: list[int], ends: frozenset[int]) -> int | None:
    """The position of an end token before an answer's last token (the answer went on
    past its end), or None."""
    return next((i for i, token in enumerate(output_ids[:-1]) if token in ends), None)
