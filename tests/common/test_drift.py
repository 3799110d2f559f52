"""The drift check's cut (common/drift.py): re-tokenizing only what follows
the prompt's last cut token finds exactly what re-tokenizing the whole rendering finds."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from regen.common.chat_family import render_prompt_ids
from regen.common.drift import cut_ids, drift_at
from regen.common.tokenizer import load_tokenizer

NO_CUTS: frozenset[int] = frozenset()
WORDS = ["the", "a", "fact", "moon.", "Hello,", "world!", "é", "日本", "\n", " ", "\t", "x  y"]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_tokenizer("smollm2")


def test_cut_tokens_are_special_tokens_matched_wherever_they_stand(
    smollm2: Any, kimi_tokenizer: Any
) -> None:
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    assert {im_end, smollm2.convert_tokens_to_ids("<|im_start|>")} <= cut_ids(smollm2)
    # A longer special token could match across the end of <|im_end|>: no cut there.
    longer = copy.deepcopy(smollm2)
    longer.add_special_tokens({"additional_special_tokens": ["<|im_end|>\n<|x|>"]})
    assert im_end not in cut_ids(longer)
    assert cut_ids(kimi_tokenizer) == NO_CUTS  # not a `tokenizers` pipeline: never cut


def test_the_cut_finds_what_tokenizing_the_whole_rendering_finds(smollm2: Any) -> None:
    rng = random.Random(0)
    cuts = cut_ids(smollm2)
    drifted = 0
    for case in range(200):
        system = [{"role": "system", "content": "Be terse."}] if case % 3 == 0 else []
        messages = [*system, {"role": "user", "content": " ".join(rng.choices(WORDS, k=8))}]
        prompt_ids = render_prompt_ids(smollm2, messages, {})
        answer = " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))
        output = smollm2.encode(answer, add_special_tokens=False)
        if case % 2:  # not the tokenizer's own split: each character on its own
            output = [t for ch in answer for t in smollm2.encode(ch, add_special_tokens=False)]
        if case % 5 == 0:  # a generation prompt the template would not write
            prompt_ids = [*prompt_ids[:-1], smollm2.encode(" x", add_special_tokens=False)[0]]
        conversation = [*messages, {"role": "assistant", "content": smollm2.decode(output)}]
        input_ids = prompt_ids + output + [smollm2.convert_tokens_to_ids("<|im_end|>")]
        found = drift_at(smollm2, cuts, conversation, {}, None, input_ids, len(prompt_ids))
        whole = drift_at(smollm2, NO_CUTS, conversation, {}, None, input_ids, len(prompt_ids))
        assert found == whole, case
        drifted += found is not None
    assert 0 < drifted < 200  # both outcomes were exercised


def test_a_history_rendered_otherwise_is_drift_at_its_first_difference(smollm2: Any) -> None:
    messages = [{"role": "user", "content": "What is the moon?"}]
    prompt_ids = render_prompt_ids(smollm2, messages, {})
    output = smollm2.encode("A rock.", add_special_tokens=False)
    # The record's history says something else than the prompt the server was sent.
    changed = [
        {"role": "user", "content": "What is the sun?"},
        {"role": "assistant", "content": "A rock."},
    ]
    input_ids = prompt_ids + output
    found = drift_at(smollm2, cut_ids(smollm2), changed, {}, None, input_ids, len(prompt_ids))
    assert found is not None
    assert found == drift_at(smollm2, NO_CUTS, changed, {}, None, input_ids, len(prompt_ids))
