"""Build a job spec from the enqueue options and the target's real tokenizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import redis

from regen.common import answer_ends, chat_family, defaults, keys, provenance, tokenizer
from regen.common import jobspec as jobspecs
from regen.common.jobspec import PROMPT_TEXT_AS_WRITTEN, TURNS_LAST, JobSpec
from regen.common.ledger import id_buckets


@dataclass(frozen=True)
class JobOptions:
    job: str
    model: str
    tokenizer: str | None = None
    trust_remote_code: bool = False
    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # None: the chat template's own default (Kimi thinks by default, Qwen3 too).
    thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    chunk_size: int = defaults.CHUNK_SIZE
    max_prompt_tokens: int | None = None
    context_length: int | None = None
    queue: str | None = None
    turns: str = TURNS_LAST
    samples: int = 1
    # Prompts with more bytes of text are refused before they are tokenized (None: the
    # most that could fit the job's token limit, see PreparedJob.too_large).
    max_row_bytes: int | None = None
    # Sizes a new job's id indexes in Redis (JobSpec.id_buckets).
    expected_prompts: int = defaults.EXPECTED_PROMPTS


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string in a message list (contents, and whatever else a chat
    template renders): a lower bound of what the template turns into tokens."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, dict):
        return sum(text_bytes(item) for item in value.values())
    if isinstance(value, list):
        return sum(text_bytes(item) for item in value)
    return 0


@dataclass(frozen=True)
class PreparedJob:
    spec: JobSpec
    tokenizer: Any
    family: chat_family.ChatFamily
    max_row_bytes: int | None = None
    # What made the job (common/provenance.py), stored when the job is created.
    provenance: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def _bytes_per_token(self) -> int:
        return tokenizer.max_token_bytes(self.tokenizer)

    def too_large(self, messages: list[dict[str, Any]]) -> str | None:
        """Why a prompt is refused by its size alone, cheaply, before it is tokenized (a
        50 MB row takes minutes to tokenize); None when it may fit. The bound is
        --max-row-bytes, else the token limit times the most bytes one token of this
        tokenizer stands for, so no prompt that fits is refused."""
        size = text_bytes(messages)
        limit = self.spec.prompt_token_limit()
        if self.max_row_bytes is not None:
            bound, why = self.max_row_bytes, "--max-row-bytes"
        elif limit is None or size <= limit:  # a token is one byte or more: it may fit
            return None
        else:
            per_token = self._bytes_per_token
            bound = limit * per_token
            why = f"{limit} tokens x {per_token} bytes, the most one token stands for"
        if size <= bound:
            return None
        return f"prompt text is {size:,} bytes, over the {bound:,} that can fit ({why})"


def sampling_params(options: JobOptions) -> dict[str, Any]:
    """SGLang sampling_params: max_new_tokens always; the rest only when set, so unset
    values come from the model's generation_config as on the server."""
    params: dict[str, Any] = {"max_new_tokens": options.max_new_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p"):
        value = getattr(options, name)
        if value is not None:
            params[name] = value
    return params


def prepare_job(options: JobOptions) -> PreparedJob:
    keys.check_job_name(options.job)
    tok_source = options.tokenizer or options.model
    tok = tokenizer.load_tokenizer(
        options.model, tokenizer=options.tokenizer, trust_remote_code=options.trust_remote_code
    )
    family = chat_family.detect_family(tok)
    template_kwargs = chat_family.template_kwargs(
        family, options.thinking, options.chat_template_kwargs
    )
    try:
        model_ref: tokenizer.ModelRef | None = tokenizer.resolve_model(options.model)
    except tokenizer.ModelNotFound:  # a tokenizer-only source: no metadata to read
        model_ref = None
    context = options.context_length
    if context is None:
        context = tokenizer.model_context_length(tokenizer.resolve_model(options.model))
    spec = JobSpec(
        name=options.job,
        model=options.model,
        tokenizer=tok_source,
        trust_remote_code=options.trust_remote_code,
        chat_family=family.name,
        tokenizer_fingerprint=tokenizer.tokenizer_fingerprint(tok),
        sampling=sampling_params(options),
        chat_template_kwargs=template_kwargs,
        system_prompt=options.system_prompt,
        chunk_size=options.chunk_size,
        max_prompt_tokens=options.max_prompt_tokens,
        context_length=context,
        queue=options.queue or keys.generate_queue(options.job),
        turns=options.turns,
        samples=options.samples,
        prompt_text=PROMPT_TEXT_AS_WRITTEN,
        id_buckets=id_buckets.bucket_count(options.expected_prompts),
        end_token_ids=answer_ends.server_end_ids(
            tok, family.end_of_turn_ids, model_ref.folder if model_ref else None
        ),
    )
    made_by = provenance.job_provenance(spec, tok, model_ref.folder if model_ref else None)
    return PreparedJob(
        spec=spec,
        tokenizer=tok,
        family=family,
        max_row_bytes=options.max_row_bytes,
        provenance=made_by,
    )


def save_job(r: redis.Redis, prepared: PreparedJob) -> PreparedJob:
    """Store a new job's spec and provenance, or check the spec against the stored one
    (jobspec.save); returns the job with the stored spec, which an existing job keeps."""
    stored = jobspecs.save(r, prepared.spec)
    provenance.save(r, prepared.provenance)
    return dataclasses.replace(prepared, spec=stored)
