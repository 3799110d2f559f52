"""Where a job's shards are placed and read: `OUT/JOB` on local disk, or in a bucket when
`--out` is an object storage URL (docs/design/tokenize.md, "Shards in object storage").

One commit path, two backends: the tokenize writer, recovery and every reader go through
a JobFolder, and only its two classes know which kind of store is under it. The local one
is the protocol of docs/design/exactly-once.md, "Exactly-once commits" (link, fsync, appended
manifest); the bucket one puts each shard and each manifest line once, as an object.
A writer's temp files are always on local disk (`spool`): in the folder itself when it is
local, in a spool folder on the tokenize host when it is a bucket.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import orjson

from regen.common import crashpoints, provenance
from regen.common.bucket_folder import BucketError, BucketFolder, ObjectExists, is_bucket_url
from regen.common.ledger.shard_names import shard_number
from regen.consumers.tokenize import shard_files
from regen.consumers.tokenize.shard_files import (
    MAX_MANIFEST_LINE,
    Manifest,
    ShardExists,
    ShardInfo,
    UnwritableFolder,
    parse_manifest_lines,
    tmp_path,
)


class JobFolder(Protocol):
    """A job's shards and manifest, wherever they are kept."""

    # The local folder of the writers' temp files.
    spool: Path
    # The `--out` it is under (a local folder, or a bucket URL), for messages.
    out: str

    def __str__(self) -> str: ...

    @property
    def name(self) -> str:
        """The job's name: the folder's last part."""
        ...

    def readable_here(self) -> bool:
        """Whether this host can read the folder (a local one may be on another host)."""
        ...

    def is_job(self) -> bool:
        """Whether it holds a job's output (a shard or a manifest)."""
        ...

    def leftovers(self) -> list[str]:
        """Temp files in the folder itself (a local one: shards being written, or left by
        a crash); a bucket has none, its writers' temp files being on their hosts."""
        ...

    def shard_names(self) -> list[str]:
        """The shards in place, in order."""
        ...

    def shards(self) -> list[ShardRef]:
        """The shards in place, in order, to read."""
        ...

    def has(self, name: str) -> bool: ...

    def size(self, name: str) -> int:
        """A shard's compressed size (FileNotFoundError when there is none)."""
        ...

    def open(self, name: str) -> IO[bytes]:
        """A shard's compressed bytes as a stream (FileNotFoundError when none)."""
        ...

    def place(self, info: ShardInfo, owner: str) -> None:
        """Put the writer's durably closed temp file in place under `info.shard` and
        record its manifest line; ShardExists, with nothing changed, when the name is
        taken."""
        ...

    def manifest(self) -> Manifest: ...

    def add_manifest(self, info: ShardInfo) -> None:
        """Record a shard's line (recovery, after a crash between place and manifest)."""
        ...

    def write_provenance(self, made_by: dict[str, Any]) -> None: ...

    def read_provenance(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True)
class ShardRef:
    """One shard in place in a JobFolder: what readers open (shard_files.ShardSource)."""

    folder: JobFolder
    name: str

    def open(self) -> IO[bytes]:
        return self.folder.open(self.name)

    def size(self) -> int:
        return self.folder.size(self.name)

    def __str__(self) -> str:
        return f"{self.folder}/{self.name}"


class LocalFolder:
    """`OUT/JOB` on a filesystem: the link-and-append protocol of shard_files.py."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.spool = path
        self.out = str(path.parent)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    def readable_here(self) -> bool:
        return self.path.is_dir()

    def is_job(self) -> bool:
        return shard_files.is_job_folder(self.path)

    def leftovers(self) -> list[str]:
        return [path.name for path in shard_files.temp_files(self.path)]

    def shard_names(self) -> list[str]:
        return [path.name for path in shard_files.shard_paths(self.path)]

    def shards(self) -> list[ShardRef]:
        return [ShardRef(self, name) for name in self.shard_names()]

    def has(self, name: str) -> bool:
        return (self.path / name).exists()

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def open(self, name: str) -> IO[bytes]:
        return open(self.path / name, "rb")

    def place(self, info: ShardInfo, owner: str) -> None:
        shard_files.place(self.path, info, owner)

    def manifest(self) -> Manifest:
        return shard_files.read_manifest(self.path)

    def add_manifest(self, info: ShardInfo) -> None:
        shard_files.append_manifest(self.path, info)

    def write_provenance(self, made_by: dict[str, Any]) -> None:
        provenance.write_file(self.path, made_by)

    def read_provenance(self) -> dict[str, Any] | None:
        return provenance.read_file(self.path)


class BucketJobFolder:
    """`OUT/JOB` in a bucket: each shard and each manifest line put once, as objects."""

    def __init__(self, bucket: BucketFolder, spool: Path) -> None:
        self.bucket = bucket
        self.spool = spool
        self.out = bucket.url.rsplit("/", 1)[0]

    def __str__(self) -> str:
        return str(self.bucket)

    @property
    def name(self) -> str:
        return self.bucket.url.rsplit("/", 1)[1]

    def readable_here(self) -> bool:
        return True  # a store is reached from any host; a listing says if it is not

    def is_job(self) -> bool:
        return bool(self.shard_names()) or "manifest" in self.bucket.children()

    def leftovers(self) -> list[str]:
        return []

    def shard_names(self) -> list[str]:
        return [name for name in self.bucket.names() if shard_number(name) is not None]

    def shards(self) -> list[ShardRef]:
        return [ShardRef(self, name) for name in self.shard_names()]

    def has(self, name: str) -> bool:
        return self.bucket.size(name) is not None

    def size(self, name: str) -> int:
        size = self.bucket.size(name)
        if size is None:
            raise FileNotFoundError(f"{self.bucket}/{name}")
        return size

    def open(self, name: str) -> IO[bytes]:
        return self.bucket.open(name)

    def place(self, info: ShardInfo, owner: str) -> None:
        temp = tmp_path(self.spool, info.shard, owner)
        try:
            self.bucket.put_new(info.shard, temp)
        except ObjectExists:
            raise ShardExists(Path(str(self.bucket)) / info.shard) from None
        # Same point as on disk: the shard in place, its manifest line not yet written.
        crashpoints.hit("tokenize.after_rename")
        self.add_manifest(info)
        temp.unlink(missing_ok=True)

    def manifest(self) -> Manifest:
        lines = self.bucket.manifest_lines()
        return parse_manifest_lines(
            line if len(line) <= MAX_MANIFEST_LINE else None for line in lines
        )

    def add_manifest(self, info: ShardInfo) -> None:
        self.bucket.put_manifest_line(info.shard, info.to_json())

    def write_provenance(self, made_by: dict[str, Any]) -> None:
        self.spool.mkdir(parents=True, exist_ok=True)
        staging = self.spool / f".{provenance.PROVENANCE_FILE}.upload"
        staging.write_bytes(orjson.dumps(made_by, option=orjson.OPT_INDENT_2))
        try:
            self.bucket.put_new(provenance.PROVENANCE_FILE, staging)
        except ObjectExists:
            pass  # written once, by the job's first writer
        finally:
            staging.unlink(missing_ok=True)

    def read_provenance(self) -> dict[str, Any] | None:
        try:
            with self.bucket.open(provenance.PROVENANCE_FILE) as fh:
                return dict(orjson.loads(fh.read()))
        except FileNotFoundError:
            return None


def local_root(out: str | Path) -> Path:
    """Where a tokenize worker's files for `--out` are on local disk: the folder itself,
    or for a bucket its spool, REGEN_SPOOL_DIR (default `~/.cache/regen/spool`) then the
    bucket URL's host and path. Its free space is what the worker checks."""
    if not is_bucket(out):
        return Path(out)
    default = Path.home() / ".cache" / "regen" / "spool"
    root = Path(os.environ.get("REGEN_SPOOL_DIR") or default)
    return root / str(out).split("://", 1)[1].strip("/").replace("/", "_")


def is_bucket(out: str | Path) -> bool:
    """Whether `--out` is an object storage URL (a Path never is: pathlib folds `//`)."""
    return isinstance(out, str) and is_bucket_url(out)


def job_folder(out: str | Path, job: str) -> JobFolder:
    """The folder of `job` under `--out`: a bucket's when `out` is an object storage URL,
    else the local `OUT/JOB`."""
    if is_bucket(out):
        return BucketJobFolder(BucketFolder(str(out)).child(job), local_root(out) / job)
    return LocalFolder(Path(out) / job)


def folder_at(where: str | Path) -> JobFolder:
    """The job folder at `where` itself (OUT/JOB): a local path, or a bucket URL."""
    if is_bucket(where):
        url = str(where).rstrip("/")
        parent, _, job = url.rpartition("/")
        if is_bucket(parent) and parent.split("://", 1)[1]:
            return job_folder(parent, job)  # the spool a writer of this job uses
        return BucketJobFolder(BucketFolder(url), local_root(url))  # a bucket's root
    return LocalFolder(Path(where))


def as_folder(where: JobFolder | str | Path) -> JobFolder:
    """`where` as a JobFolder: itself when it is one, else the folder at that path or URL
    (for the operator commands' entry points, which take either)."""
    return folder_at(where) if isinstance(where, str | Path) else where


def job_folders(where: str | Path) -> list[JobFolder]:
    """The job folders at `where` (a path or a bucket URL): itself when it is one, else
    the folders directly below it that are."""
    folder = folder_at(where)
    if folder.is_job():
        return [folder]
    if isinstance(folder, LocalFolder):
        below = sorted(p for p in folder.path.iterdir() if p.is_dir())
        candidates: list[JobFolder] = [LocalFolder(path) for path in below]
    else:
        url = str(where).rstrip("/")
        candidates = [folder_at(f"{url}/{name}") for name in BucketFolder(url).children()]
    return [candidate for candidate in candidates if candidate.is_job()]


def check_writable(out: str | Path) -> None:
    """Raise UnwritableFolder, in one line, when shards cannot be written under `out`: its
    local folder (or spool) cannot be created or written, or the bucket refuses a probe
    object (put once, then deleted). A worker says so when it starts."""
    shard_files.check_writable(local_root(out))
    if is_bucket(out):
        bucket = BucketFolder(str(out))
        probe = local_root(out) / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        name = f".write-test.{os.uname().nodename}.{os.getpid()}"
        try:
            bucket.put_new(name, probe)
            bucket.delete(name)
        except (BucketError, ObjectExists) as exc:
            raise UnwritableFolder(f"cannot write shards to {out}: {exc}") from None
        finally:
            probe.unlink(missing_ok=True)
