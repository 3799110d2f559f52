"""One request to the local engine, checked as SGLang checks it and turned into a plan.

The checks and their messages follow SGLang's SamplingParams.verify and its tokenizer
manager's length checks, so a prompt the local engine rejects is one SGLang would too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from regen.consumers.generate.engine import GenerateRequest, PromptRejected
from regen.consumers.generate.engines.local_model import LoadedModel
from regen.consumers.generate.engines.local_sampling import (
    HONOURED,
    NEUTRAL,
    SAMPLING_DEFAULTS,
    SGLANG_MAX_NEW_TOKENS,
    BatchKey,
)


@dataclass(frozen=True)
class RowPlan:
    """How one prompt is generated: its batch key (what its batch must share), its own
    length limit and seed, and how its text is decoded."""

    key: BatchKey
    max_new: int
    seed: int | None
    skip_special: bool
    trim_stop: bool


def plan_row(request: GenerateRequest, model: LoadedModel) -> RowPlan:
    """The plan for `request` on `model`, or PromptRejected with SGLang's message."""
    s, prompt = request.sampling, request.prompt_ids
    unknown = sorted(set(s) - HONOURED - set(NEUTRAL))
    empty: tuple[Any, ...] = (None, "", [], {})
    unsupported = sorted(k for k, v in NEUTRAL.items() if s.get(k) not in (v, *empty))
    if unknown or unsupported:
        what = f"unknown {unknown}" if unknown else f"unsupported {unsupported}"
        raise PromptRejected(f"sampling parameters: {what} (local engine)")

    def get(name: str) -> Any:
        value = s.get(name)
        return model.defaults.get(name, SAMPLING_DEFAULTS[name]) if value is None else value

    try:
        requested = s.get("max_new_tokens")
        max_new = SGLANG_MAX_NEW_TOKENS if requested is None else int(requested)
        temperature, top_p, min_p = (float(get(k)) for k in ("temperature", "top_p", "min_p"))
        top_k, penalty = int(get("top_k")), float(get("repetition_penalty"))
        stops = {int(t) for t in s.get("stop_token_ids") or ()}
        seeds = [int(s[k]) for k in ("seed", "sampling_seed") if s.get(k) is not None]
    except (TypeError, ValueError) as exc:
        raise PromptRejected(f"invalid sampling parameters: {exc}") from exc
    problems = [msg for bad, msg in (
        (max_new < 0, f"max_new_tokens must be at least 0, got {max_new}."),
        (not temperature >= 0, f"temperature must be non-negative, got {temperature}."),
        (not 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}."),
        (not 0 <= min_p <= 1, f"min_p must be in [0, 1], got {min_p}."),
        (top_k < 1 and top_k != -1, f"top_k must be -1 (disable) or at least 1, got {top_k}."),
        (not 0 < penalty <= 2, f"repetition_penalty must be in (0, 2], got {penalty}."),
        (not prompt, "the prompt is empty."),
        (bool(prompt) and not 0 <= min(prompt) <= max(prompt) < model.vocab_size,
         f"prompt token ids must be in [0, {model.vocab_size})."),
    ) if bad]  # fmt: skip
    if problems:
        raise PromptRejected(" ".join(problems))
    ctx, n = model.context_len, len(prompt)
    if ctx is not None and n >= ctx:
        raise PromptRejected(
            f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
        )
    if ctx is not None and n + max_new > ctx:
        raise PromptRejected(
            f"Requested token count exceeds the model's maximum context length of {ctx} "
            f"tokens. You requested a total of {n + max_new} tokens: {n} tokens from "
            f"the input messages and {max_new} tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit "
            "within the limit."
        )
    stop_ids = () if s.get("ignore_eos") else tuple(sorted(model.eos_ids | stops))
    seed = None
    if temperature < 1e-6:  # greedy (SGLang: top_k=1), so the other knobs are moot
        key = BatchKey(0.0, 1.0, -1, 0.0, penalty, stop_ids)
    else:
        key = BatchKey(temperature, top_p, top_k, min_p, penalty, stop_ids)
        seed = seeds[0] if seeds else random.getrandbits(63)
    return RowPlan(
        key=key,
        max_new=max_new,
        seed=seed,
        skip_special=s.get("skip_special_tokens") is not False,
        trim_stop=not s.get("no_stop_trim"),
    )
