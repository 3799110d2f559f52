"""Read prompt dataset files into raw rows: streaming, one file at a time.

Formats, chosen by suffix (case-insensitive):

- ``.jsonl`` / ``.ndjson``: JSON Lines, streamed line by line.
- ``.json``: one JSON array of rows, or an object whose only list-valued field holds the
  rows (``{"version": 1, "data": [...]}``). The document is loaded whole (JSON has no
  row boundaries to stream on); use JSON Lines for big data. Many ``.json`` files on the
  Hugging Face Hub are JSON Lines in fact: those are detected and streamed as such.
- any of the above plus ``.gz`` or ``.zst``/``.zstd``: decompressed while streaming.
- ``.parquet``: read in record batches; nested columns come out as lists and dicts.

A bad line never stops a file: it comes out as a row carrying a ``RowError``. A file that
breaks midway (truncated or corrupt compression, a damaged Parquet page) yields one
``corrupt_file`` row where it broke, then ends. A missing file or an unknown suffix
raises, since no row of it can be read.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from regen.common.zstd_reader import open_zstd
from regen.producer.rows import Reason

_BOM = b"\xef\xbb\xbf"
# Parquet rows converted to Python objects at a time.
_PARQUET_BATCH_ROWS = 1024
# What a damaged file raises while it is read: gzip raises EOFError when truncated,
# BadGzipFile (an OSError) on a bad header and zlib.error on bad data; pyarrow raises
# ArrowException subclasses on a damaged Parquet file.
_BROKEN = (OSError, EOFError, zlib.error, zstandard.ZstdError, pa.ArrowException)


@dataclass(frozen=True)
class RowError:
    """Why a row could not be read: a `Reason` code and a specific message."""

    reason: str
    message: str


@dataclass(frozen=True)
class RawRow:
    """One row of a dataset file, decoded from JSON (or Parquet) but not yet interpreted.

    `row` is 1-based in every format: the line number in JSON Lines files (blank lines
    count, so it matches an editor's), the position in a JSON array or Parquet file.
    Row 0 means the file as a whole (a `.json` file that does not parse, a Parquet file
    that cannot be opened). Because of that, ``iter_rows(path, start_row=row.row)``
    resumes right after `row`.

    Exactly one of `value` (any JSON value) and `error` is meaningful: `error` is None for
    a good row.
    """

    source: str
    row: int
    value: object = None
    error: RowError | None = None


def iter_rows(path: str | os.PathLike[str], start_row: int = 0) -> Iterator[RawRow]:
    """Yield the rows of one dataset file in order, skipping its first `start_row` rows.

    Skipped JSON Lines are split off the (decompressed) stream but never parsed, and
    skipped Parquet row groups are never read. Raises ValueError for an unsupported
    suffix and FileNotFoundError for a missing file, eagerly, before the first row.
    """
    if start_row < 0:
        raise ValueError(f"start_row must be >= 0, got {start_row}")
    path = Path(path)
    source = os.fspath(path)
    name = path.name.lower()
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {source}")
    if name.endswith(".parquet"):
        return _parquet_rows(source, path, start_row)
    for suffix, opener in _OPENERS.items():
        if not name.endswith(suffix):  # "" matches every name, so it goes last
            continue
        base = name[: len(name) - len(suffix)]
        if base.endswith((".jsonl", ".ndjson")):
            return _json_lines_rows(source, path, opener, start_row)
        if base.endswith(".json"):
            return _json_rows(source, path, opener, start_row)
    raise ValueError(
        f"unsupported dataset file {source!r}: expected one of {', '.join(SUPPORTED_SUFFIXES)}"
    )


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """A 16-hex-char key for a file's resume cursor: absolute path, size and mtime.

    A file rewritten in place gets a new fingerprint, so a stale cursor is never applied
    to different content.
    """
    resolved = Path(path).resolve()
    st = resolved.stat()
    key = f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return hashlib.blake2b(key, digest_size=8).hexdigest()


def _open_plain(path: Path) -> io.BufferedIOBase:
    return open(path, "rb")


def _open_gzip(path: Path) -> io.BufferedIOBase:
    return gzip.open(path, "rb")


# Compression suffix -> opener of the decompressed byte stream.
_OPENERS: dict[str, Callable[[Path], io.BufferedIOBase]] = {
    ".gz": _open_gzip,
    ".zst": open_zstd,  # raises ZstdError at a cut frame, which _BROKEN reports
    ".zstd": open_zstd,
    "": _open_plain,
}
SUPPORTED_SUFFIXES = (
    *(c + z for z in sorted(_OPENERS) for c in (".jsonl", ".ndjson", ".json")),
    ".parquet",
)


def _json_lines_rows(
    source: str, path: Path, opener: Callable[[Path], io.BufferedIOBase], start_row: int
) -> Iterator[RawRow]:
    lineno = 0
    with opener(path) as stream:
        try:
            for lineno, line in enumerate(stream, 1):
                if lineno <= start_row or not line.strip():
                    continue
                yield _parse_line(source, lineno, line.removeprefix(_BOM) if lineno == 1 else line)
        except _BROKEN as exc:
            yield _broken(source, lineno + 1, exc)


def _parse_line(source: str, lineno: int, line: bytes) -> RawRow:
    try:
        return RawRow(source, lineno, value=orjson.loads(line))
    except orjson.JSONDecodeError as exc:
        return RawRow(source, lineno, error=_decode_error(line, exc))


def _decode_error(data: bytes, exc: orjson.JSONDecodeError) -> RowError:
    # orjson reports bad UTF-8 as a JSON error; tell it apart only on this slow path.
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as ude:
        return RowError(Reason.UNDECODABLE, f"not valid UTF-8: {ude}")
    return RowError(Reason.INVALID_JSON, str(exc))


def _broken(source: str, row: int, exc: BaseException) -> RawRow:
    message = f"file is damaged or truncated at row {row}: {type(exc).__name__}: {exc}"
    return RawRow(source, row, error=RowError(Reason.CORRUPT_FILE, message))


def _json_rows(
    source: str, path: Path, opener: Callable[[Path], io.BufferedIOBase], start_row: int
) -> Iterator[RawRow]:
    with opener(path) as stream:
        try:
            json_lines = _looks_like_json_lines(stream)
        except _BROKEN:
            json_lines = False  # reading the document below reports the damage
    if json_lines:
        yield from _json_lines_rows(source, path, opener, start_row)
        return
    with opener(path) as stream:
        try:
            data = stream.read().removeprefix(_BOM)
        except _BROKEN as exc:
            yield _broken(source, 0, exc)
            return
    if not data.strip():
        return  # an empty file has no rows, as an empty JSON Lines file has none
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        yield RawRow(source, 0, error=_decode_error(data, exc))
        return
    rows = _unwrap(doc)
    if rows is None:
        message = (
            f"top-level JSON value is {type(doc).__name__}; expected an array of rows "
            "or an object with exactly one list-valued field"
        )
        yield RawRow(source, 0, error=RowError(Reason.WRONG_TYPE, message))
        return
    for index in range(start_row, len(rows)):
        yield RawRow(source, index + 1, value=rows[index])


def _looks_like_json_lines(stream: io.BufferedIOBase) -> bool:
    """True when the first non-blank line is a whole JSON value and more content follows.

    A single JSON document can never look like that (nothing may follow its value), and
    JSON Lines with two rows or more always does.
    """
    lines = (line for line in stream if line.strip())
    first = next(lines, None)
    # A JSON Lines row that is an array would be rejected anyway, and this spares parsing
    # a minified array twice.
    if first is None or first.removeprefix(_BOM).lstrip().startswith(b"["):
        return False
    try:
        orjson.loads(first.removeprefix(_BOM))
    except orjson.JSONDecodeError:
        return False
    return next(lines, None) is not None


def _unwrap(doc: object) -> list[object] | None:
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict):
        lists = [value for value in doc.values() if isinstance(value, list)]
        if len(lists) == 1:
            return lists[0]
    return None


def _parquet_rows(source: str, path: Path, start_row: int) -> Iterator[RawRow]:
    row = 0  # rows passed so far, skipped or yielded
    try:
        with pq.ParquetFile(path) as pf:
            meta = pf.metadata
            group = 0
            # Whole row groups before the cursor are never read.
            while group < meta.num_row_groups and row + meta.row_group(group).num_rows <= start_row:
                row += meta.row_group(group).num_rows
                group += 1
            batches = pf.iter_batches(
                batch_size=_PARQUET_BATCH_ROWS, row_groups=list(range(group, meta.num_row_groups))
            )
            for batch in batches:
                if row < start_row:
                    skip = min(start_row - row, batch.num_rows)
                    batch, row = batch.slice(skip), row + skip
                for value in batch.to_pylist():
                    row += 1
                    yield RawRow(source, row, value=value)
    except _BROKEN as exc:
        # Row 0 (the whole file) when it broke before any row was reached.
        yield _broken(source, row + 1 if row else 0, exc)
