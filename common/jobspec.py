"""The job spec: what a job regenerates with, stored once in Redis and read by every worker.

A worker needs only a Redis URL and its engine to join a job; everything that decides
what the target model sees (model, tokenizer, sampling, chat-template kwargs) lives here,
and enqueueing more data into a job with a different spec is refused.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import orjson
import redis

from regen.common import defaults, keys
from regen.common.connection import bytes_set
from regen.common.ledger import id_buckets

# 2: the job's ids and committed index are bucketed hashes (common/ledger/id_buckets.py). A
# version 1 job kept them in one set and one hash, which this regen does not read.
SPEC_VERSION = 2

# Which assistant turns a job regenerates (`regen enqueue --turns`): the last one, on the
# dataset's history (a spec stored before the option existed means this), or every one
# in order, each on the target's own earlier answers (common/conversation.py).
TURNS_LAST = "last"
TURNS_ALL = "all"
TURN_MODES = (TURNS_LAST, TURNS_ALL)

# Which rule made a job's prompts from its rows. "as_written": each message's text is
# rendered as the dataset has it, and only the dedupe key (the prompt id) is normalized.
# "stripped": the normalized text itself (NFC, \r\n to \n, leading and trailing
# whitespace stripped) was rendered, as in every job whose spec predates the field. The
# ids are the same under both, so an old job extended by a newer regen keeps its rule.
PROMPT_TEXT_AS_WRITTEN = "as_written"
PROMPT_TEXT_STRIPPED = "stripped"
PROMPT_TEXT_RULES = frozenset({PROMPT_TEXT_AS_WRITTEN, PROMPT_TEXT_STRIPPED})

# SGLang sampling_params regen lets a job set (docs/design/sglang.md, SGLang contract).
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "skip_special_tokens",
        "no_stop_trim",
        "ignore_eos",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "sampling_seed",
    }
)


class JobSpecError(ValueError):
    """A spec that cannot be used, with the reason."""


class JobSpecMismatch(JobSpecError):
    """Enqueueing into an existing job with different settings."""


@dataclass(frozen=True)
class JobSpec:
    name: str
    model: str
    # Where the tokenizer comes from (defaults to the model) and whether it runs remote code.
    tokenizer: str
    trust_remote_code: bool
    # Detected chat family ("kimi", "qwen3", "chatml", "generic") and a fingerprint of the
    # tokenizer, so workers can refuse a tokenizer that would tokenize differently.
    chat_family: str
    tokenizer_fingerprint: str
    # SGLang sampling_params sent with every request; always holds max_new_tokens.
    sampling: dict[str, Any]
    chat_template_kwargs: dict[str, Any]
    system_prompt: str | None
    chunk_size: int
    max_prompt_tokens: int | None
    context_length: int | None
    queue: str
    turns: str = TURNS_LAST
    # Answers generated per prompt, each with its own seed (common/samples.py).
    samples: int = 1
    version: int = SPEC_VERSION
    # Not compared: a job keeps the rule it was made with (see PROMPT_TEXT_RULES).
    prompt_text: str = field(default=PROMPT_TEXT_STRIPPED, compare=False)
    # Hashes each of the job's id indexes is spread over (common/ledger/id_buckets.py), sized
    # from its first enqueue's --expected-prompts. Not compared: a job keeps its own.
    id_buckets: int = field(
        default=id_buckets.bucket_count(defaults.EXPECTED_PROMPTS), compare=False
    )
    created: float = field(default_factory=time.time, compare=False)
    # The tokens the target's server ends an answer on, besides a request's own
    # stop_token_ids (common/answer_ends.py): how a worker knows an answer aborted on its
    # last step had ended. Not compared: a fact about the model, read when the job was
    # made; empty in a spec from an older regen (save() fills it in).
    end_token_ids: list[int] = field(default_factory=list, compare=False)

    def __post_init__(self) -> None:
        keys.check_job_name(self.name)
        unknown = set(self.sampling) - SAMPLING_KEYS
        if unknown:
            raise JobSpecError(
                f"unknown sampling parameter(s) {sorted(unknown)}; "
                f"known: {', '.join(sorted(SAMPLING_KEYS))}"
            )
        max_new = self.sampling.get("max_new_tokens")
        if not isinstance(max_new, int) or max_new < 1:
            raise JobSpecError("sampling.max_new_tokens must be a positive integer")
        if self.turns not in TURN_MODES:
            raise JobSpecError(f"turns must be one of {', '.join(TURN_MODES)}, not {self.turns!r}")
        if self.prompt_text not in PROMPT_TEXT_RULES:
            raise JobSpecError(f"unknown prompt_text rule {self.prompt_text!r}: newer regen?")
        if self.id_buckets < 1:
            raise JobSpecError("id_buckets must be at least 1")
        if self.samples < 1:
            raise JobSpecError("samples must be at least 1")
        if self.chunk_size < 1:
            raise JobSpecError("chunk_size must be at least 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise JobSpecError("max_prompt_tokens must be positive")
        if self.context_length is not None and max_new >= self.context_length:
            raise JobSpecError(
                f"max_new_tokens {max_new} leaves no room for a prompt in the model's "
                f"context of {self.context_length} tokens"
            )

    def prompt_token_limit(self) -> int | None:
        """The longest prompt the job accepts: the explicit limit and the context room."""
        limits = []
        if self.max_prompt_tokens is not None:
            limits.append(self.max_prompt_tokens)
        if self.context_length is not None:
            limits.append(self.context_length - self.sampling["max_new_tokens"])
        return min(limits) if limits else None

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes | str) -> JobSpec:
        data = orjson.loads(raw)
        if data.get("version", 1) < SPEC_VERSION:
            raise JobSpecError(
                f"job {data.get('name')!r} was enqueued by an older regen (job spec version "
                f"{data.get('version', 1)}), which kept its ids in Redis in a layout this regen "
                "does not read; finish it with that regen, or enqueue its data again under a "
                "new --job name"
            )
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise JobSpecError(f"job spec has unknown fields {sorted(unknown)}: newer regen?")
        return cls(**data)

    def differences(self, other: JobSpec) -> list[str]:
        """Human-readable list of the settings that differ (creation time ignored)."""
        out = []
        for f in fields(self):
            if not f.compare:
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append(f"{f.name}: stored {theirs!r}, given {mine!r}")
        return out


def save(r: redis.Redis, spec: JobSpec) -> JobSpec:
    """Store a new job's spec, or check it against the stored one. Returns the stored spec,
    which is the one to enqueue with: it keeps the job's own prompt-text rule."""
    key = keys.job_spec(spec.name)
    if r.set(key, spec.to_json(), nx=True):
        r.sadd(keys.JOBS, spec.name)
        # A wake-up only: a worker that misses it finds the job at its next poll.
        r.publish(keys.NEW_JOBS_CHANNEL, spec.name)
        return spec
    stored = load(r, spec.name)
    diff = spec.differences(stored)
    if diff:
        raise JobSpecMismatch(
            f"job {spec.name!r} already exists with different settings:\n  "
            + "\n  ".join(diff)
            + "\nUse the same settings to extend it, or a new --job name."
        )
    if spec.end_token_ids and not stored.end_token_ids:
        # A job an older regen made: learn its end tokens now, so that workers started
        # from here on can move its running answers (none could before).
        stored = replace(stored, end_token_ids=spec.end_token_ids)
        r.set(key, stored.to_json())
    return stored


def load(r: redis.Redis, job: str) -> JobSpec:
    raw = r.get(keys.job_spec(job))
    if raw is None:
        raise JobSpecError(f"no job named {job!r} in this Redis")
    return JobSpec.from_json(raw)


def list_jobs(r: redis.Redis) -> list[str]:
    return sorted(m.decode() for m in bytes_set(r.smembers(keys.JOBS)))
