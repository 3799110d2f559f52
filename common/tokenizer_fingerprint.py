"""The identity of a tokenizer: a short hash that changes when its behaviour could.

A job's spec records it, so a tokenize worker refuses a tokenizer that would tokenize
differently; the GGUF tokenizer cache (`common.tokenizer_cache`) keeps an entry only when
it matches.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Covers the pre-tokenizer's cases (case, digits, CJK, emoji, whitespace runs, code)
# and special tokens written in text.
_FINGERPRINT_PROBE = (
    "Hello, World! It's 2025-01-02: 12345 apples. café naïve 你好，世界 こんにちは 🎉👍🏽\n"
    "\tdef f(x):\n        return x ** 2  \n\n\n<|im_end|><think> </think>[BOS] end"
)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash that differs when two tokenizers could encode or render differently.

    Covers the vocabulary size, every added/special token with its id, the chat template
    and the ids of a probe text, with and without the tokenizer's own special tokens.
    """
    added = sorted(
        (i, token.content, bool(token.special))
        for i, token in tokenizer.added_tokens_decoder.items()
    )
    payload = {
        "size": len(tokenizer),
        "added": added,
        "special": sorted(
            zip(tokenizer.all_special_ids, tokenizer.all_special_tokens, strict=True)
        ),
        "roles": {
            name: getattr(tokenizer, f"{name}_token_id", None)
            for name in ("bos", "eos", "unk", "pad")
        },
        "template": tokenizer.chat_template,
        "probe": tokenizer.encode(_FINGERPRINT_PROBE, add_special_tokens=False),
        "probe_with_specials": tokenizer.encode(_FINGERPRINT_PROBE),
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
