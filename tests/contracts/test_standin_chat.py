"""The stand-in's OpenAI chat route (tests/support/sglang_standin/chat.py), as SpecForge's
regenerate script calls it: the same answer as /generate for the ids SGLang's chat path
renders, an answer length that depends on the prompt alone (not on the route or on the
order requests come in), SGLang's limits and error shape, and the slot log a bench
reads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from regen.common.chat_family import render_prompt_ids
from regen.common.tokenizer import load_tokenizer
from tests.support.sglang_standin.process import StandinHandle, run_standin, start_standin

pytestmark = pytest.mark.slow

DIST = "lognormal:mean=60,sigma=0.8,min=1,max=400"
PROMPTS = [f"Long prompt {i}: explain item {i} in depth." for i in range(6)]


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _chat(server: StandinHandle, body: dict[str, Any]) -> httpx.Response:
    """A request as the OpenAI client sends it (SpecForge's `client.chat.completions`)."""
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "smollm2", "stream": False, **body},
        headers={"Authorization": "Bearer None"},
        timeout=30,
        trust_env=False,
    )


@pytest.fixture(scope="module")
def server() -> Iterator[StandinHandle]:
    with run_standin(output_len_dist=DIST, context_length=1024) as handle:
        yield handle


def test_a_chat_answer_is_the_generate_answer_for_the_ids_the_template_renders(
    server: StandinHandle,
) -> None:
    tokenizer = load_tokenizer("smollm2")
    for prompt in PROMPTS[:3]:
        chat = _chat(server, {"messages": _messages(prompt), "max_tokens": 500})
        assert chat.status_code == 200, chat.text
        body = chat.json()
        ids = render_prompt_ids(tokenizer, _messages(prompt), {})
        generate = server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 500}})
        expected = generate.json()
        (choice,) = body["choices"]
        assert body["object"] == "chat.completion" and body["model"] == "smollm2"
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == expected["text"]
        assert choice["message"]["reasoning_content"] is None
        assert choice["finish_reason"] == expected["meta_info"]["finish_reason"]["type"] == "stop"
        assert choice["matched_stop"] == expected["meta_info"]["finish_reason"]["matched"]
        usage = body["usage"]
        assert usage["prompt_tokens"] == len(ids)
        assert usage["completion_tokens"] == expected["meta_info"]["completion_tokens"]
        assert usage["total_tokens"] == len(ids) + usage["completion_tokens"]


def test_max_tokens_caps_the_answer_and_a_missing_one_leaves_what_the_context_allows(
    server: StandinHandle,
) -> None:
    capped = _chat(server, {"messages": _messages(PROMPTS[0]), "max_tokens": 3}).json()
    assert capped["choices"][0]["finish_reason"] == "length"
    assert capped["usage"]["completion_tokens"] == 3
    # No max_tokens: SGLang's scheduler caps at the context (1024 here), not at /generate's
    # default of 128: an answer asked to be at least 300 tokens long ends on its own.
    free = _chat(server, {"messages": _messages(PROMPTS[0]), "min_tokens": 300}).json()
    assert free["choices"][0]["finish_reason"] == "stop"
    assert free["usage"]["completion_tokens"] > 300
    # Asked for more than the context leaves, it stops at the context.
    full = _chat(server, {"messages": _messages(PROMPTS[0]), "min_tokens": 2000}).json()
    assert full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["prompt_tokens"] + full["usage"]["completion_tokens"] == 1024 - 1


def test_sglang_limits_and_error_shape(server: StandinHandle) -> None:
    over = _chat(server, {"messages": _messages(PROMPTS[0]), "max_tokens": 5000})
    assert over.status_code == 400
    error = over.json()
    assert error["object"] == "error" and error["code"] == 400
    assert error["type"] == "BadRequestError" and "context length" in error["message"]
    streamed = _chat(server, {"messages": _messages(PROMPTS[0]), "stream": True})
    assert streamed.status_code == 400 and streamed.json()["object"] == "error"


def test_a_chat_request_is_in_the_slot_log_with_its_prompt_and_tokens(
    server: StandinHandle,
) -> None:
    reply = _chat(server, {"messages": _messages(PROMPTS[5]), "max_tokens": 500}).json()
    entry = server.slot_log()[-1]
    assert entry["outcome"] == "completed" and entry["rid"] == reply["id"]
    assert entry["tokens"] == reply["usage"]["completion_tokens"]
    ids = render_prompt_ids(load_tokenizer("smollm2"), _messages(PROMPTS[5]), {})
    assert entry["prompt"] == hash(tuple(ids))


def test_an_answer_length_depends_on_the_prompt_not_on_the_order_or_the_route() -> None:
    """Two fresh servers: one gets the prompts in order through the chat route, the
    other in reverse order through /generate. Each prompt's answer is as long on both:
    two tools that send the same prompts get the same work."""
    tokenizer = load_tokenizer("smollm2")
    servers = [start_standin(output_len_dist=DIST, context_length=1024) for _ in range(2)]
    try:
        for handle in servers:
            handle.wait_ready()
        chat, generate = servers
        by_chat = {
            p: _chat(chat, {"messages": _messages(p), "max_tokens": 500}).json()["usage"][
                "completion_tokens"
            ]
            for p in PROMPTS
        }
        by_generate = {}
        for p in reversed(PROMPTS):
            ids = render_prompt_ids(tokenizer, _messages(p), {})
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 500}}
            reply = generate.generate(body)
            by_generate[p] = reply.json()["meta_info"]["completion_tokens"]
    finally:
        for handle in servers:
            handle.close()
    assert by_chat == by_generate
    assert len(set(by_chat.values())) > 1  # the lengths do differ from prompt to prompt
