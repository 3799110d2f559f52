"""Sampling and stopping for the local engine, inside transformers' generate().

SGLang's parameter names and defaults, batch keys (what a batch must share), seeded
per-row sampling, and per-row stopping.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

SGLANG_MAX_NEW_TOKENS = 128
# SGLang's values for what neither the request nor the model's generation_config sets.
SAMPLING_DEFAULTS: dict[str, float] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
}  # fmt: skip
HONOURED = {"max_new_tokens", "stop_token_ids", "ignore_eos", "seed", "sampling_seed",
             "skip_special_tokens", "no_stop_trim", *SAMPLING_DEFAULTS}  # fmt: skip
# SGLang parameters accepted only at their neutral value: anything else would be ignored.
NEUTRAL: dict[str, Any] = {
    "stop": None, "stop_regex": None, "frequency_penalty": 0, "presence_penalty": 0,
    "min_new_tokens": 0, "n": 1, "regex": None, "json_schema": None, "ebnf": None,
    "logit_bias": None, "spaces_between_special_tokens": True,
}  # fmt: skip


@dataclass(frozen=True)
class BatchKey:
    """What a batch shares: every sampling setting but max_new_tokens and the seed."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    stop_ids: tuple[int, ...]


def logits_processors(key: BatchKey, seeds: list[int], device: torch.device) -> LogitsProcessorList:
    # Passed in explicitly: with do_sample=False (the draw is RowSampler's, generate()
    # only takes the argmax) generate() would add no warpers of its own.
    procs = LogitsProcessorList()
    if key.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(key.repetition_penalty))
    if key.temperature == 0.0:
        return procs
    procs.append(TemperatureLogitsWarper(key.temperature))
    if key.top_k > 0:
        procs.append(TopKLogitsWarper(key.top_k))
    if key.top_p < 1.0:
        procs.append(TopPLogitsWarper(key.top_p))
    if key.min_p > 0.0:
        procs.append(MinPLogitsWarper(key.min_p))
    procs.append(RowSampler(seeds, device))
    return procs


class RowSampler(LogitsProcessor):
    """Samples every row with its own seeded generator; generate() then takes the argmax.

    argmax(logits - log E) with E ~ Exp(1) is an exact draw from softmax(logits) (the
    exponential race SGLang and vLLM sample with); tokens filtered to -inf stay out.
    """

    def __init__(self, seeds: list[int], device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        noise = torch.stack(
            [scores.new_empty(vocab).exponential_(generator=g) for g in self.generators]
        )
        return scores - noise.log()


class RowStop(StoppingCriteria):
    """Ends each row at a stop token or at its own max_new_tokens; every row on close."""

    def __init__(
        self, stop_ids: torch.Tensor, limits: torch.Tensor, width: int, abort: threading.Event
    ) -> None:
        self.stop_ids, self.limits, self.width, self.abort = stop_ids, limits, width, abort

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if self.abort.is_set():
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done = (input_ids.shape[1] - self.width) >= self.limits
        return done | torch.isin(input_ids[:, -1], self.stop_ids)
