"""The tokenize stage as the operator tools see it (regen/ops, `regen shards`, the demo's
report): the shards it wrote and how to read them, in a local folder or a bucket
(job_folder.py), its commit ledger in Redis, and whether that ledger is behind the
shard folder. regen/ops imports the tokenize stage from here only, so the stage's inner
modules can change without touching them.
"""

from regen.common.ledger.commit_ledger import COUNT_LUA, CommitLedger, Sample
from regen.common.ledger.shard_names import shard_number
from regen.consumers.tokenize.job_folder import (
    JobFolder,
    LocalFolder,
    ShardRef,
    as_folder,
    folder_at,
    job_folder,
    job_folders,
)
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
    shard_paths,
    temp_files,
)

__all__ = [
    "COUNT_LUA",
    "MANIFEST",
    "READ_ERRORS",
    "CommitLedger",
    "JobFolder",
    "LocalFolder",
    "Sample",
    "ShardInfo",
    "ShardRef",
    "append_manifest",
    "as_folder",
    "behind_message",
    "describe",
    "folder_at",
    "is_job_folder",
    "iter_ids",
    "iter_job_ids",
    "iter_records",
    "job_folder",
    "job_folders",
    "manifest_epoch",
    "read_manifest",
    "shard_number",
    "shard_paths",
    "temp_files",
]
