"""Tool-use rows from dataset to record: OpenAI `tools`/`tool_calls`/`tool` messages and
ShareGPT `function_call`/`observation` turns parse into the template's shape, bad shapes
reach the input DLQ with a reason, and both rows render through the Kimi fixture's and
SmolLM2's templates into records. Rendering details: test_tokenizer.py; parsing calls out
of an output: test_record.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import dlq
from regen.common.chat_family import render_prompt_ids
from regen.common.results import GeneratedResult
from regen.consumers.tokenize.shard_files import iter_records
from regen.ops.shards_inspect import verify
from regen.producer.rows import BadRow, Reason, to_prompt
from tests.producer.test_enqueue import enqueue, queued_prompts
from tests.support.helpers import (
    MULTIPLY,
    OPENAI_TOOL_ROW,
    SHAREGPT_TOOL_ROW,
    WEATHER_TOOL,
    wait_for,
    write_jsonl,
)
from tests.support.tokenize_harness import InProcess, options, push, settled

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
MULTIPLY_CALL = {
    "id": "functions.multiply:0",
    "type": "function",
    "function": {"name": "multiply", "arguments": '{"a":12,"b":7}'},
}


def with_messages(row: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """OPENAI_TOOL_ROW with message fields changed: {index: {field: value}}."""
    changed = copy.deepcopy(row)
    for index, fields in changes.items():
        changed["messages"][int(index.removeprefix("m"))].update(fields)
    return changed


def with_arguments(arguments: str) -> dict[str, Any]:
    """OPENAI_TOOL_ROW with its call's arguments replaced."""
    function = {"name": "get_weather", "arguments": arguments}
    return with_messages(
        OPENAI_TOOL_ROW, m1={"tool_calls": [{**WEATHER_CALL, "function": function}]}
    )


# --- rows -------------------------------------------------------------------------------


def test_an_openai_tool_row_keeps_its_calls_and_results() -> None:
    prompt = to_prompt(OPENAI_TOOL_ROW)
    assert prompt.tools == [WEATHER_TOOL]
    # The final answer is what gets regenerated: the prompt ends on the tool's result.
    assert prompt.messages == [
        {"role": "user", "content": "Is it sunny in Paris right now?"},
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "content": '{"sky": "sunny", "c": 21}', "tool_call_id": "call_1"},
    ]


def test_a_sharegpt_tool_row_becomes_the_same_shape() -> None:
    prompt = to_prompt(SHAREGPT_TOOL_ROW)
    # The JSON string of bare function schemas, wrapped as OpenAI tools.
    assert prompt.tools == [{"type": "function", "function": MULTIPLY}]
    assert prompt.messages == [
        {"role": "system", "content": "Use the calculator for arithmetic."},
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "", "tool_calls": [MULTIPLY_CALL]},
        {"role": "tool", "content": "84", "tool_call_id": "functions.multiply:0"},
    ]


def test_legacy_function_calls_and_results_and_parallel_calls() -> None:
    row = {"messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "sun", "name": "get_weather"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather"}},
        {"role": "function", "name": "get_weather", "content": "fog"},
    ]}  # fmt: skip
    messages = to_prompt(row).messages
    calls = messages[1]["tool_calls"]
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city":"Paris"}', '{"city": "Rome"}']
    # Results without an id answer the calls in order; a legacy call has no arguments.
    assert [m.get("tool_call_id") for m in messages[2:4]] == [c["id"] for c in calls]
    assert messages[3]["name"] == "get_weather"
    assert messages[4]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert messages[5] == {"role": "tool", "content": "fog", "name": "get_weather",
                           "tool_call_id": "functions.get_weather:0"}  # fmt: skip


def test_the_prompt_id_includes_the_tools_and_normalizes_arguments() -> None:
    base = to_prompt(OPENAI_TOOL_ROW)
    other_tool = {**OPENAI_TOOL_ROW, "tools": [{**WEATHER_TOOL, "type": "function2"}]}
    no_tools = {k: v for k, v in OPENAI_TOOL_ROW.items() if k != "tools"}
    spaced, rome = with_arguments('{ "city":"Paris" }'), with_arguments('{"city": "Rome"}')
    assert len({base.id, to_prompt(other_tool).id, to_prompt(no_tools).id, to_prompt(rome).id}) == 4
    # Arguments that render the same (the template gets them parsed) are one prompt.
    assert to_prompt(spaced).id == base.id
    # No tools at all and an empty list are the same: the template sees none either way.
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    assert to_prompt({**plain, "tools": []}).id == to_prompt({**plain, "tools": ""}).id
    assert to_prompt({**plain, "tools": []}).id == to_prompt(plain).id


BAD_TOOL_ROWS = [
    (with_messages(OPENAI_TOOL_ROW, m1={"tool_calls": None, "content": "I will look."}),
     Reason.TOOL_WITHOUT_CALL, "messages[2]"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]},
     Reason.TOOL_WITHOUT_CALL, "messages[1]"),
    (with_messages(OPENAI_TOOL_ROW, m2={"tool_call_id": "call_9"}),
     Reason.TOOL_WITHOUT_CALL, "call_9"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "1"}]},
     Reason.TOOL_WITHOUT_CALL, "conversations[1]"),
    (with_arguments('{"city": Paris}'), Reason.BAD_TOOL_ARGUMENTS, "not JSON"),
    (with_arguments('["Paris"]'), Reason.BAD_TOOL_ARGUMENTS, "not a JSON object"),
    ({**SHAREGPT_TOOL_ROW, "conversations": [
        {"from": "human", "value": "q"}, {"from": "function_call", "value": "multiply(12, 7)"},
        {"from": "observation", "value": "84"}]}, Reason.BAD_TOOL_CALL, "not JSON"),
    (with_messages(OPENAI_TOOL_ROW, m1={"tool_calls": [{"function": {"arguments": "{}"}}]}),
     Reason.BAD_TOOL_CALL, "no function name"),
    (with_messages(OPENAI_TOOL_ROW, m1={"tool_calls": {"id": "call_1"}}),
     Reason.BAD_TOOL_CALL, "not a list"),
    ({**OPENAI_TOOL_ROW, "tools": {"get_weather": WEATHER_TOOL}}, Reason.BAD_TOOLS, "list"),
    ({**OPENAI_TOOL_ROW, "tools": ["get_weather"]}, Reason.BAD_TOOLS, "objects"),
    ({**SHAREGPT_TOOL_ROW, "tools": "[{'name': 'multiply'}]"}, Reason.BAD_TOOLS, "not JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "reason", "words"), BAD_TOOL_ROWS)
def test_bad_tool_shapes_are_refused_with_a_reason(row: Any, reason: str, words: str) -> None:
    with pytest.raises(BadRow) as caught:
        to_prompt(row)
    assert caught.value.reason == reason
    assert words in caught.value.message


# --- through the producer ---------------------------------------------------------------


def test_tool_rows_are_enqueued_with_their_tools_and_bad_ones_dead_lettered(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    bad = [row for row, _, _ in BAD_TOOL_ROWS]
    path = write_jsonl(tmp_path / "tools.jsonl", [OPENAI_TOOL_ROW, SHAREGPT_TOOL_ROW, *bad])
    stats = enqueue(redis_url, [path])

    assert (stats.enqueued, stats.rejected) == (2, len(bad))
    letters = {d.source["row"]: d.reason for d in dlq.entries(r, "j", "input")}
    assert letters == {row + 3: reason for row, (_, reason, _) in enumerate(BAD_TOOL_ROWS)}
    tools = {1: [WEATHER_TOOL], 2: [{"type": "function", "function": MULTIPLY}]}
    for prompt in queued_prompts(r):
        assert prompt["tools"] == tools[prompt["source"]["row"]]
        assert prompt["prompt_ids"] == render_prompt_ids(
            smollm2_tokenizer, prompt["messages"], {}, prompt["tools"]
        )


# --- into records -----------------------------------------------------------------------

KIMI_IM_END, KIMI_THINK_END = 163586, 163607
KIMI_SECTION = (163595, 163596)  # <|tool_calls_section_begin|>, <|tool_calls_section_end|>
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = 163597, 163598, 163599


def _ids(tokenizer: Any, *parts: str | int) -> list[int]:
    out: list[int] = []
    for part in parts:
        out += [part] if isinstance(part, int) else tokenizer.encode(part, add_special_tokens=False)
    return out


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out"


def _result(prompt: dict[str, Any], output_ids: list[int], tokenizer: Any) -> GeneratedResult:
    """What the generate stage hands over for a queued prompt of job j that the model
    answered with `output_ids` (end-of-turn token last), its text as SGLang writes it."""
    return GeneratedResult(
        id=prompt["id"], job="j", chunk="c-tools", prompt_ids=prompt["prompt_ids"],
        messages=prompt["messages"], tools=prompt["tools"], source=prompt["source"],
        output_ids=output_ids, text=tokenizer.decode(output_ids[:-1], skip_special_tokens=True),
        finish_reason={"type": "stop", "matched": output_ids[-1]},
        prompt_tokens=len(prompt["prompt_ids"]), completion_tokens=len(output_ids),
        cached_tokens=0, latency_s=0.1, server="test", worker="test", attempt=0,
    )  # fmt: skip


def _records(r: redis.Redis, out: Path, results: list[GeneratedResult]) -> dict[str, Any]:
    push(r, results)
    with InProcess(r, options(out), "c1"):
        wait_for(lambda: settled(r, "j", len(results)), what="the tool records")
    folder = out / "j"
    assert verify(folder) == []
    return {rec["id"]: rec for shard in folder.glob("shard-*") for rec in iter_records(shard)}


def test_kimi_tool_rows_render_and_make_records(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer: Any,
    kimi_tokenizer_dir: Path, out: Path,
) -> None:  # fmt: skip
    path = write_jsonl(tmp_path / "tools.jsonl", [OPENAI_TOOL_ROW, SHAREGPT_TOOL_ROW])
    enqueue(redis_url, [path], model=str(kimi_tokenizer_dir), trust_remote_code=True)
    prompts = {p["source"]["row"]: p for p in queued_prompts(r)}
    tok = kimi_tokenizer
    for prompt in prompts.values():
        text = tok.decode(prompt["prompt_ids"], skip_special_tokens=False)
        assert text.startswith("<|im_system|>tool_declare<|im_middle|>[{")
    # The OpenAI row's turn answers the tool result; the ShareGPT row's calls again.
    weather, numbers = prompts[1], prompts[2]
    answer = _ids(tok, "It is sunny.", KIMI_THINK_END, "Yes: sunny, 21 degrees.", KIMI_IM_END)
    call = _ids(tok, "Use the tool.", KIMI_THINK_END, KIMI_SECTION[0], KIMI_CALL,
                "functions.multiply:0", KIMI_ARGUMENTS, '{"a": 12, "b": 7}', KIMI_CALL_END,
                KIMI_SECTION[1], KIMI_IM_END)  # fmt: skip
    records = _records(r, out, [_result(weather, answer, tok), _result(numbers, call, tok)])

    first, second = records[weather["id"]], records[numbers["id"]]
    assert first["tools"] == [WEATHER_TOOL] and first["messages"][-2]["role"] == "tool"
    assert first["messages"][-1] == {"role": "assistant", "content": "Yes: sunny, 21 degrees.",
                                     "reasoning_content": "It is sunny."}  # fmt: skip
    assert second["messages"][-1] == {
        "role": "assistant", "content": "", "reasoning_content": "Use the tool.",
        "tool_calls": [{"id": "functions.multiply:0", "type": "function",
                        "function": {"name": "multiply", "arguments": '{"a": 12, "b": 7}'}}],
    }  # fmt: skip
    for record, result_ids in ((first, answer), (second, call)):
        prompt = weather if record is first else numbers
        assert record["input_ids"] == prompt["prompt_ids"] + result_ids  # the raw ids
        assert (record["drift"], record["drift_at"]) == (False, None)


def test_smollm2_tool_rows_render_and_make_records(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any, out: Path
) -> None:
    path = write_jsonl(tmp_path / "tools.jsonl", [OPENAI_TOOL_ROW, SHAREGPT_TOOL_ROW])
    enqueue(redis_url, [path])
    tok = smollm2_tokenizer
    prompts = {p["source"]["row"]: p for p in queued_prompts(r)}
    text = tok.decode(prompts[1]["prompt_ids"], skip_special_tokens=False)
    assert '<|im_start|>tool\n{"sky": "sunny", "c": 21}<|im_end|>' in text
    # SmolLM2's template has no place for tools: the model is not told of them.
    assert "get_weather" not in text
    call_text = '<tool_call>[{"name": "multiply", "arguments": {"a": 12, "b": 7}}]</tool_call>'
    outputs = {1: _ids(tok, "Yes, it is sunny.", 2), 2: _ids(tok, call_text, 2)}
    records = _records(r, out, [_result(prompts[i], outputs[i], tok) for i in (1, 2)])

    answer, call = records[prompts[1]["id"]], records[prompts[2]["id"]]
    assert answer["messages"][-1] == {"role": "assistant", "content": "Yes, it is sunny."}
    # Its template does not render tool_calls, so the content keeps the call's text.
    assert call["messages"][-1] == {
        "role": "assistant", "content": call_text,
        "tool_calls": [{"id": f"call_{prompts[2]['id']}_0", "type": "function",
                        "function": {"name": "multiply", "arguments": '{"a":12,"b":7}'}}],
    }  # fmt: skip
    assert call["tools"] == [{"type": "function", "function": MULTIPLY}]
    assert all(rec["drift"] is False for rec in (answer, call))
