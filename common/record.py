"""One generated result to one training record, checked on the way.

A record (one JSON line in a shard, schema `regen.record/3`):

- `schema`: "regen.record/3"; bumped whenever a field changes meaning, goes away or is
  added. Older records stay valid: version 2 has no `flags` or `server_version`,
  version 1 no `conversation_id` and `turn` either.
- `id`: the prompt id (stable, derived from the prompt's content); unique within a job.
  With `--turns all`, the turn's id, `<conversation_id>-<turn>`.
- `conversation_id`, `turn`: with `--turns all`, the conversation and which of its
  assistant turns (0 first) this record regenerated, on the target's own answers to the
  turns before it (in `messages`); null for jobs that regenerate the last turn only.
- `job`: the job name.
- `model`: the target model that generated the answer (the job spec's `model`).
- `messages`: the prompt messages as rendered (system prompt included), then the
  regenerated turn `{"role": "assistant", "content": answer, "reasoning_content": r,
  "tool_calls": calls}`; `reasoning_content` is present only when the output had a think
  span, `tool_calls` only when the prompt had tools and the output ends in well-formed
  calls (OpenAI's shape, `arguments` as the model wrote them; a call written without an
  id, as Hermes-style models write them, has `call_<record id>_<index>`: see
  common/output_calls.py). Where the chat template
  renders tool calls, `content` is the text before them; where it does not (SmolLM2's),
  `content` keeps their text too, so the turn re-renders as generated. Text is the
  server's (special tokens skipped unless the job's sampling says otherwise); from a
  server that sends none (`--skip-tokenizer-init`), the same decode of the output ids.
- `tools`: the OpenAI tools the prompt was rendered with; present only when it had some.
- `input_ids`: the prompt ids exactly as sent, then the output ids exactly as generated
  (the matched stop token included). Never re-tokenized.
- `loss_mask`: one entry per input id: 0 for each prompt token, 1 for each generated
  token (the end-of-turn token included).
- `prompt_tokens`, `completion_tokens`: how many of `input_ids` are prompt and output.
- `finish_reason`: "stop" (a stop token or string ended the turn) or "length"
  (max_new_tokens or the context ran out; kept with `on_truncated=keep`, the default).
- `flags`: how the answer went, for a trainer to filter on (common/quality.py):
  `empty`, `thinking_only`, `truncated`, `repetition`, `bad_tool_call`; [] when clean.
- `sampling`: the SGLang sampling params sent: the job spec's, with a requeued chunk's
  overrides (`regen dlq requeue --set`) merged over them.
- `chat_template_kwargs`: the template kwargs the prompt was rendered with.
- `source`: where the prompt came from (file and row).
- `drift`: whether re-rendering `messages` with the chat template gives ids other than
  `input_ids` (compared over `input_ids`' length); null when the check was off.
- `drift_at`: the first index where they differ, or null.
- `server`: the inference server that generated it; `server_version`: its SGLang
  version where it reported one (null otherwise); `generated_by`: the worker.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from regen.common import defaults
from regen.common.answer_ends import misplaced_end, request_end_ids
from regen.common.chat_family import (
    ChatFamily,
    ChatTemplateError,
    ThinkState,
    assistant_message,
    prompt_opens_think,
    render_prompt_ids,
    split_reasoning,
    think_state,
)
from regen.common.detokenize import detokenize, is_token
from regen.common.dlq import ReasonCode, Refused
from regen.common.drift import cut_ids, drift_at, first_difference
from regen.common.jobspec import JobSpec
from regen.common.output_calls import turn_calls
from regen.common.quality import quality_flags
from regen.common.results import GeneratedResult

RECORD_SCHEMA = "regen.record/3"
# Field -> accepted JSON types, for readers that validate (shards verify).
_V1_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,), "id": (str,), "job": (str,), "model": (str,), "messages": (list,),
    "input_ids": (list,), "loss_mask": (list,), "prompt_tokens": (int,),
    "completion_tokens": (int,), "finish_reason": (str,), "sampling": (dict,),
    "chat_template_kwargs": (dict,), "source": (dict,), "drift": (bool, type(None)),
    "drift_at": (int, type(None)), "server": (str,), "generated_by": (str,),
}  # fmt: skip
_V2_FIELDS = {**_V1_FIELDS, "conversation_id": (str, type(None)), "turn": (int, type(None))}
RECORD_FIELDS = {**_V2_FIELDS, "flags": (list,), "server_version": (str, type(None))}
# Every schema a valid record may have, with its fields: older shards stay readable.
RECORD_SCHEMAS = {
    "regen.record/1": _V1_FIELDS,
    "regen.record/2": _V2_FIELDS,
    RECORD_SCHEMA: RECORD_FIELDS,
}
# Fields a record has only in some cases, with their types.
OPTIONAL_RECORD_FIELDS: dict[str, tuple[type, ...]] = {"tools": (list,), "tool_results": (str,)}
FINISH_REASONS = frozenset({"stop", "length"})
ON_TRUNCATED = ("keep", "drop", "dlq")
# SGLang's detokenizer decodes an unfinished UTF-8 sequence as U+FFFD.
_REPLACEMENT = "\ufffd"


class Reason(ReasonCode):
    """Why a result gives no record: the tokenize stage's DLQ reasons, all in one place."""

    ABORTED = "aborted"
    UNKNOWN_FINISH_REASON = "unknown_finish_reason"
    COUNT_MISMATCH = "count_mismatch"
    STOP_MISMATCH = "stop_mismatch"  # finish says a stop token matched, output ends otherwise
    # An end-of-turn token before the answer's last token, or more answer tokens than
    # max_new_tokens: no server decodes that, so the answer is not one server's
    # (common/answer_ends.py; docs/design/sglang.md, "Where an answer ends").
    END_INSIDE_ANSWER = "end_inside_answer"
    OVER_BUDGET = "over_budget"
    TEXT_MISMATCH = "text_mismatch"
    TRUNCATED = "truncated"
    TRUNCATED_DROPPED = "truncated_dropped"  # not dead-lettered: the stage notes the id only
    UNEXPECTED_THINKING = "unexpected_thinking"
    MISSING_THINKING = "missing_thinking"
    # The output ids close the think span but the text does not (the tags are special
    # tokens the server's decode skipped): the split cannot be trusted.
    UNCLOSED_THINKING = "unclosed_thinking"
    RENDER_FAILED = "render_failed"  # the template cannot re-render its own output
    # Stream entries that give no result (entries.py): the entry's bytes are kept.
    ENTRY_WITHOUT_RESULT = "entry_without_result"
    RESULT_NOT_JSON = "result_not_json"
    RESULT_NOT_AN_OBJECT = "result_not_an_object"
    RESULT_MISSING_FIELDS = "result_missing_fields"
    RESULT_WRONG_TYPE = "result_wrong_type"
    # A result that passed the type checks yet made building its record raise.
    MALFORMED_RESULT = "malformed_result"


class CheckFailed(Refused):
    """A result that cannot be a record: `reason` is one of `Reason`'s codes."""


@dataclass(frozen=True)
class RecordContext:
    """What turning a job's results into records needs; build one per job and reuse it."""

    spec: JobSpec
    tokenizer: Any
    family: ChatFamily
    # A result cut by max_new_tokens: keep, drop or dlq it.
    on_truncated: str = defaults.ON_TRUNCATED
    drift_check: bool = defaults.DRIFT_CHECK

    def __post_init__(self) -> None:
        if self.on_truncated not in ON_TRUNCATED:
            raise ValueError(f"on_truncated must be one of {sorted(ON_TRUNCATED)}")

    @functools.cached_property
    def cut_ids(self) -> frozenset[int]:
        """Where the drift check may cut a rendering (drift.py)."""
        return cut_ids(self.tokenizer)

    @functools.cached_property
    def thinking(self) -> bool | None:
        """The job's thinking setting; None where the template has no switch (each prompt
        then says whether it opens a think span).

        Unset, it is the template's default, found by rendering a probe both ways: the
        default differs from an explicit `False` exactly when the template thinks by
        default (Kimi, Qwen3). Stronger than reading a prompt's last tokens, which for
        Qwen3 end the same with thinking on as without a think span at all.
        """
        key = self.family.thinking_kwarg
        if key is None or self.family.think_open is None:
            return None
        kwargs = self.spec.chat_template_kwargs
        if key in kwargs:
            return bool(kwargs[key])
        probe = [{"role": "user", "content": "Hi"}]
        try:
            default = render_prompt_ids(self.tokenizer, probe, kwargs)
            return default != render_prompt_ids(self.tokenizer, probe, {**kwargs, key: False})
        except ChatTemplateError:  # a template that rejects the probe: judge each prompt
            return None


def build_record(result: GeneratedResult, ctx: RecordContext) -> dict[str, Any]:
    """The record for a result (see the module docstring); raises CheckFailed."""
    finish = _check_finish(result)
    _check_one_answer(result, ctx)
    if finish == "length" and ctx.on_truncated != "keep":
        # Decided before decoding: the result will not be a record either way.
        reason = Reason.TRUNCATED_DROPPED if ctx.on_truncated == "drop" else Reason.TRUNCATED
        raise CheckFailed(reason, f"cut at {len(result.output_ids)} tokens (finish length)")
    text, calls = _tool_calls(result, ctx, _server_text(result, ctx, finish))
    reasoning, answer = _split(result, ctx, finish, text)
    matched = result.finish_reason.get("matched") if finish == "stop" else None
    body_ids = result.output_ids[:-1] if is_token(matched) else result.output_ids
    flags = quality_flags(
        ctx.family, finish=finish, body_ids=body_ids, reasoning=reasoning, answer=answer,
        calls=calls, tools=result.tools,
    )  # fmt: skip

    messages = [*result.messages, assistant_message(reasoning, answer, calls)]
    input_ids = result.prompt_ids + result.output_ids
    n_prompt, n_output = len(result.prompt_ids), len(result.output_ids)
    drift_at = _drift_at(ctx, messages, result, input_ids) if ctx.drift_check else None
    record = {
        "schema": RECORD_SCHEMA,
        "id": result.id,
        "job": result.job,
        "model": ctx.spec.model,
        "messages": messages,
        "input_ids": input_ids,
        "loss_mask": [0] * n_prompt + [1] * n_output,
        "prompt_tokens": n_prompt,
        "completion_tokens": n_output,
        "finish_reason": finish,
        "sampling": _sampling(result, ctx),
        "chat_template_kwargs": ctx.spec.chat_template_kwargs,
        "source": result.source,
        "drift": (drift_at is not None) if ctx.drift_check else None,
        "drift_at": drift_at,
        "server": result.server,
        "server_version": result.server_version,
        "generated_by": result.worker,
        "conversation_id": result.conversation_id,
        "turn": result.turn,
        "flags": flags,
    }
    if result.tools:
        record["tools"] = result.tools
    if any(message.get("role") == "tool" for message in result.messages):
        # A tool's output cannot be regenerated: the prompt holds the dataset's.
        record["tool_results"] = "dataset"
    return record


def _sampling(result: GeneratedResult, ctx: RecordContext) -> dict[str, Any]:
    """The params the result was generated with (older results did not say: the job's)."""
    return result.sampling or ctx.spec.sampling


def _check_finish(result: GeneratedResult) -> str:
    """The finish type; counts agree with the ids, a matched stop token ends them."""
    reason = result.finish_reason or {}
    finish = reason.get("type")
    if finish == "abort":
        raise CheckFailed(Reason.ABORTED, f"the server aborted it: {reason.get('message')!r}")
    if finish not in FINISH_REASONS:
        raise CheckFailed(Reason.UNKNOWN_FINISH_REASON, f"finish_reason {reason!r}")
    if result.completion_tokens != len(result.output_ids):
        raise CheckFailed(
            Reason.COUNT_MISMATCH,
            f"server counted {result.completion_tokens} completion tokens, "
            f"output_ids has {len(result.output_ids)}",
        )
    if result.prompt_tokens != len(result.prompt_ids):
        raise CheckFailed(
            Reason.COUNT_MISMATCH,
            f"server counted {result.prompt_tokens} prompt tokens, "
            f"{len(result.prompt_ids)} were sent",
        )
    matched = reason.get("matched") if finish == "stop" else None
    if is_token(matched) and result.output_ids[-1:] != [matched]:
        raise CheckFailed(
            Reason.STOP_MISMATCH,
            f"stop token {matched} matched but output ends with {result.output_ids[-1:]}",
        )
    return finish


def _check_one_answer(result: GeneratedResult, ctx: RecordContext) -> None:
    """The answer is one a server could have decoded: no end token before its last, no
    more tokens than its budget. An answer moved between servers is the one way regen
    could break either (docs/design/sglang.md, "Where an answer ends"); a trainer reading only
    `input_ids` and `loss_mask` (SpecForge) would learn from such a record whatever flag
    it carried, so it is refused here, never shipped."""
    sampling = _sampling(result, ctx)
    model_ends = ctx.spec.end_token_ids or ctx.family.end_of_turn_ids
    inside = misplaced_end(result.output_ids, request_end_ids(model_ends, sampling))
    if inside is not None:
        raise CheckFailed(
            Reason.END_INSIDE_ANSWER,
            f"end token {result.output_ids[inside]} at {inside} of {len(result.output_ids)} "
            "answer tokens: the answer goes on past its end",
        )
    budget = sampling.get("max_new_tokens")
    if isinstance(budget, int) and len(result.output_ids) > budget:
        raise CheckFailed(
            Reason.OVER_BUDGET,
            f"{len(result.output_ids)} answer tokens, over max_new_tokens {budget}",
        )


def _server_text(result: GeneratedResult, ctx: RecordContext, finish: str) -> str:
    """The server's text, checked to be the decode of output_ids as SGLang's
    detokenizer makes it (common/detokenize.py); that decode where the server sent no
    text (`--skip-tokenizer-init`).

    A length cut may end inside a UTF-8 sequence, whose replacement characters a server
    may hold back. Nothing else may differ.
    """
    decoded = detokenize(
        ctx.tokenizer, result.output_ids, result.finish_reason, _sampling(result, ctx)
    )
    text = result.text
    if text is None or text == decoded:
        return decoded
    if (
        finish == "length"
        and decoded.startswith(text)
        and not decoded[len(text) :].strip(_REPLACEMENT)
    ):
        return text
    at = first_difference(text, decoded)
    raise CheckFailed(
        Reason.TEXT_MISMATCH,
        f"server text differs from the decoded output_ids at char {at}: "
        f"text {text[at : at + 40]!r}, decoded {decoded[at : at + 40]!r} "
        f"({len(text)} vs {len(decoded)} chars)",
    )


def _tool_calls(
    result: GeneratedResult, ctx: RecordContext, text: str
) -> tuple[str, list[dict[str, Any]] | None]:
    """(the text to split into reasoning and answer, the calls the output ends in)."""
    return turn_calls(
        ctx.family,
        ctx.tokenizer,
        record_id=result.id,
        tools=result.tools,
        output_ids=result.output_ids,
        text=text,
        finish_reason=result.finish_reason,
        skip_special_tokens=_sampling(result, ctx).get("skip_special_tokens", True),
    )


def _split(
    result: GeneratedResult, ctx: RecordContext, finish: str, text: str
) -> tuple[str | None, str]:
    """(reasoning, answer) of `text`, after checking the output thinks as the job says it
    should. A turn that thought and stopped without closing its span, or left no answer,
    is a record with a quality flag; only a text that lost a span the ids close is
    refused."""
    family = ctx.family
    opened = family.think_open_id is not None and prompt_opens_think(family, result.prompt_ids)
    thinking = ctx.thinking
    if thinking is None and opened:
        thinking = True  # no switch in the template, but this prompt opens the span
    if thinking is False and (
        family.think_open_id in result.output_ids or family.think_close_id in result.output_ids
    ):
        # Token ids, not text: a think tag is one token, and a stray close tag with no
        # open one would slip past a text split.
        raise CheckFailed(
            Reason.UNEXPECTED_THINKING, "thinking is off but the output has a think tag"
        )
    if thinking and finish == "stop":
        state = think_state(family, text, opened_in_prompt=opened)
        if state is ThinkState.NO_SPAN:
            raise CheckFailed(
                Reason.MISSING_THINKING, "thinking is on but the output has no think span"
            )
        if state is ThinkState.UNCLOSED and family.think_close_id in result.output_ids:
            raise CheckFailed(
                Reason.UNCLOSED_THINKING,
                f"the output ids close the think span but the server's text has no "
                f"{family.think_close} (is it a special token the decode skips?)",
            )
    return split_reasoning(family, text, opened_in_prompt=opened)


def _drift_at(
    ctx: RecordContext,
    messages: list[dict[str, Any]],
    result: GeneratedResult,
    input_ids: list[int],
) -> int | None:
    """Where re-rendering the record's conversation departs from input_ids (drift.py)."""
    try:
        return drift_at(
            ctx.tokenizer, ctx.cut_ids, messages, ctx.spec.chat_template_kwargs, result.tools,
            input_ids, len(result.prompt_ids),
        )  # fmt: skip
    except ChatTemplateError as exc:
        raise CheckFailed(Reason.RENDER_FAILED, str(exc)) from exc
