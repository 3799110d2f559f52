"""Continuing an answer another server began (docs/design.md, "A slow server's last
answers move").

A prompt handed over from a slower server carries the answer so far (ChunkPrompt's
`resume_ids`). The worker sends the prompt and that answer as one input, with the
token budget that is left, and puts the two parts back together: the record sees one
answer to the prompt, as if one server had decoded it. Sampling from the same model given
the same prefix draws the continuation from the same distribution; SGLang itself
prefills prompt and output anew for every request it retracts under memory pressure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable
from typing import Any

from regen.consumers.generate.engine import GenerateResult


def continued_sampling(sampling: dict[str, Any], resumed: int) -> dict[str, Any]:
    """The job's sampling for the rest of an answer `resumed` tokens long: the token
    budgets shrink by what was decoded already (never below one token: the server
    handed the answer over before it ended)."""
    params = dict(sampling)
    if not resumed:
        return params
    params["max_new_tokens"] = max(1, int(params["max_new_tokens"]) - resumed)
    if params.get("min_new_tokens"):
        params["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - resumed)
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


async def resumed(answer: Awaitable[GenerateResult], resume_ids: list[int]) -> GenerateResult:
    """Await a continuation and join it to the answer so far."""
    return joined(await answer, resume_ids)
