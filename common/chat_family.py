"""Chat formats: which family a tokenizer's template belongs to, how to switch its
thinking mode, how prompts are rendered to ids, and how outputs split into reasoning
and answer.

Prompt ids are rendered the way SGLang's OpenAI chat path does it (0.5.x,
`serving_chat._apply_jinja_template`): the template renders text (`tokenize=False`),
then `tokenizer.encode(text, add_special_tokens=False)` turns it into ids. For the
tokenizers regen is tested with this equals `apply_chat_template(tokenize=True)`; the
two-step form is kept because it is what the server does, so the ids sent with
`input_ids` match what the same request through /v1/chat/completions would get.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import jinja2

from regen.common.piece_encoding import piece_encoder
from regen.common.tool_calls import ToolCallFormat, format_for, opening_marker, template_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FamilyName = Literal["kimi", "qwen3", "chatml", "generic"]

# Tokens that end an assistant turn in common templates; one counts for a tokenizer
# when it is in the vocabulary and its chat template writes it.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
# The DFlash drafters for Kimi K2.5 used this reserved special as their mask token.
KIMI_MASK_TOKEN_ID = 163838
_RESERVED = re.compile(r"reserved|unused", re.IGNORECASE)
# apply_chat_template's own parameters: as template kwargs they would collide with ours.
_RENDER_PARAMETERS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "chat_template",
        "tools",
    }
)


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages with these settings."""


@dataclass(frozen=True)
class ChatFamily:
    name: FamilyName
    thinking_kwarg: str | None  # the template variable that switches thinking on/off
    think_open: str | None
    think_close: str | None
    think_open_id: int | None
    think_close_id: int | None
    end_of_turn_ids: tuple[int, ...]
    mask_token_id: int | None  # suggestion for DFlash drafters
    tool_call_format: ToolCallFormat  # how the model writes tool calls
    # The token that opens the model's tool calls, where it is one token: a special one
    # (Kimi's) is dropped from the server's text, so the calls are found in the ids.
    tool_call_open_id: int | None
    # Whether the template renders an assistant turn's tool_calls (SmolLM2's does not:
    # a record then keeps the calls' text in its content, so that it re-renders).
    renders_tool_calls: bool


def detect_family(tokenizer: PreTrainedTokenizerBase) -> ChatFamily:
    vocab = tokenizer.get_vocab()
    template = _template_text(tokenizer)
    has_think = "<think>" in vocab and "</think>" in vocab
    name: FamilyName
    kwarg: str | None
    if "<|im_middle|>" in vocab:
        name, kwarg = "kimi", "thinking"
    elif "<|im_start|>" in vocab and has_think and "enable_thinking" in template:
        name, kwarg = "qwen3", "enable_thinking"
    elif "<|im_start|>" in vocab:
        name, kwarg = "chatml", None
    else:
        name, kwarg = "generic", None
    end_ids: list[int | None] = [
        vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab and t in template
    ]
    end_ids.append(tokenizer.eos_token_id)
    tool_format = format_for(vocab)
    return ChatFamily(
        name=name,
        thinking_kwarg=kwarg,
        think_open="<think>" if has_think else None,
        think_close="</think>" if has_think else None,
        think_open_id=vocab["<think>"] if has_think else None,
        think_close_id=vocab["</think>"] if has_think else None,
        end_of_turn_ids=tuple(dict.fromkeys(i for i in end_ids if i is not None)),
        mask_token_id=_mask_token_id(tokenizer, name),
        tool_call_format=tool_format,
        tool_call_open_id=vocab.get(opening_marker(tool_format)),
        renders_tool_calls="tool_calls" in template,
    )


def _template_text(tokenizer: PreTrainedTokenizerBase) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates ("default", "tool_use", ...)
        return "\n".join(template.values())
    return template or ""


def _mask_token_id(tokenizer: PreTrainedTokenizerBase, family: str) -> int | None:
    """A special token the target never emits, so drafters can use it as a mask."""
    reserved = [
        i
        for i, token in tokenizer.added_tokens_decoder.items()
        if token.special and _RESERVED.search(token.content)
    ]
    if family == "kimi" and KIMI_MASK_TOKEN_ID in reserved:
        return KIMI_MASK_TOKEN_ID
    return max(reserved, default=None)


def template_kwargs(
    family: ChatFamily, thinking: bool | None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Merge the --thinking/--no-thinking switch into the user's template kwargs.

    `thinking=None` leaves the template's default. The user's JSON may repeat the
    switch's variable but not contradict it.
    """
    kwargs = dict(extra or {})
    clashes = sorted(_RENDER_PARAMETERS & kwargs.keys())
    if clashes:
        raise ChatTemplateError(f"--chat-template-kwargs cannot set {', '.join(clashes)}")
    if thinking is None:
        return kwargs
    key = family.thinking_kwarg
    if key is None:
        # A template without a switch is fine with --no-thinking unless the model thinks.
        if thinking or family.think_open is not None:
            raise ChatTemplateError(
                f"the {family.name} chat template has no thinking switch; drop "
                "--thinking/--no-thinking and set the template's own variable with "
                "--chat-template-kwargs '{\"name\": value}'"
            )
        return kwargs
    if key in kwargs and kwargs[key] is not thinking:
        flag = "--thinking" if thinking else "--no-thinking"
        raise ChatTemplateError(
            f"{flag} contradicts --chat-template-kwargs {key}={kwargs[key]!r}; keep one of them"
        )
    kwargs[key] = thinking
    return kwargs


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids as SGLang's chat path would send them, ending in the generation
    prompt; `tools` are the OpenAI tools the conversation may call."""
    text = _render(tokenizer, messages, template_kwargs, tools, add_generation_prompt=True)
    return encode_text(tokenizer, text)


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, as SGLang's chat path calls it,
    through the `tokenizers` pipeline itself where that gives the same ids (`pipeline`)
    without transformers' per-call overhead, a good part of a short prompt's cost, and
    piece by piece, the pieces prompts share remembered (piece_encoding.py)."""
    backend = pipeline(tokenizer)
    if backend is None:
        return tokenizer.encode(text, add_special_tokens=False)
    return piece_encoder(tokenizer, backend).encode(text)


def pipeline(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The `tokenizers` pipeline of a fast tokenizer when calling it directly encodes and
    decodes as transformers does: no truncation or padding set (transformers' encode
    clears them) and special tokens matched as tokens (transformers sets the pipeline's
    `encode_special_tokens` from `split_special_tokens` at each call); else None."""
    if not getattr(tokenizer, "is_fast", False) or getattr(
        tokenizer, "split_special_tokens", False
    ):
        return None
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        return None
    return None if backend.encode_special_tokens else backend


def render_conversation_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """A whole conversation, final assistant turn included (with its `reasoning_content`
    where the template renders it): what the drift check compares records against.

    Some templates (chatml) end every turn with a newline the model never generates, so
    a record's ids are a prefix of this rendering rather than equal to it.
    """
    text = render_conversation_text(tokenizer, messages, template_kwargs, tools)
    return encode_text(tokenizer, text)


def render_conversation_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    template_kwargs: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The text `render_conversation_ids` tokenizes."""
    return _render(tokenizer, messages, template_kwargs, tools, add_generation_prompt=False)


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    kwargs: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    add_generation_prompt: bool,
) -> str:
    if not tokenizer.chat_template:
        raise ChatTemplateError(
            f"the tokenizer at {tokenizer.name_or_path} has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
        )
    if tools:  # as SGLang does: a template sees tools only where there are some
        kwargs = {**kwargs, "tools": list(tools)}
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except (jinja2.TemplateError, TypeError) as exc:
        # raise_exception() in the template, undefined variables, and the TypeErrors
        # templates hit on unexpected content: a bad prompt, not a bug here.
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc
    return cast(str, text)  # tokenize=False returns the rendered text


class ThinkState(enum.Enum):
    NO_SPAN = "no_span"
    UNCLOSED = "unclosed"  # reasoning started and never ended (e.g. hit max_new_tokens)
    CLOSED = "closed"


def prompt_opens_think(family: ChatFamily, prompt_ids: Sequence[int]) -> bool:
    """Whether the prompt leaves a think span open (Kimi with thinking on, Qwen3
    thinking-only models), so that generated text starts inside the reasoning."""
    for token in reversed(prompt_ids):
        if token == family.think_close_id:
            return False
        if token == family.think_open_id:
            return True
    return False


def think_state(
    family: ChatFamily, text: str, *, opened_in_prompt: bool | None = None
) -> ThinkState:
    span = _think_span(family, text, opened_in_prompt)
    if span is None:
        return ThinkState.NO_SPAN
    return ThinkState.UNCLOSED if span[1] is None else ThinkState.CLOSED


def split_reasoning(
    family: ChatFamily, text: str, *, opened_in_prompt: bool | None = None
) -> tuple[str | None, str]:
    """Split generated text into (reasoning, answer); reasoning is None without a span.

    `opened_in_prompt` says whether the prompt ended inside a think span (see
    `prompt_opens_think`); None infers it, which only works once the span is closed.
    An unclosed span is all reasoning with an empty answer.
    """
    span = _think_span(family, text, opened_in_prompt)
    if span is None:
        return None, text
    start, close = span
    if close is None:
        reasoning, answer = text[start:], ""
    else:
        reasoning, answer = text[start:close], text[close + len(family.think_close or "") :]
    if family.name != "kimi":
        # Qwen-style templates write "<think>\n" + reasoning + "\n</think>\n\n" + answer
        # and strip those newlines from the message fields when rendering; strip them
        # here too so the split messages re-render to the generated text. Kimi's
        # template adds nothing, so its split stays exact.
        reasoning, answer = reasoning.strip("\n"), answer.lstrip("\n")
    return reasoning, answer


def split_output(
    family: ChatFamily, prompt_ids: Sequence[int], text: str
) -> tuple[str | None, str]:
    """`split_reasoning` of generated text, the prompt saying whether it opened the span."""
    opened = family.think_open_id is not None and prompt_opens_think(family, prompt_ids)
    return split_reasoning(family, text, opened_in_prompt=opened)


def assistant_message(
    reasoning: str | None, answer: str, tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A generated turn as a chat template takes it back: the answer as `content`, the
    reasoning (where the output had a think span) as `reasoning_content`, which templates
    keep or drop in history as serving does, and the tool calls it ended in."""
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return message


def _think_span(
    family: ChatFamily, text: str, opened_in_prompt: bool | None
) -> tuple[int, int | None] | None:
    """(start of the reasoning, index of the close tag or None), or None for no span."""
    if family.think_open is None or family.think_close is None:
        return None
    stripped = text.lstrip()
    if stripped.startswith(family.think_open):
        start = len(text) - len(stripped) + len(family.think_open)
    elif opened_in_prompt:
        start = 0
    elif opened_in_prompt is None and family.think_close in text:
        start = 0  # a close tag with no open tag: the prompt opened the span
    else:
        return None
    close = text.find(family.think_close, start)
    return start, (None if close == -1 else close)
