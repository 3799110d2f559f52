"""producer.readers: every format from real files, bad lines, damaged files, resuming."""

from __future__ import annotations

import gzip
import os
import tracemalloc
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from regen.producer.readers import RawRow, file_fingerprint, iter_rows
from regen.producer.rows import Reason

ROWS = [
    {"id": 1, "messages": [{"role": "user", "content": "hi"}]},
    {"id": 2, "prompt": "what is 2+2?"},
    {"id": 3, "conversations": [{"from": "human", "value": "hello"}]},
]


def jsonl_bytes(rows: list[object]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def values(rows: list[RawRow]) -> list[object]:
    assert [row.error for row in rows] == [None] * len(rows)
    return [row.value for row in rows]


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("name", "compress"),
    [
        ("d.jsonl", lambda b: b),
        ("d.ndjson", lambda b: b),
        ("d.jsonl.gz", gzip.compress),
        ("d.jsonl.zst", zstandard.ZstdCompressor().compress),
        ("d.JSONL.ZSTD", zstandard.ZstdCompressor().compress),
    ],
)
def test_json_lines_family(tmp_path: Path, name: str, compress) -> None:
    path = write(tmp_path / name, compress(jsonl_bytes(ROWS)))
    rows = list(iter_rows(path))
    assert values(rows) == ROWS
    assert [row.row for row in rows] == [1, 2, 3]
    assert {row.source for row in rows} == {str(path)}


def test_zst_with_several_frames(tmp_path: Path) -> None:
    # zstd CLI appends a frame per `zstd file >> out`; both must be read.
    cctx = zstandard.ZstdCompressor()
    data = cctx.compress(jsonl_bytes(ROWS[:2])) + cctx.compress(jsonl_bytes(ROWS[2:]))
    assert values(list(iter_rows(write(tmp_path / "d.jsonl.zst", data)))) == ROWS


def test_zst_written_by_stream_writer_without_content_size(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl.zst"
    with path.open("wb") as fh, zstandard.ZstdCompressor().stream_writer(fh) as writer:
        for _ in range(2000):  # a few MB decompressed, many reads
            writer.write(jsonl_bytes(ROWS))
    rows = list(iter_rows(path))
    assert len(rows) == 6000
    assert values(rows[-3:]) == ROWS


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst"])
def test_json_lines_memory_stays_flat(tmp_path: Path, name: str) -> None:
    # ~24 MB of rows, highly compressible, read through: memory must not follow file size.
    rows = [{"prompt": "the same question, asked again " * 20, "n": i} for i in range(35_000)]
    data = jsonl_bytes(rows)
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path = write(tmp_path / name, data)
    del rows, data
    tracemalloc.start()
    try:
        count = sum(1 for _ in iter_rows(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 35_000
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_json_array_and_wrapper_object(tmp_path: Path) -> None:
    array = write(tmp_path / "a.json", orjson.dumps(ROWS, option=orjson.OPT_INDENT_2))
    wrapped = write(tmp_path / "w.json", orjson.dumps({"version": 1, "data": ROWS}))
    for path in (array, wrapped):
        rows = list(iter_rows(path))
        assert values(rows) == ROWS
        assert [row.row for row in rows] == [1, 2, 3]


def test_json_file_holding_json_lines_is_streamed_as_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "hub.json", jsonl_bytes(ROWS))
    rows = list(iter_rows(path))
    assert values(rows) == ROWS
    assert [row.row for row in rows] == [1, 2, 3]


def test_json_gz_array(tmp_path: Path) -> None:
    path = write(tmp_path / "a.json.gz", gzip.compress(orjson.dumps(ROWS)))
    assert values(list(iter_rows(path))) == ROWS


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b'[{"a": 1}, {"a": ', Reason.INVALID_JSON),
        (b'"just a string"', Reason.WRONG_TYPE),
        (b'{"a": [1], "b": [2]}', Reason.WRONG_TYPE),
    ],
)
def test_json_document_errors_are_one_file_level_row(
    tmp_path: Path, data: bytes, reason: str
) -> None:
    rows = list(iter_rows(write(tmp_path / "bad.json", data)))
    assert len(rows) == 1
    assert rows[0].row == 0
    assert rows[0].error is not None
    assert rows[0].error.reason == reason


def test_parquet_with_nested_messages(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    table = pa.table(
        {
            "id": ["a", "b", "c", "d", "e"],
            "messages": [
                [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
                for i in range(5)
            ],
        }
    )
    pq.write_table(table, path, row_group_size=2)  # several row groups to stream over
    rows = list(iter_rows(path))
    assert [row.row for row in rows] == [1, 2, 3, 4, 5]
    first = values(rows)[0]
    assert first == {
        "id": "a",
        "messages": [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}],
    }
    assert isinstance(first["messages"], list)


@pytest.mark.parametrize("start", [0, 1, 2, 3, 4, 5, 9])
def test_parquet_start_row_across_row_groups(tmp_path: Path, start: int) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"n": list(range(5))}), path, row_group_size=2)
    rows = list(iter_rows(path, start_row=start))
    assert [row.row for row in rows] == list(range(start + 1, 6))
    assert [row.value["n"] for row in rows] == list(range(start, 5))


def test_bad_lines_are_error_rows_and_good_rows_still_come(tmp_path: Path) -> None:
    data = b"".join(
        [
            b'{"prompt": "one"}\n',
            b"\n",  # blank: skipped silently, still counted
            b"   \n",
            b'{"prompt": "broken\n',
            b'{"prompt": "caf\xe9"}\n',  # Latin-1, not UTF-8
            b'{"prompt": "two"}',  # no final newline
        ]
    )
    rows = list(iter_rows(write(tmp_path / "d.jsonl", data)))
    assert [(row.row, row.error.reason if row.error else None) for row in rows] == [
        (1, None),
        (4, Reason.INVALID_JSON),
        (5, Reason.UNDECODABLE),
        (6, None),
    ]
    assert rows[-1].value == {"prompt": "two"}
    assert rows[1].error is not None and rows[1].error.message  # orjson's own words


def test_utf8_bom_is_ignored(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", b"\xef\xbb\xbf" + jsonl_bytes(ROWS))
    assert values(list(iter_rows(path))) == ROWS


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "d.json"])
def test_start_row_resumes_right_after_a_row(tmp_path: Path, name: str) -> None:
    data = jsonl_bytes([{"n": i} for i in range(10)])
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path = write(tmp_path / name, data)
    everything = list(iter_rows(path))
    cursor = everything[3].row
    assert list(iter_rows(path, start_row=cursor)) == everything[4:]
    assert list(iter_rows(path, start_row=100)) == []


def test_skipped_lines_are_not_parsed(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", b"not json\n{broken\n" + jsonl_bytes(ROWS))
    assert values(list(iter_rows(path, start_row=2))) == ROWS


def test_truncated_zst_yields_corrupt_file_after_the_good_rows(tmp_path: Path) -> None:
    # Random text compresses badly, so the cut falls many zstd blocks into the frame.
    rows = [{"n": i, "noise": os.urandom(32).hex()} for i in range(20_000)]
    data = zstandard.ZstdCompressor().compress(jsonl_bytes(rows))
    path = write(tmp_path / "d.jsonl.zst", data[: len(data) * 2 // 3])
    *good, last = iter_rows(path)
    assert len(good) > 1000, "rows before the cut still come through"
    assert values(good) == rows[: len(good)]
    assert last.error is not None
    assert last.error.reason == Reason.CORRUPT_FILE
    assert last.row > good[-1].row


def test_garbage_zst_and_truncated_gz_are_corrupt_file(tmp_path: Path) -> None:
    garbage = write(tmp_path / "g.jsonl.zst", b"this is not zstd at all")
    gz = gzip.compress(jsonl_bytes([{"n": i} for i in range(5000)]))
    truncated = write(tmp_path / "t.jsonl.gz", gz[: len(gz) // 2])
    for path in (garbage, truncated):
        last = list(iter_rows(path))[-1]
        assert last.error is not None
        assert last.error.reason == Reason.CORRUPT_FILE


def test_corrupt_parquet_is_a_file_level_error(tmp_path: Path) -> None:
    rows = list(iter_rows(write(tmp_path / "d.parquet", b"PAR1 not really parquet")))
    assert len(rows) == 1
    assert rows[0].row == 0
    assert rows[0].error is not None and rows[0].error.reason == Reason.CORRUPT_FILE


def test_empty_files_give_no_rows(tmp_path: Path) -> None:
    for name in ("e.jsonl", "e.json"):
        assert list(iter_rows(write(tmp_path / name, b""))) == []
    assert list(iter_rows(write(tmp_path / "e.jsonl.zst", b""))) == []


def test_unknown_suffix_and_missing_file_raise_eagerly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.jsonl\.zst"):
        iter_rows(write(tmp_path / "d.csv", b"a,b\n"))
    with pytest.raises(FileNotFoundError):
        iter_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="start_row"):
        iter_rows(write(tmp_path / "d.jsonl", b""), start_row=-1)


def test_file_fingerprint_changes_with_content_not_with_spelling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "d.jsonl", jsonl_bytes(ROWS))
    fingerprint = file_fingerprint(path)
    assert len(fingerprint) == 16
    int(fingerprint, 16)
    monkeypatch.chdir(tmp_path)
    assert file_fingerprint("d.jsonl") == fingerprint  # relative or absolute, same file
    write(path, jsonl_bytes(ROWS[:2]))
    assert file_fingerprint(path) != fingerprint
