"""Build a job spec from the enqueue options and the target's real tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from regen.common import chat_family, defaults, keys, tokenizer
from regen.common.jobspec import PROMPT_TEXT_AS_WRITTEN, TURNS_LAST, JobSpec


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


@dataclass(frozen=True)
class PreparedJob:
    spec: JobSpec
    tokenizer: Any
    family: chat_family.ChatFamily


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
        prompt_text=PROMPT_TEXT_AS_WRITTEN,
    )
    return PreparedJob(spec=spec, tokenizer=tok, family=family)
