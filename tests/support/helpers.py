"""Small helpers shared by tests: reading what the producer queued, writing datasets."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import orjson
import redis

from regen.common.queues import queue_lists


def queued_chunks(r: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The chunk payloads waiting in a generate queue, oldest first (not consumed)."""
    chunks = []
    for name in queue_lists(queue):
        for raw in reversed(r.lrange(name, 0, -1)):  # LPUSH + RPOP: the tail is the oldest
            chunks.append(decode_message(raw))
    return chunks


def decode_message(raw: bytes) -> dict[str, Any]:
    """The chunk payload of a kombu/Celery message as kept in a Redis list."""
    message = orjson.loads(raw)
    body = message["body"]
    if message["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = orjson.loads(body)
    payload: dict[str, Any] = args[0]
    return payload


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row, ensure_ascii=False))
            fh.write("\n")
    return path


def user_rows(n: int, prefix: str = "Question", pad: int = 0) -> list[dict[str, Any]]:
    filler = " lorem ipsum" * pad
    return [{"prompt": f"{prefix} number {i}: what is {i} plus {i}?{filler}"} for i in range(n)]


def make_result(tok: Any, spec: Any, i: int, answer: str | None = None) -> Any:
    """A result as the generate stage hands it over: real prompt ids, an answer's ids
    followed by the end-of-turn token (included, as SGLang returns it)."""
    from regen.common.chat_family import detect_family, render_prompt_ids
    from regen.common.results import GeneratedResult
    from regen.producer.rows import prompt_id

    messages = [{"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]
    prompt_ids = render_prompt_ids(tok, messages, spec.chat_template_kwargs)
    answer = answer if answer is not None else f"{i} plus {i} is {2 * i}."
    eot = detect_family(tok).end_of_turn_ids[0]
    output_ids = [*tok.encode(answer, add_special_tokens=False), eot]
    return GeneratedResult(
        id=prompt_id(messages), job=spec.name, chunk="c-test", prompt_ids=prompt_ids,
        messages=messages, source={"file": "test.jsonl", "row": i + 1},
        output_ids=output_ids, text=answer, finish_reason={"type": "stop", "matched": eot},
        prompt_tokens=len(prompt_ids), completion_tokens=len(output_ids), cached_tokens=0,
        latency_s=0.01, server="test", worker="test", attempt=0,
        # A budget the answer fits, as any answer a server gives does.
        sampling={**spec.sampling,
                  "max_new_tokens": max(spec.sampling["max_new_tokens"], len(output_ids))},
    )  # fmt: skip


def wait_for(condition: Any, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll until condition() is true; fail with `what` after timeout."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


# Tool-use rows, one of each shape (as in the demo's bundled rows).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# OpenAI: row-level tools, an assistant call with null content, the tool's result.
OPENAI_TOOL_ROW: dict[str, Any] = {
    "tools": [WEATHER_TOOL],
    "messages": [
        {"role": "user", "content": "Is it sunny in Paris right now?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"sunny\", \"c\": 21}"},
        {"role": "assistant", "content": "Yes: sunny and 21 degrees."},
    ],
}  # fmt: skip
# LLaMA-Factory's ShareGPT: tools as a JSON string of bare function schemas, a
# function_call turn holding the call's JSON, an observation turn holding the result.
MULTIPLY = {
    "name": "multiply",
    "description": "Multiply two numbers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}
SHAREGPT_TOOL_ROW: dict[str, Any] = {
    "conversations": [
        {"from": "human", "value": "What is 12 times 7?"},
        {"from": "function_call", "value": '{"name": "multiply", "arguments": {"a": 12, "b": 7}}'},
        {"from": "observation", "value": "84"},
        {"from": "gpt", "value": "12 times 7 is 84."},
    ],
    "system": "Use the calculator for arithmetic.",
    "tools": json.dumps([MULTIPLY]),
}


def job_ids(r: redis.Redis, job: str) -> set[str]:
    """Every id enqueued in the job (its bucketed id index)."""
    from regen.common.ledger.job_ids import JobIds

    return set(JobIds(r, job))


def committed_count(r: redis.Redis, job: str) -> int:
    """Ids in the job's committed index (claimed or committed), as status counts them."""
    from regen.common.ledger.commit_ledger import CommitLedger

    return CommitLedger(r, job).count()[0]


def drop_job_id(r: redis.Redis, job: str, pid: str) -> None:
    """Take an id out of the job's ids, as a Redis that lost it would have (only tests do)."""
    from regen.common import keys
    from regen.common.ledger.job_ids import JobIds

    (bucket,), (field,) = JobIds(r, job).index.keys_and_fields([pid])
    if r.hdel(bucket, field):
        r.hincrby(keys.job_counters(job), keys.IDS, -1)
