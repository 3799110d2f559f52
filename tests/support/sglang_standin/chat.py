"""SGLang's OpenAI-compatible `POST /v1/chat/completions`, non-streaming, on the stand-in's
one core: the same slots, answers and slot log as `/generate`.

What SGLang 0.5 does, and so this does: the chat template renders the messages with the
generation prompt and the request's `chat_template_kwargs`, and the text is encoded
without special tokens added (docs/design/sglang.md, "SGLang contract"); `max_tokens` (or
`max_completion_tokens`) becomes `max_new_tokens`, and when neither is given the
scheduler caps the answer at the context length less the prompt less one. The reply is
a `chat.completion` whose choice carries `finish_reason` ("stop"/"length") and
`matched_stop`; errors are `{"object": "error", "message", "type", "param", "code"}`.
With no reasoning parser (the stand-in has none) `reasoning_content` is null and the
whole text is the `content`.

Because the answer is a function of the prompt ids alone (completer.py), a chat request
and a `/generate` request with the ids the same template renders get the same answer,
so a bench can give two clients that speak different routes identical work.
"""

from __future__ import annotations

import time
from typing import Any

from tests.support.sglang_standin.validate import Item, RequestError, check_item, request_object

# OpenAI chat fields that map onto SGLang sampling params under another name.
_RENAMED = {"min_tokens": "min_new_tokens", "seed": "sampling_seed"}
# Fields passed through unchanged (SGLang's ChatCompletionRequest extras among them).
_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "no_stop_trim",
)  # fmt: skip


def parse_chat(body: bytes, tokenizer: Any, vocab_size: int, context_length: int) -> Item:
    """One chat request as the stand-in's Item (rendered prompt ids), or RequestError."""
    req = request_object(body)
    if req.get("n", 1) != 1:
        raise RequestError("The stand-in supports n=1 only.")
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list.")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("content", ""), str):
            raise RequestError("The stand-in takes messages with string content.")
    kwargs = req.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object.")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=req.get("tools"), tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:  # a template error is the client's: SGLang answers 400
        raise RequestError(f"The chat template failed: {exc}") from exc
    input_ids = tokenizer.encode(text, add_special_tokens=False)
    sampling: dict[str, Any] = {key: req[key] for key in _SAMPLING if req.get(key) is not None}
    for openai_name, sglang_name in _RENAMED.items():
        if req.get(openai_name) is not None:
            sampling[sglang_name] = req[openai_name]
    max_new = req.get("max_tokens") or req.get("max_completion_tokens")
    if max_new is not None:
        sampling["max_new_tokens"] = max_new
    item = check_item(input_ids, sampling, req.get("rid"), vocab_size)
    if max_new is None:
        # The scheduler caps an answer with no limit at what the context leaves (this
        # limit always passes the admission check, as SGLang's unset one does).
        left = max(0, context_length - len(input_ids) - 1)
        return Item(item.rid, item.input_ids, {**item.sampling, "max_new_tokens": left})
    return item


def chat_response(reply: dict[str, Any], model: str) -> dict[str, Any]:
    """SGLang's `chat.completion` body for one /generate-shaped reply dict."""
    meta = reply["meta_info"]
    finish = meta["finish_reason"]
    return {
        "id": meta["id"],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": reply.get("text") or "",
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": finish["type"] if finish else None,
                "matched_stop": finish.get("matched") if finish else None,
            }
        ],
        "usage": {
            "prompt_tokens": meta["prompt_tokens"],
            "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
            "completion_tokens": meta["completion_tokens"],
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        },
        "metadata": {"weight_version": "default"},
    }


def chat_error(message: str, status: int, err_type: str = "BadRequestError") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
