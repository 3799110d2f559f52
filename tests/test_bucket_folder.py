"""A job folder in object storage, against a real S3 HTTP API (moto's server): create-once
puts, listings, streamed reads and the manifest as objects (common/bucket_folder.py)."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from regen.common.bucket_folder import (
    CHUNK_BYTES,
    BucketError,
    BucketFolder,
    ObjectExists,
    is_bucket_url,
)
from tests.s3_server import S3Server, s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture
def folder(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> BucketFolder:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return BucketFolder(f"s3://{s3.new_bucket()}/runs/out").child("job-a")


def test_a_name_is_written_once_and_never_replaced(folder: BucketFolder, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(b"the shard a writer placed")
    second.write_bytes(b"a second writer given the same number")
    folder.put_new("shard-000001.jsonl.zst", first)
    with pytest.raises(ObjectExists):
        folder.put_new("shard-000001.jsonl.zst", second)
    with folder.open("shard-000001.jsonl.zst") as fh:
        assert fh.read() == first.read_bytes()
    assert folder.size("shard-000001.jsonl.zst") == first.stat().st_size
    assert folder.size("shard-000002.jsonl.zst") is None


def test_names_list_the_folder_only(folder: BucketFolder, s3: S3Server, tmp_path: Path) -> None:
    source = tmp_path / "x"
    source.write_bytes(b"x")
    for name in ("shard-000002.jsonl.zst", "shard-000001.jsonl.zst"):
        folder.put_new(name, source)
    folder.put_manifest_line("shard-000001.jsonl.zst", b'{"shard":"shard-000001.jsonl.zst"}')
    bucket = folder.url.split("/")[2]
    # Another job beside it, and an object one level up: neither is this folder's.
    s3.client().put_object(Bucket=bucket, Key="runs/out/job-b/shard-000009.jsonl.zst", Body=b"")
    s3.client().put_object(Bucket=bucket, Key="runs/out/shard-000008.jsonl.zst", Body=b"")
    assert folder.names() == ["shard-000001.jsonl.zst", "shard-000002.jsonl.zst"]
    assert folder.names("shard-000002") == ["shard-000002.jsonl.zst"]


def test_the_manifest_is_one_object_per_shard_written_once(folder: BucketFolder) -> None:
    folder.put_manifest_line("shard-000002.jsonl.zst", b'{"shard":"shard-000002.jsonl.zst"}')
    folder.put_manifest_line("shard-000001.jsonl.zst", b'{"shard":"shard-000001.jsonl.zst"}')
    # Recovery rebuilding a line its writer already wrote leaves the first.
    folder.put_manifest_line("shard-000001.jsonl.zst", b'{"shard":"rebuilt"}')
    assert list(folder.manifest_lines()) == [
        b'{"shard":"shard-000001.jsonl.zst"}',
        b'{"shard":"shard-000002.jsonl.zst"}',
    ]


def test_a_large_object_is_read_in_chunks_with_flat_memory(
    folder: BucketFolder, tmp_path: Path
) -> None:
    source = tmp_path / "big"
    source.write_bytes(os.urandom(24 * CHUNK_BYTES))
    folder.put_new("shard-000001.jsonl.zst", source)
    tracemalloc.start()
    try:
        size = 0
        with folder.open("shard-000001.jsonl.zst") as fh:
            while block := fh.read(1 << 16):
                size += len(block)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size == source.stat().st_size
    assert peak < 4 * CHUNK_BYTES, f"{peak:,} bytes held to read {size:,}"


def test_a_missing_bucket_is_one_line_naming_it_without_secrets(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    folder = BucketFolder("s3://regen-no-such-bucket/out")
    with pytest.raises(BucketError) as caught:
        folder.names()
    message = str(caught.value)
    assert "s3://regen-no-such-bucket/out" in message
    assert "\n" not in message
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in message


def test_a_url_with_credentials_is_refused() -> None:
    with pytest.raises(BucketError, match="no credentials"):
        BucketFolder("s3://key:secret@bucket/out")


@pytest.mark.parametrize(
    ("out", "bucket"),
    [
        ("s3://b/out", True),
        ("gs://b/out", True),
        ("az://container/out", True),
        ("abfss://container@account.dfs.core.windows.net/out", True),
        ("/data/out", False),
        ("out", False),
        ("s3:/b/out", False),
        ("file:///data/out", False),
    ],
)
def test_which_outs_are_buckets(out: str, bucket: bool) -> None:
    assert is_bucket_url(out) is bucket
