"""A shard file's name: `shard-NNNNNN.jsonl.zst`, its number the commit ledger's
sequence. The ledger stores a regular name as its number (common/ledger/commit_ledger.py)
and the tokenize stage names the files it writes with it (consumers/tokenize/shard_files.py).
"""

from __future__ import annotations

SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".jsonl.zst"
SHARD_GLOB = f"{SHARD_PREFIX}*{SHARD_SUFFIX}"


def shard_name(seq: int) -> str:
    return f"{SHARD_PREFIX}{seq:06d}{SHARD_SUFFIX}"


def shard_number(name: str) -> int | None:
    """The sequence number in a shard's name (None for any other name)."""
    digits = name.removeprefix(SHARD_PREFIX).removesuffix(SHARD_SUFFIX)
    is_shard = name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)
    return int(digits) if is_shard and digits.isdigit() else None
