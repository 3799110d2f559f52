"""A job's shard folder in object storage (`--out s3://bucket/prefix`, `gs://`, `az://`):
the same operations the local folder offers, on a store with no rename and no append
(docs/design/tokenize.md, "Shards in object storage").

- A shard is uploaded whole from the writer's local temp file with a create-once put
  (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`, Azure `If-None-Match: *`): a name
  already taken raises ShardExists and the object stays as it was, as `link()` refuses an
  existing name on disk. A reader never sees part of a shard: an object appears whole or
  not at all (a multipart upload cut short leaves parts, never an object).
- The manifest is one small object per shard, `manifest/<shard name>.json`, put once
  after the shard; read back by listing that prefix. There is no file to append to.
- Reads stream: a shard is read in chunks of CHUNK_BYTES, so exports and verification
  keep flat memory however large a shard is.

obstore (Rust's object_store) does the talking: one API with conditional puts on S3,
GCS and Azure, credentials and endpoints the standard way (AWS_* variables with
AWS_ENDPOINT_URL for S3-compatible stores, a profile's keys, an instance role; AZURE_STORAGE_*
with AZURE_STORAGE_ENDPOINT; GOOGLE_APPLICATION_CREDENTIALS or a service-account file:
docs/operations.md lists them), and it streams. Credentials never appear in a URL regen takes or
prints.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import AlreadyExistsError
from obstore.store import from_url

# URL schemes obstore opens (s3a and abfs spellings included).
SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")
MANIFEST_PREFIX = "manifest/"
# Bytes fetched per step when streaming an object: small enough to keep memory flat,
# large enough that a 100 MB shard is a few hundred round trips of a single GET.
CHUNK_BYTES = 1 << 20


class BucketError(Exception):
    """The store cannot be reached or refused an operation; the message says which
    store and why, in one line, without credentials."""


class ObjectExists(FileExistsError):
    """An object of this name is already in the store: never replaced."""


def is_bucket_url(out: str) -> bool:
    """Whether `--out` names object storage rather than a local folder."""
    scheme = out.split("://", 1)[0].lower() if "://" in out else ""
    return scheme in SCHEMES


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.password:  # (abfs://container@account... names no user: allowed)
        raise BucketError(
            "an object storage URL takes no credentials: give them the standard way, in "
            "the environment (AWS_*, AZURE_STORAGE_*, GOOGLE_*: docs/operations.md), or a "
            "profile or an instance role"
        )
    if not parts.netloc:
        raise BucketError(f"{url}: no bucket named")
    if parts.query or parts.fragment:
        raise BucketError(f"{url}: an object storage URL takes no ?options")


class BucketFolder:
    """One folder (`URL/JOB`) of a store: shard objects and their manifest objects."""

    def __init__(self, url: str, store: Any | None = None) -> None:
        _check_url(url)
        self.url = url.rstrip("/")
        try:
            self._store = store if store is not None else from_url(self.url)
        except Exception as exc:  # obstore raises its own for a bad URL or config
            raise BucketError(f"{self.url}: {_one_line(exc)}") from None

    def __str__(self) -> str:
        return self.url

    def child(self, name: str) -> BucketFolder:
        """The folder `name` below this one (OUT -> OUT/JOB), on the same store."""
        return BucketFolder(f"{self.url}/{name}")

    # --- shards ---------------------------------------------------------------------

    def names(self, prefix: str = "") -> list[str]:
        """Object names directly in this folder (not in manifest/), sorted."""
        try:
            listed = obstore.list_with_delimiter(self._store)
        except Exception as exc:
            raise BucketError(f"listing {self.url}: {_one_line(exc)}") from None
        names = [meta["path"].rsplit("/", 1)[-1] for meta in listed["objects"]]
        return sorted(name for name in names if name.startswith(prefix))

    def children(self) -> list[str]:
        """The names of the folders directly below this one, sorted."""
        try:
            listed = obstore.list_with_delimiter(self._store)
        except Exception as exc:
            raise BucketError(f"listing {self.url}: {_one_line(exc)}") from None
        return sorted(prefix.rstrip("/").rsplit("/", 1)[-1] for prefix in listed["common_prefixes"])

    def size(self, name: str) -> int | None:
        """The object's size, None when there is none of that name."""
        try:
            return int(obstore.head(self._store, name)["size"])
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise BucketError(f"reading {self.url}/{name}: {_one_line(exc)}") from None

    def put_new(self, name: str, source: Path) -> None:
        """Upload `source` as `name` only when no object has that name (ObjectExists
        otherwise, the object unchanged)."""
        try:
            obstore.put(self._store, name, source, mode="create")
        except AlreadyExistsError:
            raise ObjectExists(f"{self.url}/{name} already exists") from None
        except Exception as exc:
            raise BucketError(f"writing {self.url}/{name}: {_one_line(exc)}") from None

    def open(self, name: str) -> io.BufferedReader:
        """The object's bytes as a stream, fetched CHUNK_BYTES at a time;
        FileNotFoundError when there is no such object."""
        try:
            result = obstore.get(self._store, name)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise BucketError(f"reading {self.url}/{name}: {_one_line(exc)}") from None
        chunks = (bytes(chunk) for chunk in result.stream(min_chunk_size=CHUNK_BYTES))
        return io.BufferedReader(_ChunkStream(chunks), buffer_size=CHUNK_BYTES)

    def delete(self, name: str) -> None:
        try:
            obstore.delete(self._store, name)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise BucketError(f"deleting {self.url}/{name}: {_one_line(exc)}") from None

    # --- the manifest: one object per shard -----------------------------------------

    def put_manifest_line(self, shard: str, line: bytes) -> None:
        """Record a shard's manifest line, once: a line already there was written from
        the same shard (by its writer or by recovery), so it is left as it is."""
        try:
            obstore.put(self._store, f"{MANIFEST_PREFIX}{shard}.json", line, mode="create")
        except AlreadyExistsError:
            return
        except Exception as exc:
            raise BucketError(
                f"writing {self.url}/{MANIFEST_PREFIX}{shard}.json: {_one_line(exc)}"
            ) from None

    def manifest_lines(self) -> Iterator[bytes]:
        """Every shard's manifest line, in shard name order."""
        try:
            batches = obstore.list(self._store, prefix=MANIFEST_PREFIX)
            paths = sorted(meta["path"] for batch in batches for meta in batch)
            for path in paths:
                yield bytes(obstore.get(self._store, path).bytes())
        except Exception as exc:
            raise BucketError(f"reading {self.url}/{MANIFEST_PREFIX}: {_one_line(exc)}") from None


class _ChunkStream(io.RawIOBase):
    """A raw stream over an iterator of byte chunks (an object being downloaded)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._chunk = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while self._pos == len(self._chunk):
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._chunk, self._pos = chunk, 0
        n = min(len(buffer), len(self._chunk) - self._pos)
        buffer[:n] = self._chunk[self._pos : self._pos + n]
        self._pos += n
        return n


def _one_line(exc: BaseException) -> str:
    """An obstore error's first line (its later lines repeat the request in full)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
