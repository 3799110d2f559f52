"""`regen verify`'s pass over the shard files: their ids against the committed index.

Redis says which shard holds each id (`committed`); this reads the ids the files really
hold and checks the two agree, one shard at a time, keeping only that shard's ids in
memory. An id in two shards shows up as "in shard B, committed to A" when B is read, so
no job-wide set of ids is needed. The index is read through the commit ledger, the
files through the shard module.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import orjson
import redis

from regen.common import keys
from regen.common.ledger.places import batches
from regen.consumers.tokenize.operator_view import (
    READ_ERRORS,
    CommitLedger,
    JobFolder,
    ShardRef,
    behind_message,
    folder_at,
    iter_ids,
)

Report = Callable[[str, str, str], None]  # kind, subject, detail


def shard_folder(r: redis.Redis, job: str) -> JobFolder | None:
    """Where the tokenize stage says the job's shards are (on its host, or a bucket)."""
    raw = r.hget(keys.TOKENIZE_OUTPUTS, job)
    return folder_at(orjson.loads(raw)["dir"]) if raw else None


def _check_file(ledger: CommitLedger, path: ShardRef, report: Report) -> tuple[set[str], int]:
    """Checks each id of one shard against the index; returns (the ids whose index entry
    names this shard, ids read)."""
    name = path.name
    matched: set[str] = set()
    seen: set[str] = set()
    read = 0
    try:
        for batch in batches(iter_ids(path)):
            read += len(batch)
            for pid, owner in zip(batch, ledger.owner_of(batch), strict=True):
                if pid in seen:
                    report("twice_in_shard", pid, f"{name} holds it more than once")
                elif owner is None:
                    report("in_shard_not_committed", pid, f"in {name}, not in the committed index")
                elif owner != name:
                    report("in_two_shards", pid, f"in {name}, but committed to {owner}")
                else:
                    matched.add(pid)
                seen.add(pid)
    except (OSError, KeyError, *READ_ERRORS) as exc:
        report("unreadable_shard", name, f"after {read} records: {exc}")
    return matched, read


def check_shards(
    ledger: CommitLedger, folder: JobFolder, per_shard: Counter[str], report: Report
) -> tuple[int, int]:
    """Check the job's shard files at `folder` against `committed` (`per_shard`: how many
    ids the index put in each shard). Returns (files read, ids read).

    The folder is listed before the shard lists are read: a file is placed only while
    its shard is pending, and leaves pending only for the list of shards in place, so a
    file listed is in one of the two by then. Shards still pending are skipped (their
    ids are in flight).
    """
    on_disk = set(folder.shard_names())
    final, pending = ledger.shard_names()
    for name in sorted(final - on_disk):
        if not folder.has(name):  # not placed after the listing either
            report("missing_shard_file", name, f"listed, {per_shard[name]} ids, not in {folder}")
    files = ids_read = 0
    short: dict[str, set[str]] = {}
    for name in sorted(on_disk - pending):
        if name not in final:
            report("unlisted_shard", name, f"in {folder} but not one of the job's shards")
        matched, read = _check_file(ledger, ShardRef(folder, name), report)
        files += 1
        ids_read += read
        if len(matched) < per_shard[name]:
            short[name] = matched
    if short:  # rare: name the ids the index puts in a shard that lacks them
        for pid, shard in ledger.iter_committed():
            if shard in short and pid not in short[shard]:
                report("not_in_shard", pid, f"committed to {shard}, not in its file")
    return files, ids_read


def compare_folder(ledger: CommitLedger, job: str, folder: JobFolder, report: Report) -> int:
    """`regen shards verify` with Redis: the job folder's files against its ledger (Redis
    behind the disk, and every shard's ids against the committed index). Returns the
    ids read."""
    behind = behind_message(ledger, job, folder)
    if behind:
        report("redis_behind", ".", behind)
    per_shard = Counter(shard for _, shard in ledger.iter_committed())
    return check_shards(ledger, folder, per_shard, report)[1]
