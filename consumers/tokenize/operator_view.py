"""The tokenize stage as the operator tools see it (regen/ops, `regen shards`, the demo's
report): the shards it wrote and how to read them, its commit ledger in Redis, and
whether that ledger is behind the shard folder. regen/ops imports the tokenize stage
from here only, so the stage's inner modules can change without touching them.
"""

from regen.consumers.tokenize.commit_ledger import COUNT_LUA, CommitLedger, Sample
from regen.consumers.tokenize.ledger_vs_disk import behind_message, manifest_epoch
from regen.consumers.tokenize.shard_files import (
    MANIFEST,
    READ_ERRORS,
    ShardInfo,
    append_manifest,
    describe,
    is_job_folder,
    iter_ids,
    iter_job_ids,
    iter_records,
    read_manifest,
    shard_number,
    shard_paths,
    temp_files,
)

__all__ = [
    "COUNT_LUA",
    "MANIFEST",
    "READ_ERRORS",
    "CommitLedger",
    "Sample",
    "ShardInfo",
    "append_manifest",
    "behind_message",
    "describe",
    "is_job_folder",
    "iter_ids",
    "iter_job_ids",
    "iter_records",
    "manifest_epoch",
    "read_manifest",
    "shard_number",
    "shard_paths",
    "temp_files",
]
