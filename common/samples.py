"""Several answers per prompt (`regen enqueue --samples K`): their ids and seeds.

Sample k of prompt P is a prompt of its own, with the id `P-s<k>` (a conversation's,
with `--turns all`: `C-s<k>`, its turns `C-s<k>-<turn>`), so each is exactly-once like
any prompt. The producer publishes the samples of a buffer of prompts as one chunk per
k, with the sampling parameter `sampling_seed` set for that chunk: the K answers to one
prompt are drawn with K different seeds, and every record's `sampling` says which.
A sample's `source` holds its index (`"sample": k`), which exports use to hold out all
samples of a prompt together. A job of one sample (the default) has plain ids and no
seed of its own, as before samples existed.
"""

from __future__ import annotations

import hashlib
from typing import Any

SEED_PARAM = "sampling_seed"


def sample_id(base: str, k: int) -> str:
    return f"{base}-s{k}"


def sample_seed(job: str, k: int) -> int:
    """Sample k's seed: stable for the job (a rerun draws the same), distinct per k."""
    digest = hashlib.blake2b(f"{job}\0sample\0{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def prompt_unit(record: dict[str, Any]) -> str:
    """What a held-out split keeps together: the conversation or prompt a record belongs
    to, without its sample suffix (every sample of a prompt on one side)."""
    unit: str = record.get("conversation_id") or record["id"]
    k = (record.get("source") or {}).get("sample")
    return unit if k is None else unit.removesuffix(f"-s{k}")
