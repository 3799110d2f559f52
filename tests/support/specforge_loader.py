"""SpecForge's own reader of a prompts file (its `data.prompts_path`):
`specforge.data.prompt_builder.prepare_prompt_tasks`, as its trainer calls it. Its path
for pre-tokenized rows (`input_ids` and `loss_mask`) is the standard library alone, so the
specforge wheel is installed without its dependencies (torch, sglang: scripts/setup.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

# Above any record's length: nothing cut, so what SpecForge reads is the whole record.
NO_LIMIT = 1 << 30


def specforge_prompts(path: Path) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each prompt SpecForge trains on from `path`, in order;
    a row SpecForge refuses raises, one it skips (no trainable token) is missing."""
    builder: Any = pytest.importorskip(
        "specforge.data.prompt_builder",
        reason="specforge is not installed (scripts/setup.sh: pip install --no-deps specforge)",
    )
    tasks = builder.prepare_prompt_tasks(
        path, tokenizer=None, chat_template=None, max_length=NO_LIMIT, is_preformatted=False,
        train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=None,
    )  # fmt: skip
    return [(task["payload"]["input_ids"], task["payload"]["loss_mask"]) for task in tasks]
