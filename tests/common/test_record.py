"""build_record against real tokenizers: prompts rendered by the chat template, outputs
encoded from designed answers, `text` made the way SGLang's detokenizer makes it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from regen.common.chat_family import detect_family, render_prompt_ids
from regen.common.jobspec import JobSpec
from regen.common.record import (
    RECORD_FIELDS,
    RECORD_SCHEMA,
    CheckFailed,
    Reason,
    RecordContext,
    build_record,
)
from regen.common.results import GeneratedResult

IM_END = 163586  # Kimi's end of turn
THINK, THINK_END = 163606, 163607
SMOL_IM_END = 2
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
]


def make_spec(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = {
        "name": "job-1", "model": "target-model", "tokenizer": "tok", "trust_remote_code": True,
        "chat_family": "kimi", "tokenizer_fingerprint": "f" * 16,
        "sampling": {"max_new_tokens": 64, "temperature": 0.6}, "chat_template_kwargs": {},
        "system_prompt": None, "chunk_size": 4, "max_prompt_tokens": None,
        "context_length": None, "queue": "generate",
    }  # fmt: skip
    fields.update(overrides)
    return JobSpec(**fields)


def make_ctx(tokenizer: Any, **kwargs: Any) -> RecordContext:
    on_truncated = kwargs.pop("on_truncated", "dlq")
    drift_check = kwargs.pop("drift_check", True)
    return RecordContext(
        spec=make_spec(**kwargs), tokenizer=tokenizer, family=detect_family(tokenizer),
        on_truncated=on_truncated, drift_check=drift_check,
    )  # fmt: skip


def ids(tokenizer: Any, *parts: str | int) -> list[int]:
    """Token ids of text pieces (canonically encoded) and literal ids."""
    out: list[int] = []
    for part in parts:
        out += [part] if isinstance(part, int) else tokenizer.encode(part, add_special_tokens=False)
    return out


def make_result(
    ctx: RecordContext,
    output_ids: list[int],
    *,
    finish: dict[str, Any] | None = None,
    text: str | None = None,
    **overrides: Any,
) -> GeneratedResult:
    """A result as SGLang returns it: the matched stop token is in output_ids, not text."""
    prompt_ids = render_prompt_ids(ctx.tokenizer, MESSAGES, ctx.spec.chat_template_kwargs)
    if finish is None:
        finish = {"type": "stop", "matched": output_ids[-1]}
    if text is None:
        trimmed = output_ids[:-1] if isinstance(finish.get("matched"), int) else output_ids
        text = ctx.tokenizer.decode(trimmed, skip_special_tokens=True)
    fields: dict[str, Any] = {
        "id": "p-0001", "job": "job-1", "chunk": "c-1", "prompt_ids": prompt_ids,
        "messages": MESSAGES, "source": {"file": "data.jsonl", "row": 7},
        "output_ids": output_ids, "text": text, "finish_reason": finish,
        "prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids),
        "cached_tokens": 0, "latency_s": 0.5, "server": "http://gpu-1:30000",
        "worker": "w-1", "attempt": 0,
    }  # fmt: skip
    fields.update(overrides)
    return GeneratedResult(**fields)


def failure(result: GeneratedResult, ctx: RecordContext) -> str:
    with pytest.raises(CheckFailed) as info:
        build_record(result, ctx)
    assert info.value.message
    return info.value.reason


@pytest.fixture(scope="module")
def kimi(kimi_tokenizer: Any) -> RecordContext:
    return make_ctx(kimi_tokenizer)


# --- Kimi, thinking on (the template's default) -------------------------------------------


def test_kimi_thinking_record_is_token_exact(kimi: RecordContext) -> None:
    output = ids(kimi.tokenizer, "Let me think.", THINK_END, "The answer is 4.", IM_END)
    result = make_result(kimi, output)
    record = build_record(result, kimi)

    assert result.prompt_ids[-1] == THINK  # the prompt opened the span
    assert record["input_ids"] == result.prompt_ids + output
    assert record["loss_mask"] == [0] * len(result.prompt_ids) + [1] * len(output)
    assert record["loss_mask"][-1] == 1 and record["input_ids"][-1] == IM_END
    assert record["messages"] == [
        *MESSAGES,
        {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Let me think."},
    ]
    assert (record["prompt_tokens"], record["completion_tokens"]) == (
        len(result.prompt_ids), len(output),
    )  # fmt: skip
    assert record["finish_reason"] == "stop"
    assert (record["drift"], record["drift_at"]) == (False, None)
    assert record["schema"] == RECORD_SCHEMA and record["model"] == "target-model"
    assert record["sampling"] == {"max_new_tokens": 64, "temperature": 0.6}
    assert record["source"] == {"file": "data.jsonl", "row": 7}
    assert (record["server"], record["generated_by"]) == ("http://gpu-1:30000", "w-1")
    assert set(record) == set(RECORD_FIELDS)
    assert all(isinstance(record[k], types) for k, types in RECORD_FIELDS.items())


def test_an_answer_continued_on_another_server_makes_the_same_record(kimi: RecordContext) -> None:
    """A handed-over answer joined with its continuation (resume.py) carries no text
    (two decodes side by side may differ from the whole's): its record is the record
    of the same answer decoded on one server."""
    output = ids(kimi.tokenizer, "Let me think.", THINK_END, "The answer is 4.", IM_END)
    whole = make_result(kimi, output)
    joined = dataclasses.replace(whole, text=None, resumed_tokens=3)
    assert build_record(joined, kimi) == build_record(whole, kimi)


def test_kimi_default_thinking_is_detected(kimi_tokenizer: Any) -> None:
    assert make_ctx(kimi_tokenizer).thinking is True
    assert make_ctx(kimi_tokenizer, chat_template_kwargs={"thinking": False}).thinking is False
    assert make_ctx(kimi_tokenizer, chat_template_kwargs={"thinking": True}).thinking is True


def test_drift_found_where_token_boundaries_differ(kimi: RecordContext) -> None:
    answer = "The answer is 4."
    canonical = ids(kimi.tokenizer, answer)
    # Same text, one token per character: what a sampler can produce, never what the
    # template's re-rendering tokenizes to.
    spelled = [t for ch in answer for t in ids(kimi.tokenizer, ch)]
    assert spelled != canonical
    head = ids(kimi.tokenizer, "Let me think.", THINK_END)
    result = make_result(kimi, [*head, *spelled, IM_END])
    record = build_record(result, kimi)

    diff = next(i for i, (a, b) in enumerate(zip(spelled, canonical, strict=False)) if a != b)
    assert record["drift"] is True
    assert record["drift_at"] == len(result.prompt_ids) + len(head) + diff
    assert record["input_ids"] == result.prompt_ids + result.output_ids  # never "fixed"
    assert record["messages"][-1]["content"] == answer


def test_drift_check_off_records_null(kimi_tokenizer: Any) -> None:
    ctx = make_ctx(kimi_tokenizer, drift_check=False)
    record = build_record(make_result(ctx, ids(kimi_tokenizer, "Hm.", THINK_END, "4", IM_END)), ctx)
    assert (record["drift"], record["drift_at"]) == (None, None)


def test_text_must_match_the_decoded_ids(kimi: RecordContext) -> None:
    output = ids(kimi.tokenizer, "Let me think.", THINK_END, "The answer is 4.", IM_END)
    assert failure(
        make_result(kimi, output, text="Let me think.</think>The answer is 5."), kimi
    ) == (Reason.TEXT_MISMATCH)
    # The stop token belongs in output_ids only; text with it spelled out is not SGLang's.
    spelled_stop = "Let me think.</think>The answer is 4.<|im_end|>"
    assert failure(make_result(kimi, output, text=spelled_stop), kimi) == Reason.TEXT_MISMATCH


def test_finish_reasons(kimi: RecordContext) -> None:
    output = ids(kimi.tokenizer, "Let me think.", THINK_END, "4", IM_END)
    abort = {"type": "abort", "message": "client disconnected", "status_code": 499}
    assert failure(make_result(kimi, output, finish=abort), kimi) == Reason.ABORTED
    odd = {"type": "cancelled"}
    assert failure(make_result(kimi, output, finish=odd), kimi) == Reason.UNKNOWN_FINISH_REASON
    assert failure(make_result(kimi, output, finish={}), kimi) == Reason.UNKNOWN_FINISH_REASON
    wrong_stop = {"type": "stop", "matched": 163585}  # not the token that ended the output
    assert failure(make_result(kimi, output, finish=wrong_stop), kimi) == Reason.STOP_MISMATCH


def test_counts_must_agree(kimi: RecordContext) -> None:
    output = ids(kimi.tokenizer, "Let me think.", THINK_END, "4", IM_END)
    short = make_result(kimi, output, completion_tokens=len(output) - 1)
    assert failure(short, kimi) == Reason.COUNT_MISMATCH
    assert failure(make_result(kimi, output, prompt_tokens=3), kimi) == Reason.COUNT_MISMATCH


def test_thinking_that_never_closes_is_a_flagged_record(kimi: RecordContext) -> None:
    output = ids(kimi.tokenizer, "Let me think. The answer is 4.", IM_END)
    record = build_record(make_result(kimi, output), kimi)
    assert record["flags"] == ["thinking_only"]
    assert record["messages"][-1] == {
        "role": "assistant", "content": "", "reasoning_content": "Let me think. The answer is 4.",
    }  # fmt: skip
    assert record["input_ids"][-len(output) :] == output


@pytest.mark.parametrize("answer", ["", "  \n"])
def test_no_answer_after_thinking_is_flagged(kimi: RecordContext, answer: str) -> None:
    output = ids(kimi.tokenizer, "Let me think.", THINK_END, *([answer] if answer else []), IM_END)
    assert build_record(make_result(kimi, output), kimi)["flags"] == ["thinking_only"]


def test_an_empty_turn_is_flagged_empty(kimi_tokenizer: Any) -> None:
    ctx = make_ctx(kimi_tokenizer, chat_template_kwargs={"thinking": False})
    record = build_record(make_result(ctx, [IM_END]), ctx)
    assert record["flags"] == ["empty"] and record["completion_tokens"] == 1


def test_a_clean_answer_has_no_flags(kimi: RecordContext) -> None:
    output = ids(kimi.tokenizer, "Let me think.", THINK_END, "The answer is 4.", IM_END)
    assert build_record(make_result(kimi, output), kimi)["flags"] == []


def test_an_answer_that_ends_in_a_loop_is_flagged(kimi_tokenizer: Any) -> None:
    ctx = make_ctx(kimi_tokenizer, on_truncated="keep")
    loop = ids(kimi_tokenizer, " and then we check it again") * 20
    output = ids(kimi_tokenizer, "Let me think.", THINK_END, "So") + loop
    # A budget the loop fills: a record never holds more answer tokens than its budget.
    budget = {**ctx.spec.sampling, "max_new_tokens": len(output)}
    result = make_result(ctx, output, finish={"type": "length"}, sampling=budget)
    assert build_record(result, ctx)["flags"] == ["truncated", "repetition"]
    # The same words said twice are no loop.
    twice = ids(kimi_tokenizer, "Let me think.", THINK_END, "So") + loop[: 2 * len(loop) // 20]
    assert build_record(make_result(ctx, [*twice, IM_END]), ctx)["flags"] == []


# --- truncation ------------------------------------------------------------------------


def _truncated(ctx: RecordContext) -> GeneratedResult:
    output = ids(ctx.tokenizer, "Let me think about this carefully")  # no close, no end
    return make_result(ctx, output, finish={"type": "length", "length": len(output)})


def test_truncated_keep(kimi_tokenizer: Any) -> None:
    ctx = make_ctx(kimi_tokenizer, on_truncated="keep")
    result = _truncated(ctx)
    record = build_record(result, ctx)
    assert record["finish_reason"] == "length"
    assert record["input_ids"] == result.prompt_ids + result.output_ids
    assert sum(record["loss_mask"]) == len(result.output_ids)
    reasoning = "Let me think about this carefully"
    assert record["messages"][-1] == {
        "role": "assistant", "content": "", "reasoning_content": reasoning,
    }  # fmt: skip
    # The re-rendering closes the turn; over the record's own length it agrees.
    assert record["drift"] is False
    assert record["flags"] == ["thinking_only", "truncated"]


def test_truncated_drop_and_dlq(kimi_tokenizer: Any) -> None:
    drop = make_ctx(kimi_tokenizer, on_truncated="drop")
    assert failure(_truncated(drop), drop) == Reason.TRUNCATED_DROPPED
    dlq = make_ctx(kimi_tokenizer, on_truncated="dlq")
    assert failure(_truncated(dlq), dlq) == Reason.TRUNCATED
    with pytest.raises(ValueError, match="on_truncated"):
        make_ctx(kimi_tokenizer, on_truncated="ignore")


def _split_char_ids(tokenizer: Any) -> tuple[str, list[int]]:
    """A character the tokenizer spells with several byte tokens."""
    for ch in "𝔘𐍈🜁𓀀🂡⿰":
        char_ids = ids(tokenizer, ch)
        if len(char_ids) > 1 and tokenizer.decode(char_ids[:1]).endswith("\ufffd"):
            return ch, char_ids
    raise AssertionError("no multi-token character found")


def test_length_cut_may_hold_back_an_incomplete_utf8_tail(kimi_tokenizer: Any) -> None:
    ctx = make_ctx(kimi_tokenizer, on_truncated="keep", chat_template_kwargs={"thinking": False})
    _, char_ids = _split_char_ids(kimi_tokenizer)
    output = ids(kimi_tokenizer, "Answer: ") + char_ids[:1]
    length = {"type": "length", "length": len(output)}
    decoded = kimi_tokenizer.decode(output)
    assert decoded.endswith("\ufffd")
    for text in (decoded, decoded.rstrip("\ufffd")):
        record = build_record(make_result(ctx, output, finish=length, text=text), ctx)
        assert record["input_ids"][-1] == char_ids[0]
    # Only replacement characters may be missing, and only on a length cut.
    assert failure(make_result(ctx, output, finish=length, text="Answer:"), ctx) == (
        Reason.TEXT_MISMATCH
    )
    stopped = [*output, IM_END]
    held_back = make_result(ctx, stopped, text=decoded.rstrip("\ufffd"))
    assert failure(held_back, ctx) == Reason.TEXT_MISMATCH


# --- Kimi, thinking off ------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_off(kimi_tokenizer: Any) -> RecordContext:
    return make_ctx(kimi_tokenizer, chat_template_kwargs={"thinking": False})


def test_kimi_no_thinking_record(kimi_off: RecordContext) -> None:
    output = ids(kimi_off.tokenizer, "The answer is 4.", IM_END)
    result = make_result(kimi_off, output)
    record = build_record(result, kimi_off)
    assert result.prompt_ids[-2:] == [THINK, THINK_END]
    assert record["input_ids"] == result.prompt_ids + output
    assert record["messages"][-1] == {"role": "assistant", "content": "The answer is 4."}
    assert record["chat_template_kwargs"] == {"thinking": False}
    assert record["drift"] is False


def test_unexpected_thinking(kimi_off: RecordContext) -> None:
    output = ids(kimi_off.tokenizer, "Hmm.", THINK_END, "The answer is 4.", IM_END)
    assert failure(make_result(kimi_off, output), kimi_off) == Reason.UNEXPECTED_THINKING
    opened = ids(kimi_off.tokenizer, THINK, "Hmm.", THINK_END, "4.", IM_END)
    assert failure(make_result(kimi_off, opened), kimi_off) == Reason.UNEXPECTED_THINKING


def test_stop_string_keeps_its_tokens(kimi_tokenizer: Any) -> None:
    sampling = {"max_new_tokens": 64, "stop": ["END"]}
    ctx = make_ctx(kimi_tokenizer, chat_template_kwargs={"thinking": False}, sampling=sampling)
    output = ids(kimi_tokenizer, "The answer is 4. END")
    stop = {"type": "stop", "matched": "END"}
    record = build_record(make_result(ctx, output, finish=stop, text="The answer is 4. "), ctx)
    assert record["input_ids"][-len(output) :] == output  # the stop string's tokens stay
    assert record["messages"][-1]["content"] == "The answer is 4. "
    assert record["drift"] is True  # the re-rendering ends the turn with <|im_end|>
    bad = make_result(ctx, output, finish=stop, text="The answer is 4. END")
    assert failure(bad, ctx) == Reason.TEXT_MISMATCH


# --- SmolLM2 (chatml, no thinking) --------------------------------------------------------


def test_smollm2_record(smollm2_tokenizer: Any) -> None:
    ctx = make_ctx(smollm2_tokenizer, chat_family="chatml")
    output = ids(smollm2_tokenizer, "The answer is 4.", SMOL_IM_END)
    result = make_result(ctx, output)
    record = build_record(result, ctx)
    assert ctx.thinking is None
    assert record["input_ids"] == result.prompt_ids + output
    assert record["loss_mask"] == [0] * len(result.prompt_ids) + [1] * len(output)
    assert record["messages"][-1] == {"role": "assistant", "content": "The answer is 4."}
    # chatml renders "\n" after <|im_end|>; the comparison stops at the record's end.
    assert record["drift"] is False


# --- Qwen3-style (the model opens its own think span) -------------------------------------

QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' and m['reasoning_content'] is defined -%}"
    "{{ '<think>\\n' + m['reasoning_content'] + '\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}{%- endif -%}"
)


@pytest.fixture(scope="module")
def qwen3_tokenizer(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder: Path = tmp_path_factory.mktemp("qwen3-style")
    smollm2_tokenizer.save_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE + " enable_thinking"  # detect_family's cue
    return tokenizer


def test_qwen3_style_thinks_by_default(qwen3_tokenizer: Any) -> None:
    ctx = make_ctx(qwen3_tokenizer, chat_family="qwen3")
    assert ctx.family.name == "qwen3"
    assert ctx.thinking is True
    off = make_ctx(
        qwen3_tokenizer, chat_family="qwen3", chat_template_kwargs={"enable_thinking": False}
    )
    assert off.thinking is False

    output = ids(qwen3_tokenizer, "<think>", "\nHmm.\n", "</think>", "\n\nFour.", SMOL_IM_END)
    record = build_record(make_result(ctx, output), ctx)
    assert record["messages"][-1] == {
        "role": "assistant", "content": "Four.", "reasoning_content": "Hmm.",
    }  # fmt: skip
    no_span = ids(qwen3_tokenizer, "Four.", SMOL_IM_END)
    assert failure(make_result(ctx, no_span), ctx) == Reason.MISSING_THINKING


# --- tool calls ---------------------------------------------------------------------------

KIMI_SECTION, KIMI_SECTION_END = 163595, 163596
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = 163597, 163598, 163599
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def tool_result(ctx: RecordContext, output: list[int], **overrides: Any) -> GeneratedResult:
    """A result for ASK rendered with TOOLS (or `tools=...`)."""
    tools = overrides.pop("tools", TOOLS)
    prompt_ids = render_prompt_ids(ctx.tokenizer, ASK, ctx.spec.chat_template_kwargs, tools)
    return make_result(ctx, output, messages=ASK, tools=tools, prompt_ids=prompt_ids,
                       prompt_tokens=len(prompt_ids), **overrides)  # fmt: skip


def kimi_call(tokenizer: Any, arguments: str, *head: str | int) -> list[int]:
    return ids(tokenizer, *head, KIMI_SECTION, KIMI_CALL, "functions.get_weather:0",
               KIMI_ARGUMENTS, arguments, KIMI_CALL_END, KIMI_SECTION_END, IM_END)  # fmt: skip


def test_kimi_tool_calls_are_parsed_from_the_ids(kimi: RecordContext) -> None:
    output = kimi_call(kimi.tokenizer, '{"city": "Paris"}', "Need data.", THINK_END, "Checking.")
    result = tool_result(kimi, output)
    assert "tool_call" not in result.text  # the section's special tokens are not in the text
    record = build_record(result, kimi)

    assert record["messages"][-1] == {
        "role": "assistant", "content": "Checking.", "reasoning_content": "Need data.",
        "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
    }  # fmt: skip
    assert record["input_ids"] == result.prompt_ids + output
    assert (record["drift"], record["drift_at"]) == (False, None)
    assert record["tools"] == TOOLS
    assert set(record) == {*RECORD_FIELDS, "tools"}
    # The same when the job keeps special tokens in the text (SGLang's chat path does).
    keep = make_ctx(kimi.tokenizer, sampling={"max_new_tokens": 64, "skip_special_tokens": False})
    kept = tool_result(keep, output, text=kimi.tokenizer.decode(output[:-1]))
    assert "<|tool_calls_section_begin|>" in kept.text
    assert build_record(kept, keep)["messages"][-1] == record["messages"][-1]


def test_a_call_with_no_answer_text_is_no_empty_answer(kimi: RecordContext) -> None:
    record = build_record(
        tool_result(kimi, kimi_call(kimi.tokenizer, "{}", "Hm.", THINK_END)), kimi
    )
    assert record["messages"][-1]["content"] == ""
    assert record["messages"][-1]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_arguments_the_template_writes_otherwise_are_drift(kimi: RecordContext) -> None:
    # SGLang's chat path re-renders parsed arguments as `{"city": "Paris"}`: a turn fed
    # back would not be the ids the model wrote, which is what drift reports.
    output = kimi_call(kimi.tokenizer, '{"city":"Paris"}', "Hm.", THINK_END)
    result = tool_result(kimi, output)
    record = build_record(result, kimi)
    assert record["messages"][-1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    written, rendered = (
        ids(kimi.tokenizer, '{"city":"Paris"}'),
        ids(kimi.tokenizer, '{"city": "Paris"}'),
    )
    differ = next(i for i, (a, b) in enumerate(zip(written, rendered, strict=False)) if a != b)
    arguments_at = len(result.prompt_ids) + output.index(KIMI_ARGUMENTS) + 1
    assert record["drift"] is True and record["drift_at"] == arguments_at + differ


def test_calls_that_do_not_parse_or_were_not_offered_stay_text(kimi: RecordContext) -> None:
    bad = kimi_call(kimi.tokenizer, '{"city": Paris}', "Hm.", THINK_END, "Checking.")
    unoffered = kimi_call(kimi.tokenizer, '{"city": "Paris"}', "Hm.", THINK_END, "Checking.")
    for result in (tool_result(kimi, bad), make_result(kimi, unoffered)):
        record = build_record(result, kimi)
        assistant = record["messages"][-1]
        assert "tool_calls" not in assistant
        assert assistant["content"] == result.text.split("</think>")[1]
        assert record["flags"] == ["bad_tool_call"]
    # A call that parses but names a tool the prompt did not offer.
    other = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    called = kimi_call(kimi.tokenizer, '{"city": "Paris"}', "Hm.", THINK_END, "Checking.")
    record = build_record(tool_result(kimi, called, tools=other), kimi)
    assert record["flags"] == ["bad_tool_call"]
    assert build_record(tool_result(kimi, called), kimi)["flags"] == []


# Calls written as Qwen's template writes them (no ids: Hermes-style models use none).
HERMES_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{%- for c in m['tool_calls'] or [] -%}"
    "{%- if m['content'] or not loop.first %}{{ '\\n' }}{% endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{{ c['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def hermes_tokenizer_dir(smollm2_tokenizer: Any, folder: Path) -> Path:
    """A folder holding SmolLM2's tokenizer with a template that writes calls as Qwen's."""
    smollm2_tokenizer.save_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def hermes_tokenizer(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SmolLM2's tokenizer with a template that writes calls as Qwen's does."""
    folder = hermes_tokenizer_dir(smollm2_tokenizer, tmp_path_factory.mktemp("hermes-style"))
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_hermes_calls_split_from_the_answer(hermes_tokenizer: Any, smollm2_tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    function = {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    # Hermes calls carry no id: each gets one from the record's id and its place.
    expected_call = {"id": "call_p-0001_0", "type": "function", "function": function}
    ctx = make_ctx(hermes_tokenizer, chat_family="chatml")
    record = build_record(tool_result(ctx, ids(hermes_tokenizer, "Checking.\n" + call, 2)), ctx)
    assert record["messages"][-1] == {
        "role": "assistant", "content": "Checking.", "tool_calls": [expected_call],
    }  # fmt: skip
    assert record["drift"] is False
    # SmolLM2's own template has no place for calls: the content keeps their text.
    smol = make_ctx(smollm2_tokenizer, chat_family="chatml")
    record = build_record(tool_result(smol, ids(smollm2_tokenizer, "Checking.\n" + call, 2)), smol)
    assert record["messages"][-1]["content"] == "Checking.\n" + call
    assert record["messages"][-1]["tool_calls"] == [expected_call]
    assert record["drift"] is False
