"""The shard files of a job, the one module that writes and reads them: naming, the shard
glob, temp-then-rename, rollover, the manifest, and record iteration.

The tokenize stage writes through it; `regen verify`, `regen shards`, the demo report
and recovery read through it, so a change of format is made here alone.

A shard is zstd-compressed JSON Lines written with orjson. It is streamed to a hidden
temporary name while open (memory stays flat however large it grows), fsynced, then
linked into place and the folder fsynced, so a reader never sees a partial shard. A name
already on disk is never replaced: the disk is the truth for committed shards, and a
Redis restored from an older copy can hand out a shard number again (ShardExists). Each
shard in place has a line in `manifest.jsonl` (rows, tokens, bytes, sha256, the ledger
epoch), appended and fsynced after the link; recovery re-derives a missing line from the
shard itself.
Shards are read with the one zstd reader (common/zstd_reader.py), so a shard cut short
raises TruncatedFrame rather than reading short.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Protocol, cast

import orjson
import zstandard

from regen.common import crashpoints, defaults
from regen.common.ledger.shard_names import SHARD_GLOB, SHARD_PREFIX
from regen.common.zstd_reader import open_zstd

log = logging.getLogger("regen.tokenize")

MANIFEST = "manifest.jsonl"
# A manifest line is ~250 bytes: a longer one is damage, and is skipped unread.
MAX_MANIFEST_LINE = 64 << 10
_SKIP_BLOCK = 1 << 16
_HASH_BLOCK = 1 << 20
TMP_SUFFIX = ".tmp"
REWRITE_SUFFIX = ".rewrite"
# What reading a damaged shard raises: a cut or corrupt zstd frame (zstandard.ZstdError,
# TruncatedFrame included), a line that is not JSON, or bytes that are not UTF-8.
READ_ERRORS = (zstandard.ZstdError, orjson.JSONDecodeError, UnicodeDecodeError)
# A record starts {"schema":...,"id":"..." (record.build_record): the id is found in a
# line's first bytes without parsing the rest (token ids, messages) of it.
_ID = re.compile(rb'"id":"([^"]*)"')
_ID_WITHIN = 256
# The same, with the job that follows the id ({"schema":"...","id":"...","job":"...").
_ID_AND_JOB = re.compile(rb'\{"schema":"[^"]*","id":"([^"]*)","job":"([^"]*)"')


class ShardSource(Protocol):
    """A shard in place somewhere other than a local path (job_folder.ShardRef): its
    name, and its compressed bytes as a stream."""

    @property
    def name(self) -> str: ...

    def open(self) -> IO[bytes]: ...


# What the readers below take: a shard file's path, or a shard in a bucket.
Source = Path | ShardSource


def _open(source: Source) -> IO[bytes]:
    return open(source, "rb") if isinstance(source, Path) else source.open()


def shard_paths(folder: Path) -> list[Path]:
    """The shards in place in a job folder, in order."""
    return sorted(folder.glob(SHARD_GLOB))


def is_job_folder(folder: Path) -> bool:
    return (folder / MANIFEST).exists() or any(folder.glob(SHARD_GLOB))


def temp_files(folder: Path) -> list[Path]:
    """Temporary files in a job folder: shards being written (`.*.tmp`) or rewritten
    (`.*.tmp.rewrite`), or left by a crash."""
    return sorted(folder.glob(f".*{TMP_SUFFIX}*"))


def tmp_path(folder: Path, name: str, owner: str) -> Path:
    """Hidden while written, and named after its writer so that a consumer starting up
    can tell a dead writer's leftovers from a live one's open shard."""
    return folder / f".{name}.{owner_token(owner)}{TMP_SUFFIX}"


def owner_token(owner: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in owner)


def leftover_owner(path: Path) -> str | None:
    """The writer token of a temporary shard file (or its rewrite staging file), None for
    any other file."""
    name = path.name.removesuffix(REWRITE_SUFFIX)
    if not (name.startswith(f".{SHARD_PREFIX}") and name.endswith(TMP_SUFFIX)):
        return None
    return name[: -len(TMP_SUFFIX)].rsplit(".", 1)[-1]


class UnwritableFolder(Exception):
    """The shard folder cannot be created or written; the message says why."""


def check_writable(folder: Path) -> None:
    """Create `folder` and write a file in it, or raise UnwritableFolder: a worker says
    so when it starts, not at its first shard."""
    probe = folder / f".write-test.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UnwritableFolder(f"cannot write shards to {folder}: {exc.strerror or exc}") from None


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ShardInfo:
    """One manifest line."""

    shard: str
    rows: int
    prompt_tokens: int
    completion_tokens: int
    uncompressed_bytes: int
    compressed_bytes: int
    sha256: str
    created: float
    # The job's ledger epoch (keys.job_epoch) when the shard was written; 0 in manifests
    # written before epochs existed.
    epoch: int = 0
    # Records with each quality flag (common/quality.py); empty in older manifests.
    flags: dict[str, int] = field(default_factory=dict)
    # Records by the SGLang version of the server that generated them (where known).
    server_versions: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))


_INFO_FIELDS = frozenset(f.name for f in fields(ShardInfo))


class OpenShard:
    """A shard being written: records stream through zstd into the temporary file."""

    def __init__(
        self, folder: Path, name: str, owner: str, path: Path | None = None, *, epoch: int = 0
    ) -> None:
        self.folder = folder
        self.name = name
        self.owner = owner
        self.epoch = epoch
        self.path = path or tmp_path(folder, name, owner)
        self.opened = time.monotonic()
        self.ids: set[str] = set()
        self.rows = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.uncompressed_bytes = 0
        self.flags: Counter[str] = Counter()
        self.server_versions: Counter[str] = Counter()
        self._file: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 (closed in finish/abort)
        self._hash = hashlib.sha256()
        # zstandard only calls write() and flush() on it; its stub asks for a whole IO[bytes].
        sink = cast(IO[bytes], _HashingWriter(self._file, self._hash))
        self._zstd = zstandard.ZstdCompressor(level=defaults.SHARD_ZSTD_LEVEL).stream_writer(
            sink, closefd=False
        )

    def add(self, record: dict[str, Any]) -> None:
        line = orjson.dumps(record) + b"\n"
        self._zstd.write(line)
        self.ids.add(record["id"])
        self.rows += 1
        self.prompt_tokens += int(record["prompt_tokens"])
        self.completion_tokens += int(record["completion_tokens"])
        self.uncompressed_bytes += len(line)
        self.flags.update(record.get("flags", ()))
        if record.get("server_version"):
            self.server_versions[record["server_version"]] += 1

    def age_s(self) -> float:
        return time.monotonic() - self.opened

    def close_durably(self) -> ShardInfo:
        """Finish the zstd frame and fsync the temporary file; it is not in place yet."""
        self._zstd.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        return ShardInfo(
            shard=self.name,
            rows=self.rows,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            uncompressed_bytes=self.uncompressed_bytes,
            compressed_bytes=size,
            sha256=self._hash.hexdigest(),
            created=time.time(),
            epoch=self.epoch,
            flags=dict(self.flags),
            server_versions=dict(self.server_versions),
        )

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)


class _HashingWriter:
    """File wrapper that hashes the compressed bytes as they are written."""

    def __init__(self, file: IO[bytes], digest: Any) -> None:
        self._file = file
        self._digest = digest

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()


def rewrite_without(shard: OpenShard, drop: set[str]) -> ShardInfo:
    """Rewrite a durably closed temporary shard without `drop` (ids another shard won).

    Rare: only when two consumers held the same id at once.
    """
    staging = shard.path.with_name(shard.path.name + REWRITE_SUFFIX)
    fresh = OpenShard(shard.folder, shard.name, shard.owner, path=staging, epoch=shard.epoch)
    for record in iter_records(shard.path):
        if record["id"] not in drop:
            fresh.add(record)
    info = fresh.close_durably()
    os.replace(staging, shard.path)
    shard.ids -= drop
    return info


class ShardExists(FileExistsError):
    """A shard name already taken on disk: shards in place are never replaced."""

    def __init__(self, path: Path) -> None:
        super().__init__(errno.EEXIST, "a shard of this name is already on disk", str(path))
        self.path = path


# What os.link raises on a filesystem without hard links.
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK)


def place(folder: Path, info: ShardInfo, owner: str) -> Path:
    """Move a durably closed shard into place and record it in the manifest; raises
    ShardExists, leaving everything as it was, when the name is taken."""
    final = folder / info.shard
    _link_new(tmp_path(folder, info.shard, owner), final)
    fsync_dir(folder)
    crashpoints.hit("tokenize.after_rename")
    append_manifest(folder, info)
    return final


def _link_new(tmp: Path, final: Path) -> None:
    """Give `tmp` the name `final` only when no file has it: link() refuses an existing
    name where rename() would replace it. A crash between the link and the unlink leaves
    the temp name too, which leftover cleanup removes."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise ShardExists(final) from None
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        # No hard links here: check, then rename. Only a second writer given the same
        # name at the same instant could slip between the two.
        if final.exists():
            raise ShardExists(final) from None
        os.replace(tmp, final)
        return
    os.unlink(tmp)


def append_manifest(folder: Path, info: ShardInfo) -> None:
    """Append a shard's line and fsync; a torn last line (a crash mid-append) is cut
    off first, so the manifest heals at its next append (docs/design/tokenize.md, Tokenize)."""
    with open(folder / MANIFEST, "a+b") as fh:
        # Appenders of one folder one at a time: a repair must never cut the line
        # another consumer is writing (the lock goes with the file's close).
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        fresh = _repair_tail(folder, fh)
        fh.write((b"" if fresh else b"\n") + info.to_json() + b"\n")
        fh.flush()
        os.fsync(fh.fileno())


def _repair_tail(folder: Path, fh: IO[bytes]) -> bool:
    """Cut a torn last line off; whether the file now ends on a fresh line. A last line
    that is complete but lacks its newline, or is damage this writer did not leave (over
    the line cap), is kept: the next line then starts on a fresh line after it."""
    size = fh.seek(0, os.SEEK_END)
    start = max(0, size - MAX_MANIFEST_LINE - 1)
    fh.seek(start)
    tail = fh.read(size - start)
    if not tail or tail.endswith(b"\n"):
        return True
    cut = tail.rfind(b"\n")
    if cut < 0 and start > 0:
        return False
    if not _is_torn(tail[cut + 1 :]):
        return False
    fh.truncate(start + cut + 1)
    log.warning("%s: cut off a torn last line (a crash mid-append)", folder / MANIFEST)
    return True


_ROW_START = b'{"shard":"'


def _is_torn(line: bytes) -> bool:
    """A line a crash mid-append left: not a manifest line, but a start of one (written
    up to the crash), or zero bytes (a filesystem that grew the file before its data)."""
    body = line.rstrip(b"\n").rstrip(b"\0")
    if _parse_line(line) is not None:
        return False
    return not body or body.startswith(_ROW_START) or _ROW_START.startswith(body)


def _parse_line(line: bytes) -> ShardInfo | None:
    """The shard info a manifest line holds (fields a newer regen added ignored)."""
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(row, dict):
        return None
    try:
        return ShardInfo(**{k: v for k, v in row.items() if k in _INFO_FIELDS})
    except TypeError:  # a field missing
        return None


@dataclass(frozen=True)
class Manifest:
    shards: dict[str, ShardInfo]  # by shard name; a later line for a shard wins
    # Lines that are no manifest line: (line number, why). Damage: verify reports it.
    bad: list[tuple[int, str]] = field(default_factory=list)
    # Numbers of the lines a crash mid-append tore (_is_torn): ignored, with a warning;
    # a torn last line is cut off at the next append.
    torn: list[int] = field(default_factory=list)


def read_manifest(folder: Path) -> Manifest:
    """The manifest of a job folder (empty when it has none). A line over
    MAX_MANIFEST_LINE bytes is skipped in bounded reads, never held whole."""
    path = folder / MANIFEST
    if not path.exists():
        return Manifest({})
    with open(path, "rb") as fh:
        return parse_manifest_lines(_capped_lines(fh))


def parse_manifest_lines(lines: Iterable[bytes | None]) -> Manifest:
    """A manifest from its lines (None: a line over MAX_MANIFEST_LINE, skipped unread): a
    local manifest.jsonl's, or a bucket's manifest objects' (job_folder.py)."""
    manifest = Manifest({})
    for number, line in enumerate(lines, start=1):
        if line is None:
            manifest.bad.append((number, f"line {number} is over {MAX_MANIFEST_LINE:,} "
                                         "bytes: no manifest line; skipped"))  # fmt: skip
            continue
        if not line.strip():
            continue
        info = _parse_line(line)
        if info is not None:
            manifest.shards[info.shard] = info
        elif _is_torn(line):
            manifest.torn.append(number)
        else:
            manifest.bad.append((number, f"line {number} is no manifest line"))
    return manifest


def _capped_lines(fh: IO[bytes]) -> Iterator[bytes | None]:
    """The file's lines, None for one over MAX_MANIFEST_LINE (read past in blocks)."""
    while line := fh.readline(MAX_MANIFEST_LINE + 1):
        if len(line) <= MAX_MANIFEST_LINE or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = fh.readline(_SKIP_BLOCK)
        yield None


def iter_records(path: Source) -> Iterator[dict[str, Any]]:
    """Stream the records of a shard (for verify, stats, export and rare rewrites); raises
    one of READ_ERRORS where the shard is damaged or cut short."""
    with open_zstd(_open(path)) as lines:
        for line in lines:
            if line != b"\n":
                yield orjson.loads(line)


def iter_ids(path: Source) -> Iterator[str]:
    """The id of every record in a shard, in order, without parsing whole records;
    raises as iter_records does (KeyError: a record without an id)."""
    with open_zstd(_open(path)) as lines:
        for line in lines:
            if not line.strip():
                continue
            found = _ID.search(line, 0, _ID_WITHIN)
            yield found.group(1).decode() if found else str(orjson.loads(line)["id"])


def iter_job_ids(path: Source) -> Iterator[tuple[str, str] | None]:
    """(job, id) of every record in a shard, row for row as iter_records yields them,
    without parsing whole records; None for a line that names neither (verify reports
    it). Raises one of READ_ERRORS where the shard is damaged or cut short."""
    with open_zstd(_open(path)) as lines:
        for line in lines:
            if line == b"\n":
                continue
            found = _ID_AND_JOB.match(line, 0, _ID_WITHIN)
            if found and b"\\" not in found.group(0):
                yield found.group(2).decode(), found.group(1).decode()
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                yield None
                continue
            rid = record.get("id") if isinstance(record, dict) else None
            job = record.get("job") if isinstance(record, dict) else None
            yield (job, rid) if isinstance(rid, str) and isinstance(job, str) else None


def describe(path: Source, epoch: int) -> ShardInfo:
    """A manifest line rebuilt from a shard in place (recovery after a crash mid-append);
    `epoch`: the ledger epoch to record, which the file itself does not hold. Streamed:
    the records once, the compressed bytes once for their hash and size."""
    rows = prompt_tokens = completion_tokens = uncompressed = 0
    flags: Counter[str] = Counter()
    versions: Counter[str] = Counter()
    for record in iter_records(path):
        rows += 1
        prompt_tokens += int(record["prompt_tokens"])
        completion_tokens += int(record["completion_tokens"])
        uncompressed += len(orjson.dumps(record)) + 1
        flags.update(record.get("flags", ()))
        if record.get("server_version"):
            versions[record["server_version"]] += 1
    digest = hashlib.sha256()
    size = 0
    with _open(path) as fh:
        while block := fh.read(_HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return ShardInfo(
        shard=path.name,
        rows=rows,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        uncompressed_bytes=uncompressed,
        compressed_bytes=size,
        sha256=digest.hexdigest(),
        created=path.stat().st_mtime if isinstance(path, Path) else time.time(),
        epoch=epoch,
        flags=dict(flags),
        server_versions=dict(versions),
    )
