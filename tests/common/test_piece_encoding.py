"""Piece-by-piece encoding (common/piece_encoding.py) gives exactly the pipeline's ids."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, normalizers

from regen.common.chat_family import encode_text, render_prompt_ids
from regen.common.piece_encoding import MEMO_MAX_CHARS, PieceEncoder, split_at

# Fragments that build texts around and across added tokens: whole tokens, their halves,
# the text of tokens that could match over them, whitespace, combining accents (NFC).
FRAGMENTS = [
    "<|im_start|>", "<|im_end|>", "<|im_", "end|>", "<|", "|>", "<", ">", "q<|b", "<|b|>",
    "<|c|>", "zz", "<|d|>", "wordy", "<tool>", "user", "\n", " ", "  ", "\t", "Hello,",
    " world!", "é", "e\u0301", "\u0301", "日本", "x", "12", " 345", "'s", "\r\n",
]  # fmt: skip


@pytest.fixture(scope="module")
def pipeline_with_traps(smollm2_tokenizer: Any) -> Tokenizer:
    """SmolLM2's pipeline plus added tokens that must not be split at, and one that may."""
    backend = Tokenizer.from_str(smollm2_tokenizer.backend_tokenizer.to_str())
    backend.add_special_tokens(
        [
            AddedToken("<|b|>", normalized=False, special=True),  # "q<|b" ends in its start
            AddedToken("q<|b", normalized=False, special=False),
            AddedToken("<|c|>", normalized=False, special=True),  # inside "<|c|>zz"
            AddedToken("<|c|>zz", normalized=False, special=False),
            AddedToken("<|d|>", lstrip=True, normalized=False, special=True),  # takes spaces
            AddedToken("wordy", normalized=False, special=True),  # word characters at its ends
            AddedToken("<tool>", normalized=False, special=False),  # safe, though not special
        ]
    )
    return backend


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(FRAGMENTS, k=rng.randint(0, 14))) for _ in range(count)]


def expected(backend: Tokenizer, text: str) -> list[int]:
    return list(backend.encode(text, add_special_tokens=False).ids)


def test_only_tokens_the_pipeline_always_splits_at_are_split_at(
    pipeline_with_traps: Tokenizer,
) -> None:
    split = split_at(pipeline_with_traps)
    assert {"<|im_start|>", "<|im_end|>", "<tool>"} <= split.keys()
    assert not {"<|b|>", "q<|b", "<|c|>", "<|c|>zz", "<|d|>", "wordy"} & split.keys()
    # Why: the pipeline does not split at them everywhere. "q<|b" wins over "<|b|>",
    # "<|c|>zz" over "<|c|>", and "<|d|>" takes the space before it.
    traps = pipeline_with_traps
    assert traps.token_to_id("<|b|>") not in expected(traps, "q<|b|>")
    assert traps.token_to_id("<|c|>") not in expected(traps, "<|c|>zz")
    stripping = traps.token_to_id("<|d|>")
    assert expected(traps, "a <|d|>") != [*expected(traps, "a "), stripping]
    assert split["<|im_end|>"] in expected(traps, "x<|im_end|>y")


def test_pieces_give_the_pipelines_own_ids(pipeline_with_traps: Tokenizer) -> None:
    nfc = Tokenizer.from_str(pipeline_with_traps.to_str())
    nfc.normalizer = normalizers.NFC()
    for backend in (pipeline_with_traps, nfc):
        encoder = PieceEncoder(backend)
        texts = random_texts(seed=1, count=1500)
        for text in [*texts, *texts[:300]]:  # the second time, pieces come from memory
            assert encoder.encode(text) == expected(backend, text), repr(text)


def test_a_pipeline_that_does_not_encode_piecewise_is_encoded_whole(
    pipeline_with_traps: Tokenizer,
) -> None:
    lowercase = Tokenizer.from_str(pipeline_with_traps.to_str())
    lowercase.normalizer = normalizers.Lowercase()  # not per piece: no split
    assert split_at(lowercase) == {}
    encoder = PieceEncoder(lowercase)
    for text in random_texts(seed=2, count=200):
        assert encoder.encode(text) == expected(lowercase, text)


def test_remembered_pieces_are_shared_safely_and_bounded(pipeline_with_traps: Tokenizer) -> None:
    encoder = PieceEncoder(pipeline_with_traps)
    text = "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    first = encoder.encode(text)
    first.append(-1)  # a caller's list is its own
    assert encoder.encode(text) == expected(pipeline_with_traps, text)
    long_piece = "word " * (MEMO_MAX_CHARS // 5 + 1)
    before = encoder._remembered.cache_info().currsize
    assert encoder.encode(long_piece) == expected(pipeline_with_traps, long_piece)
    assert encoder._remembered.cache_info().currsize == before  # too long to keep


def test_prompts_render_to_the_same_ids_as_the_tokenizer_gives(smollm2_tokenizer: Any) -> None:
    rng = random.Random(3)
    for case in range(300):
        system = [{"role": "system", "content": "Answer in one line."}] if case % 2 else []
        content = "".join(rng.choices(FRAGMENTS, k=rng.randint(1, 10)))
        messages = [*system, {"role": "user", "content": content}]
        text = smollm2_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert render_prompt_ids(smollm2_tokenizer, messages, {}) == ids
        assert encode_text(smollm2_tokenizer, text) == ids
