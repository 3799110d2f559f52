"""The tokenizer layer against real tokenizers: SmolLM2 from its GGUF and the Kimi-format
fixture through transformers' remote code. Nothing here is mocked."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from regen.common.chat_family import (
    ChatTemplateError,
    ThinkState,
    detect_family,
    encode_text,
    pipeline,
    prompt_opens_think,
    render_conversation_ids,
    render_prompt_ids,
    split_reasoning,
    template_kwargs,
    think_state,
)
from regen.common.tokenizer import (
    CACHE_MARKER,
    SMOLLM2,
    MissingDependency,
    ModelNotFound,
    RemoteCodeRequired,
    load_tokenizer,
    model_context_length,
    resolve_model,
    tokenizer_fingerprint,
)
from regen.common.tokenizer_cache import read_cache
from regen.producer.rows import to_prompt
from tests.support.fixtures.kimi_tokenizer import NAMED_SPECIALS
from tests.support.helpers import OPENAI_TOOL_ROW, SHAREGPT_TOOL_ROW

# --- fixtures ---------------------------------------------------------------------------
# kimi_tokenizer_dir and kimi_tokenizer come from conftest.py.


@pytest.fixture(scope="session")
def tokenizer_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def smollm2_tokenizer(tokenizer_cache_dir: Path) -> PreTrainedTokenizerBase:
    """Overrides conftest's: loaded through an empty cache folder of its own, so the
    disk-cache tests below see the entry this load wrote."""
    return load_tokenizer(SMOLLM2, cache_dir=tokenizer_cache_dir)


@pytest.fixture(scope="session")
def smollm2_saved_dir(
    smollm2_tokenizer: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """SmolLM2's tokenizer as a plain folder, to derive variants without touching the shared one."""
    folder = tmp_path_factory.mktemp("smollm2-saved")
    smollm2_tokenizer.save_pretrained(str(folder))
    return folder


# A Qwen3-style template (ours, reduced): chatml turns, and `enable_thinking=false`
# pre-fills an empty think span in the generation prompt.
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}{%- endif -%}"
)


@pytest.fixture()
def qwen3_style_tokenizer(smollm2_saved_dir: Path) -> PreTrainedTokenizerBase:
    """A real tokenizer with Qwen3's markers: SmolLM2's plus think tokens and template."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_saved_dir), local_files_only=True)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    return tokenizer


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? 用中文回答。"},
]
KIMI_PROMPT = (
    "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
    "<|im_user|>user<|im_middle|>What is 2+2? 用中文回答。<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>"
)


def _ids(tokenizer: PreTrainedTokenizerBase, *parts: str | int) -> list[int]:
    """Ids of a sequence given as text pieces and special-token ids."""
    ids: list[int] = []
    for part in parts:
        ids.extend(
            [part] if isinstance(part, int) else tokenizer.encode(part, add_special_tokens=False)
        )
    return ids


# --- resolving and loading --------------------------------------------------------------


def test_resolve_smollm2_finds_the_wheels_gguf() -> None:
    ref = resolve_model(SMOLLM2)
    assert ref.is_gguf and ref.path.is_file()
    assert ref.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert ref.folder == ref.path.parent


def test_missing_path_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="model not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFound, match="no tokenizer in"):
        load_tokenizer(str(tmp_path))


def test_remote_code_needs_the_flag(kimi_tokenizer_dir: Path) -> None:
    with pytest.raises(RemoteCodeRequired, match="--trust-remote-code"):
        load_tokenizer(str(kimi_tokenizer_dir))


def test_missing_package_is_named_with_its_pip_command(needs_missing_package_dir: Path) -> None:
    with pytest.raises(MissingDependency, match="pip install regen_test_absent_package") as err:
        load_tokenizer(str(needs_missing_package_dir), trust_remote_code=True)
    assert err.value.packages == ("regen_test_absent_package",)


def test_a_gguf_without_torch_names_torch(tmp_path: Path) -> None:
    """transformers converts a GGUF vocabulary with code that imports torch; without the
    `local` extra that must say so, not "Could not import module 'read_gguf_metadata'"."""
    script = (
        "import sys\n"
        "sys.modules['torch'] = None  # as if not installed: find_spec None, import fails\n"
        "from regen.common.tokenizer import MissingDependency, load_tokenizer\n"
        "try:\n"
        "    load_tokenizer('smollm2')\n"
        "except MissingDependency as exc:\n"
        "    print(exc.packages, exc)\n"
    )
    env = {**os.environ, "REGEN_HOME": str(tmp_path)}  # an empty cache: a real conversion
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    # torch comes with the `local` extra, as does gguf (#29).
    assert "('torch',)" in run.stdout and "pip install 'regen[local]'" in run.stdout, run.stdout


# --- families and template kwargs -------------------------------------------------------


def test_detect_family_smollm2_is_chatml(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(smollm2_tokenizer)
    assert family.name == "chatml"
    assert family.thinking_kwarg is None and family.think_open is None
    assert family.end_of_turn_ids == (smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert family.mask_token_id is None


def test_detect_family_kimi(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(kimi_tokenizer)
    assert family.name == "kimi"
    assert family.thinking_kwarg == "thinking"
    assert (family.think_open, family.think_close) == ("<think>", "</think>")
    assert (family.think_open_id, family.think_close_id) == (163606, 163607)
    assert family.end_of_turn_ids == (163586,)
    assert family.mask_token_id == 163838


def test_detect_family_qwen3_style(qwen3_style_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(qwen3_style_tokenizer)
    assert family.name == "qwen3"
    assert template_kwargs(family, False, {}) == {"enable_thinking": False}
    ids = render_prompt_ids(qwen3_style_tokenizer, MESSAGES, template_kwargs(family, False, {}))
    text = qwen3_style_tokenizer.decode(ids)
    assert isinstance(text, str)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_thinking_switch_for_smollm2_is_a_clear_error(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    family = detect_family(smollm2_tokenizer)
    with pytest.raises(ChatTemplateError, match="--chat-template-kwargs"):
        template_kwargs(family, True, {})
    # Nothing to switch off in a model that never thinks.
    assert template_kwargs(family, False, {"x": 1}) == {"x": 1}


def test_template_kwargs_merge_and_contradiction(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(kimi_tokenizer)
    assert template_kwargs(family, None, {"preserve_thinking": True}) == {"preserve_thinking": True}
    assert template_kwargs(family, False, {"thinking": False}) == {"thinking": False}
    assert template_kwargs(family, True, {"a": 1}) == {"a": 1, "thinking": True}
    with pytest.raises(ChatTemplateError, match="contradicts"):
        template_kwargs(family, True, {"thinking": False})
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        template_kwargs(family, None, {"add_generation_prompt": False})


# --- rendering --------------------------------------------------------------------------


def test_kimi_prompt_thinking_on(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    kwargs = template_kwargs(detect_family(kimi_tokenizer), True, {})
    text = kimi_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert text == KIMI_PROMPT
    ids = render_prompt_ids(kimi_tokenizer, MESSAGES, kwargs)
    expected = _ids(
        kimi_tokenizer,
        163594, "system", 163601, "You are terse.", 163586,
        163587, "user", 163601, "What is 2+2? 用中文回答。", 163586,
        163588, "assistant", 163601, 163606,
    )  # fmt: skip
    assert ids == expected
    assert ids[-1] == 163606
    # Thinking is Kimi's default.
    assert render_prompt_ids(kimi_tokenizer, MESSAGES, {}) == ids


def test_kimi_prompt_thinking_off(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    kwargs = template_kwargs(detect_family(kimi_tokenizer), False, {})
    text = kimi_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert text == KIMI_PROMPT + "</think>"
    ids = render_prompt_ids(kimi_tokenizer, MESSAGES, kwargs)
    assert ids[-2:] == [163606, 163607]
    assert ids[:-1] == render_prompt_ids(kimi_tokenizer, MESSAGES, {"thinking": True})


@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}])
def test_render_prompt_ids_equals_apply_chat_template(
    kimi_tokenizer: PreTrainedTokenizerBase,
    smollm2_tokenizer: PreTrainedTokenizerBase,
    kwargs: dict,
) -> None:
    for tokenizer in (kimi_tokenizer, smollm2_tokenizer):
        direct = tokenizer.apply_chat_template(
            MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
        )
        assert render_prompt_ids(tokenizer, MESSAGES, kwargs) == list(direct)


def test_kimi_history_drops_reasoning_unless_preserved(
    kimi_tokenizer: PreTrainedTokenizerBase,
) -> None:
    history = [
        *MESSAGES,
        {"role": "assistant", "content": "四", "reasoning_content": "2+2=4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    plain = kimi_tokenizer.decode(render_prompt_ids(kimi_tokenizer, history, {}))
    assert "<|im_assistant|>assistant<|im_middle|><think></think>四<|im_end|>" in plain
    kept = kimi_tokenizer.decode(
        render_prompt_ids(kimi_tokenizer, history, {"preserve_thinking": True})
    )
    assert "<|im_assistant|>assistant<|im_middle|><think>2+2=4</think>四<|im_end|>" in kept


def test_kimi_conversation_is_prompt_plus_generated_ids(
    kimi_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The token-exact property the drift check relies on: prompt ids followed by the
    generated ids render back as the conversation with the split assistant message."""
    prompt = render_prompt_ids(kimi_tokenizer, MESSAGES, {})
    generated = _ids(kimi_tokenizer, "2+2=4, in Chinese 四.", 163607, "四", 163586)
    text = kimi_tokenizer.decode(generated, skip_special_tokens=True)
    assert isinstance(text, str)
    reasoning, answer = split_reasoning(
        detect_family(kimi_tokenizer),
        text,
        opened_in_prompt=prompt_opens_think(detect_family(kimi_tokenizer), prompt),
    )
    assert (reasoning, answer) == ("2+2=4, in Chinese 四.", "四")
    assistant = {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    assert render_conversation_ids(kimi_tokenizer, [*MESSAGES, assistant], {}) == prompt + generated


def test_kimi_renders_text_parts_like_a_string(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    parts = [{"type": "text", "text": "What is 2+2? "}, {"type": "text", "text": "用中文回答。"}]
    as_parts: list[dict[str, Any]] = [MESSAGES[0], {"role": "user", "content": parts}]
    assert render_prompt_ids(kimi_tokenizer, as_parts, {}) == render_prompt_ids(
        kimi_tokenizer, MESSAGES, {}
    )


# Kimi K2's tool format (Moonshot's tool-call guide, its chat_template.jinja): the tools
# as compact JSON in a tool_declare turn, calls in a section of special tokens, a result
# under the tool's name (else "tool") starting "## Return of ID".
KIMI_TOOL_PROMPT = (
    '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":'
    '"get_weather","description":"The current weather in a city.","parameters":{"type":'
    '"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]<|im_end|>'
    "<|im_user|>user<|im_middle|>Is it sunny in Paris right now?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
    '<|tool_call_begin|>call_1<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    '<|im_system|>tool<|im_middle|>## Return of call_1\n{"sky": "sunny", "c": 21}<|im_end|>'
    "<|im_assistant|>assistant<|im_middle|><think>"
)


def test_kimi_renders_tools_calls_and_results_as_kimi_k2_does(
    kimi_tokenizer: PreTrainedTokenizerBase,
) -> None:
    prompt = to_prompt(OPENAI_TOOL_ROW)
    ids = render_prompt_ids(kimi_tokenizer, prompt.messages, {}, prompt.tools)
    assert kimi_tokenizer.decode(ids, skip_special_tokens=False) == KIMI_TOOL_PROMPT
    for marker in (163595, 163597, 163598, 163599, 163596):  # one special token each
        assert ids.count(marker) == 1
    # A ShareGPT row: the call id Kimi's parsers expect, the result named by it.
    sharegpt = to_prompt(SHAREGPT_TOOL_ROW)
    text = kimi_tokenizer.decode(
        render_prompt_ids(kimi_tokenizer, sharegpt.messages, {}, sharegpt.tools)
    )
    assert (
        "<|tool_call_begin|>functions.multiply:0<|tool_call_argument_begin|>"
        '{"a": 12, "b": 7}<|tool_call_end|>'
    ) in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.multiply:0\n84<|im_end|>" in text


def test_smollm2_renders_tool_results_and_ignores_tools(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """SmolLM2's template writes every message as role + content: a tool result is a
    `tool` turn, an assistant call an empty turn, and the tools are not rendered."""
    prompt = to_prompt(OPENAI_TOOL_ROW)
    ids = render_prompt_ids(smollm2_tokenizer, prompt.messages, {}, prompt.tools)
    text = smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    assert text.endswith(
        "<|im_start|>user\nIs it sunny in Paris right now?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        '<|im_start|>tool\n{"sky": "sunny", "c": 21}<|im_end|>\n<|im_start|>assistant\n'
    )
    assert ids == render_prompt_ids(smollm2_tokenizer, prompt.messages, {})
    family = detect_family(smollm2_tokenizer)
    assert (family.tool_call_format, family.tool_call_open_id) == ("hermes", None)
    assert family.renders_tool_calls is False


def test_kimi_family_knows_its_tool_call_tokens(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(kimi_tokenizer)
    assert (family.tool_call_format, family.tool_call_open_id) == ("kimi", 163595)
    assert family.renders_tool_calls is True
    with pytest.raises(ChatTemplateError, match="tools"):
        template_kwargs(family, None, {"tools": []})


def test_template_failure_is_a_chat_template_error(
    kimi_tokenizer: PreTrainedTokenizerBase,
) -> None:
    with pytest.raises(ChatTemplateError, match="unsupported role: narrator"):
        render_prompt_ids(kimi_tokenizer, [{"role": "narrator", "content": "x"}], {})


def test_no_chat_template_is_a_clear_error(smollm2_saved_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_saved_dir), local_files_only=True)
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_prompt_ids(tokenizer, MESSAGES, {})


# --- encoding ---------------------------------------------------------------------------


def test_kimi_special_tokens_have_kimi_ids(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(kimi_tokenizer) == kimi_tokenizer.vocab_size == 163_840
    for token_id, token in NAMED_SPECIALS.items():
        assert kimi_tokenizer.convert_tokens_to_ids(token) == token_id
        assert kimi_tokenizer.encode(token, add_special_tokens=False) == [token_id]
        assert kimi_tokenizer.decode([token_id]) == token
    assert kimi_tokenizer.convert_ids_to_tokens(163838) == "<|reserved_token_163838|>"
    assert kimi_tokenizer.eos_token_id == 163586


def test_kimi_skip_special_tokens_keeps_think_tags(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = _ids(kimi_tokenizer, 163606, "r", 163607, "a", 163586)
    assert kimi_tokenizer.decode(ids, skip_special_tokens=True) == "<think>r</think>a"
    assert kimi_tokenizer.decode(ids) == "<think>r</think>a<|im_end|>"


ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line1\n\nline2\r\n\ttab",
    "你好，世界！这是一个测试。",
    "日本語のテキスト and English mixed, 한국어도",
    "emoji 🎉👍🏽🇫🇷 family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # ok",
    "numbers 1234567890 3.14159",
    "Ünïcödé àccents ß, don't won't it's",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_inverts_encode(
    text: str, kimi_tokenizer: PreTrainedTokenizerBase, smollm2_tokenizer: PreTrainedTokenizerBase
) -> None:
    for tokenizer in (kimi_tokenizer, smollm2_tokenizer):
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_kimi_pretokenizer_splits_han_from_latin(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = kimi_tokenizer.encode("abc中文")
    assert [kimi_tokenizer.decode(ids[:1]), kimi_tokenizer.decode(ids[1:])] == ["abc", "中文"]


# --- reasoning split --------------------------------------------------------------------


def test_split_reasoning_kimi(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(kimi_tokenizer)
    # Thinking on: the prompt holds <think>, the output closes it.
    assert split_reasoning(family, "R1\nR2</think>A", opened_in_prompt=True) == ("R1\nR2", "A")
    assert split_reasoning(family, "R</think>\nA") == ("R", "\nA")  # inferred, kept exact
    # Cut off while thinking: all reasoning, no answer.
    assert split_reasoning(family, "still thinking", opened_in_prompt=True) == (
        "still thinking",
        "",
    )
    # Thinking off: the prompt closed the span.
    assert split_reasoning(family, "Just A", opened_in_prompt=False) == (None, "Just A")


def test_split_reasoning_qwen3_style(qwen3_style_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(qwen3_style_tokenizer)
    assert split_reasoning(family, "<think>\nR\n</think>\n\nA") == ("R", "A")
    assert split_reasoning(family, "<think>\n\n</think>\n\nA") == ("", "A")
    # Thinking-only Qwen3 models put "<think>\n" in the prompt.
    assert split_reasoning(family, "R\n</think>\n\nA", opened_in_prompt=True) == ("R", "A")
    assert split_reasoning(family, "<think>\nR unfinished") == ("R unfinished", "")
    assert split_reasoning(family, "plain answer") == (None, "plain answer")


def test_split_reasoning_without_think_tokens(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(smollm2_tokenizer)
    assert split_reasoning(family, "a </think> b") == (None, "a </think> b")


def test_think_state(kimi_tokenizer: PreTrainedTokenizerBase) -> None:
    family = detect_family(kimi_tokenizer)
    on = render_prompt_ids(kimi_tokenizer, MESSAGES, {})
    off = render_prompt_ids(kimi_tokenizer, MESSAGES, {"thinking": False})
    assert prompt_opens_think(family, on) and not prompt_opens_think(family, off)
    assert think_state(family, "R</think>A", opened_in_prompt=True) is ThinkState.CLOSED
    assert think_state(family, "R", opened_in_prompt=True) is ThinkState.UNCLOSED
    assert think_state(family, "A", opened_in_prompt=False) is ThinkState.NO_SPAN


# --- identity, metadata, cache ----------------------------------------------------------


def test_fingerprint_stable_across_loads_and_distinct(
    kimi_tokenizer: PreTrainedTokenizerBase,
    kimi_tokenizer_dir: Path,
    smollm2_tokenizer: PreTrainedTokenizerBase,
    tokenizer_cache_dir: Path,
) -> None:
    # __wrapped__ skips the in-process memo, so these are fresh loads.
    kimi_again = load_tokenizer.__wrapped__(str(kimi_tokenizer_dir), trust_remote_code=True)
    smollm2_again = load_tokenizer.__wrapped__(SMOLLM2, cache_dir=tokenizer_cache_dir)
    assert kimi_again is not kimi_tokenizer
    assert tokenizer_fingerprint(kimi_again) == tokenizer_fingerprint(kimi_tokenizer)
    assert tokenizer_fingerprint(smollm2_again) == tokenizer_fingerprint(smollm2_tokenizer)
    assert tokenizer_fingerprint(kimi_tokenizer) != tokenizer_fingerprint(smollm2_tokenizer)


def test_load_is_memoized(
    smollm2_tokenizer: PreTrainedTokenizerBase, tokenizer_cache_dir: Path
) -> None:
    assert load_tokenizer(SMOLLM2, cache_dir=tokenizer_cache_dir) is smollm2_tokenizer


def test_model_context_length(kimi_tokenizer_dir: Path, tmp_path: Path) -> None:
    assert model_context_length(resolve_model(SMOLLM2)) == 8192
    assert model_context_length(resolve_model(str(kimi_tokenizer_dir))) == 262_144
    nested = {"model_type": "x", "text_config": {"max_position_embeddings": 32_768}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert model_context_length(resolve_model(str(tmp_path))) == 32_768
    (tmp_path / "config.json").unlink()
    assert model_context_length(resolve_model(str(tmp_path))) is None


def test_disk_cache_gives_identical_tokenizer(
    smollm2_tokenizer: PreTrainedTokenizerBase, tokenizer_cache_dir: Path
) -> None:
    (entry,) = [p for p in tokenizer_cache_dir.iterdir() if (p / CACHE_MARKER).is_file()]
    cached = load_tokenizer.__wrapped__(SMOLLM2, cache_dir=tokenizer_cache_dir)
    assert Path(cached.name_or_path) == entry
    assert cached.chat_template == smollm2_tokenizer.chat_template
    for text in [*ROUND_TRIP_TEXTS, "<|im_start|>user\nhi<|im_end|>\n"]:
        assert cached.encode(text) == smollm2_tokenizer.encode(text)
    for kwargs in ({}, {"x": 1}):
        assert render_prompt_ids(cached, MESSAGES, kwargs) == render_prompt_ids(
            smollm2_tokenizer, MESSAGES, kwargs
        )


def test_a_warm_load_imports_no_torch(
    smollm2_tokenizer: PreTrainedTokenizerBase, tokenizer_cache_dir: Path
) -> None:
    """Importing torch is over a second of a warm `regen enqueue`'s start-up; a cached
    tokenizer needs none of it."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from regen.common.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer('smollm2', cache_dir=Path({str(tokenizer_cache_dir)!r}))\n"
        f"assert Path(tok.name_or_path).parent == Path({str(tokenizer_cache_dir)!r})\n"
        "print('torch' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_disk_cache_entry_that_no_longer_matches_is_ignored(
    smollm2_tokenizer: PreTrainedTokenizerBase, tokenizer_cache_dir: Path, tmp_path: Path
) -> None:
    (entry,) = [p for p in tokenizer_cache_dir.iterdir() if (p / CACHE_MARKER).is_file()]
    copy = shutil.copytree(entry, tmp_path / entry.name)
    assert read_cache(copy) is not None
    (copy / CACHE_MARKER).write_text(json.dumps({"fingerprint": "something-else"}))
    assert read_cache(copy) is None


def test_encoding_through_the_pipeline_gives_transformers_ids(kimi_tokenizer: Any) -> None:
    smollm2 = load_tokenizer("smollm2")
    texts = ["", "Hello, world!", "<|im_start|>user\nCafé  日本\t<|im_end|>\n", " x  y "]
    for tokenizer in (smollm2, kimi_tokenizer):
        for text in texts:
            assert encode_text(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)
    assert pipeline(smollm2) is smollm2.backend_tokenizer
    assert pipeline(kimi_tokenizer) is None  # not a `tokenizers` pipeline
    splitting = copy.deepcopy(smollm2)
    splitting.split_special_tokens = True  # special tokens' text is tokenized as text
    assert pipeline(splitting) is None
    assert encode_text(splitting, texts[2]) == splitting.encode(texts[2], add_special_tokens=False)
