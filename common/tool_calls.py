"""Tool calls between chat templates and models: the messages a template takes, and the
calls a model writes in its output.

Messages hold OpenAI-shaped calls, `{"id", "type": "function", "function": {"name",
"arguments"}}` with `arguments` JSON text. SGLang's chat path parses that text into an
object before rendering (`serving_chat.normalize_assistant_tool_call_arguments`), so
templates see objects; `template_messages` does the same.

A model writes its calls in one of two forms:

- Kimi K2: a section of special tokens after the answer,
  `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`,
  the call id being `functions.NAME:INDEX`.
- Hermes style (Qwen, SmolLM2): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks after the answer; SmolLM2 writes a JSON list of calls in one block.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import orjson

ToolCallFormat = Literal["kimi", "hermes"]

KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"

_KIMI_SECTION = re.compile(
    re.escape(KIMI_SECTION_BEGIN) + r"(?P<calls>.*)" + re.escape(KIMI_SECTION_END) + r"\s*",
    re.DOTALL,
)
_KIMI_CALL = re.compile(
    r"\s*" + re.escape(KIMI_CALL_BEGIN) + r"(?P<id>.*?)" + re.escape(KIMI_ARGUMENT_BEGIN)
    + r"(?P<arguments>.*?)" + re.escape(KIMI_CALL_END) + r"\s*",
    re.DOTALL,
)  # fmt: skip
_HERMES_BLOCK = re.compile(
    r"\s*" + re.escape(HERMES_BEGIN) + r"(?P<body>.*?)" + re.escape(HERMES_END) + r"\s*",
    re.DOTALL,
)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as SGLang's chat path hands them to the template: a missing content as ""
    (templates that concatenate need it) and each call's arguments as an object."""
    out = []
    for message in messages:
        content = message.get("content")
        prepared = {**message, "content": "" if content is None else content}
        if message.get("tool_calls"):
            prepared["tool_calls"] = [_parsed_arguments(call) for call in message["tool_calls"]]
        out.append(prepared)
    return out


def _parsed_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return dict(call)
    try:
        arguments = orjson.loads(function["arguments"])
    except orjson.JSONDecodeError:
        return dict(call)  # the template renders the text as it is
    return {**call, "function": {**function, "arguments": arguments}}


def format_for(vocab: Mapping[str, int]) -> ToolCallFormat:
    """The form a tokenizer's model writes calls in: Kimi's where its vocabulary has the
    section tokens, else the `<tool_call>` form most other open models use."""
    return "kimi" if KIMI_SECTION_BEGIN in vocab else "hermes"


def opening_marker(form: ToolCallFormat) -> str:
    return KIMI_SECTION_BEGIN if form == "kimi" else HERMES_BEGIN


def parse_calls(form: ToolCallFormat, text: str) -> list[dict[str, Any]] | None:
    """The calls in `text`, which starts at the opening marker and runs to the end of the
    output; None unless all of it is well-formed calls with JSON-object arguments (a
    malformed call stays text in the answer)."""
    calls = _kimi_calls(text) if form == "kimi" else _hermes_calls(text)
    if not calls or not all(_is_object_json(call["function"]["arguments"]) for call in calls):
        return None
    return calls


def _kimi_calls(text: str) -> list[dict[str, Any]] | None:
    section = _KIMI_SECTION.fullmatch(text)
    if section is None:
        return None
    body, calls, at = section["calls"], [], 0
    while at < len(body):
        call = _KIMI_CALL.match(body, at)
        if call is None:
            return None
        # The id is functions.NAME:INDEX; NAME as vLLM's and SGLang's parsers take it.
        name = call["id"].strip().split(":")[0].split(".")[-1]
        calls.append(_openai_call(call["id"], name, call["arguments"]))
        at = call.end()
    return calls


def _hermes_calls(text: str) -> list[dict[str, Any]] | None:
    calls, at = [], 0
    while at < len(text):
        block = _HERMES_BLOCK.match(text, at)
        if block is None:
            return None
        try:
            body = orjson.loads(block["body"])
        except orjson.JSONDecodeError:
            return None
        for call in body if isinstance(body, list) else [body]:
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                return None
            arguments = call.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = orjson.dumps(arguments).decode()
            calls.append(_openai_call(None, call["name"], arguments))
        at = block.end()
    return calls


def _openai_call(call_id: str | None, name: str, arguments: str) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call["id"] = call_id
    return call


def _is_object_json(text: str) -> bool:
    try:
        return isinstance(orjson.loads(text), dict)
    except orjson.JSONDecodeError:
        return False
