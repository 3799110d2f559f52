"""Continuing an answer another server began (docs/design/placement.md, "A slow server's last
answers move").

A prompt handed over from a slower server carries the answer so far (ChunkPrompt's
`resume_ids`). The worker sends the prompt and that answer as one input, with the
token budget that is left, and puts the two parts back together: the record sees one
answer to the prompt, as if one server had decoded it. Sampling from the same model given
the same prefix draws the continuation from the same distribution, as long as nothing in
the sampling depends on the tokens already decoded (`why_not_movable`).

An abort can land on the step that decodes an answer's end (docs/design/sglang.md, "Where an
answer ends"): such an answer had ended, and is settled here as a completion
(`settled`), never continued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Mapping
from typing import Any

from regen.common.answer_ends import where_it_ends
from regen.consumers.generate.engine import GenerateResult

# Sampling parameters that draw each token from the model's distribution given the
# prefix alone, the same on any server: a continuation from prompt + answer so far draws
# what the first server would have.
CONTINUABLE = frozenset(
    {
        "max_new_tokens",  # the continuation gets what is left (continued_sampling)
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop_token_ids",  # checked on each new token; the answer so far holds none
        "ignore_eos",
        "skip_special_tokens",  # text only: the stages decode the joined ids
        "no_stop_trim",
        "sampling_seed",  # a different draw, from the same distribution
    }
)
# Parameters whose state SGLang keeps per request over the tokens it decoded itself
# (penaltylib: frequency and presence counts, repetition, the min_new_tokens count): a
# continuation would start them from nothing. Harmless only at their neutral value.
NEUTRAL_ONLY = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}


def why_not_movable(sampling: Mapping[str, Any]) -> str | None:
    """Why an answer drawn with `sampling` (the job's, as the server applies it: the
    model's generation_config filling what the job leaves unset) cannot move to another
    server, or None when it can. Anything not known to be safe stays (`CONTINUABLE`): a
    parameter SGLang adds later is kept off until someone reads what it does."""
    for name, value in sorted(sampling.items()):
        if name in NEUTRAL_ONLY:
            if value is not None and value != NEUTRAL_ONLY[name]:
                return f"{name}={value} counts the tokens decoded, which a continuation loses"
        elif name == "stop":
            if value:  # a stop string could straddle the cut, and no server would see it
                return "stop strings could straddle the cut"
        elif name not in CONTINUABLE:
            return f"{name} is not known to draw the same on a continuation"
    return None


def continued_sampling(sampling: dict[str, Any], resumed: int) -> dict[str, Any]:
    """The job's sampling for the rest of an answer `resumed` tokens long: the budget
    shrinks by what was decoded already. An answer so far is always short of its budget
    (`settled` ends one that reached it), so the rest asks for at least one token."""
    params = dict(sampling)
    if not resumed:
        return params
    left = int(params["max_new_tokens"]) - resumed
    if left < 1:
        raise ValueError(f"an answer of {resumed} tokens has spent its budget: it had ended")
    params["max_new_tokens"] = left
    return params


def joined(result: GenerateResult, resume_ids: list[int]) -> GenerateResult:
    """`result` of a continuation, as the answer to the prompt alone: the resumed ids
    before its own, the server's counts moved across the boundary (so the record's
    count checks still hold the server to what it was sent)."""
    resumed = len(resume_ids)
    prompt_tokens = result.prompt_tokens - resumed
    cached = result.cached_tokens
    return dataclasses.replace(
        result,
        output_ids=[*resume_ids, *result.output_ids],
        # Two decodes side by side may differ from the decode of the whole (a character
        # cut between the parts): the stages decode the ids where they need text.
        text=None,
        prompt_tokens=prompt_tokens,
        completion_tokens=result.completion_tokens + resumed,
        # Never more than the prompt itself: the answer so far was sent as prompt too.
        cached_tokens=None if cached is None else max(0, min(cached, prompt_tokens)),
        resumed_tokens=result.resumed_tokens + resumed,
    )


def ended(result: GenerateResult, ends: frozenset[int], budget: int) -> GenerateResult:
    """A handed-over answer that had ended (an end token, or its budget reached, on the
    step the abort landed on) as the completion SGLang's next check would have made it:
    cut after its first end, with finish "stop" or "length"; tokens past the end
    (speculative decoding's) dropped. Any other result as it is."""
    if not result.handed_over:
        return result
    end = where_it_ends(result.output_ids, ends, budget)
    if end is None:
        return result
    length, finish = end
    return dataclasses.replace(
        result,
        output_ids=result.output_ids[:length],
        text=None,  # the server's text ran past the end: the stages decode the ids
        finish_reason=finish,
        completion_tokens=length,
        handed_over=False,
    )


async def settled(
    answer: Awaitable[GenerateResult],
    resume_ids: list[int],
    ends: frozenset[int],
    budget: int,
) -> GenerateResult:
    """Await an answer, join it to the answer so far (if any), and settle one whose
    abort landed on its end."""
    result = await answer
    if resume_ids:
        result = joined(result, resume_ids)
    return ended(result, ends, budget)
