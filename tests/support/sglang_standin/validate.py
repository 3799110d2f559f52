"""Parse and check a /generate body the way SGLang does, down to its batch rule.

A batch (`input_ids` as a list of lists) is checked as a whole: one bad item fails the
entire call with HTTP 400, which is why regen never batches.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

# SGLang 0.5's SamplingParams API fields; the stand-in honours the ones that shape the
# token sequence (max_new_tokens, min_new_tokens, stop_token_ids, ignore_eos,
# skip_special_tokens, no_stop_trim) and accepts the others.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "beam_width", "json_schema", "regex", "ebnf",
        "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
        "sampling_seed", "custom_params", "watermark",
    }
)  # fmt: skip


class RequestError(ValueError):
    """An invalid request: the server answers HTTP 400 with this message."""


@dataclass(frozen=True)
class Item:
    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]


def request_object(body: bytes) -> dict[str, Any]:
    """A request body as its JSON object, or RequestError (not JSON, not an object, or
    asking for streaming, which the stand-in does not do)."""
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(req, dict):
        raise RequestError("The request body must be a JSON object.")
    if req.get("stream"):
        raise RequestError("The stand-in does not stream: send stream=false.")
    return req


def parse_generate(body: bytes, vocab_size: int) -> tuple[bool, list[Item]]:
    """(is_batch, items) or RequestError."""
    req = request_object(body)
    ids = req.get("input_ids")
    if ids is None:
        raise RequestError("Either text or input_ids should be provided (stand-in: input_ids).")
    if not isinstance(ids, list) or not ids:
        raise RequestError("input_ids must be a non-empty list.")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    n = len(prompts)
    samplings = _per_item(req.get("sampling_params"), n, batch, "sampling_params")
    rids = _per_item(req.get("rid"), n, batch, "rid")
    return batch, [
        check_item(prompt, sampling, rid, vocab_size)
        for prompt, sampling, rid in zip(prompts, samplings, rids, strict=True)
    ]


def check_item(input_ids: Any, sampling: Any, rid: Any, vocab_size: int) -> Item:
    """One prompt's request, checked; a missing rid gets a fresh one, as in SGLang."""
    return Item(
        rid=str(rid) if rid is not None else uuid.uuid4().hex,
        input_ids=_check_ids(input_ids, vocab_size),
        sampling=_check_sampling(sampling or {}),
    )


def _per_item(value: Any, n: int, batch: bool, name: str) -> list[Any]:
    """A batch takes one shared value (or none) or a list with one value per prompt."""
    if not batch:
        return [value]
    if value is None or isinstance(value, dict):
        return [value] * n
    if not isinstance(value, list) or len(value) != n:
        raise RequestError(f"{name} must be a list of {n} items for a batch of {n}.")
    return value


def _check_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError("Each input_ids item must be a non-empty list of token ids.")
    for token in ids:
        if not isinstance(token, int) or isinstance(token, bool):
            raise RequestError(f"Token ids must be integers, got {token!r}.")
        if not 0 <= token < vocab_size:
            raise RequestError(f"Token id {token} is out of range (vocab size {vocab_size}).")
    return ids


def _check_sampling(sampling: Any) -> dict[str, Any]:
    if not isinstance(sampling, dict):
        raise RequestError("sampling_params must be an object.")
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise RequestError(f"Unexpected sampling parameters: {unknown}.")
    max_new = sampling.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or max_new < 0):
        raise RequestError(f"max_new_tokens must be a non-negative integer, got {max_new!r}.")
    if sampling.get("n") not in (None, 1):
        raise RequestError("The stand-in supports n=1 only.")
    stop_ids = sampling.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise RequestError("stop_token_ids must be a list of integers.")
    return sampling
