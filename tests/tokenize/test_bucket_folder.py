"""A job folder in object storage, against each store's real API (moto's S3 server,
Azurite, fake-gcs-server: tests/support/bucket_stores.py): create-once puts, listings, streamed
reads and the manifest as objects (common/bucket_folder.py)."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from regen.common.bucket_folder import (
    CHUNK_BYTES,
    BucketError,
    BucketFolder,
    ObjectExists,
    is_bucket_url,
)
from tests.support.azurite_server import ACCOUNT, AzuriteServer
from tests.support.bucket_stores import StoreServer, bucket_url, use_store


@pytest.fixture
def folder(store: StoreServer, monkeypatch: pytest.MonkeyPatch) -> BucketFolder:
    use_store(store, monkeypatch)
    return BucketFolder(bucket_url(store)).child("job-a")


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


def test_names_list_the_folder_only(folder: BucketFolder, tmp_path: Path) -> None:
    source = tmp_path / "x"
    source.write_bytes(b"x")
    for name in ("shard-000002.jsonl.zst", "shard-000001.jsonl.zst"):
        folder.put_new(name, source)
    folder.put_manifest_line("shard-000001.jsonl.zst", b'{"shard":"shard-000001.jsonl.zst"}')
    # Another job beside it, and an object one level up: neither is this folder's.
    out = BucketFolder(folder.url.rsplit("/", 1)[0])
    out.child("job-b").put_new("shard-000009.jsonl.zst", source)
    out.put_new("shard-000008.jsonl.zst", source)
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
    store: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_store(store, monkeypatch)
    url = f"{store.scheme}://regen-no-such-bucket/out"
    folder = BucketFolder(url)
    with pytest.raises(BucketError) as caught:
        folder.names()
    message = str(caught.value)
    assert url in message
    assert "\n" not in message
    assert store.secret not in message


@pytest.mark.parametrize("store", ["az"], indirect=True)
def test_azurite_is_reached_by_the_emulator_switch_alone(
    store: AzuriteServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Azure's documented emulator settings: AZURE_STORAGE_USE_EMULATOR (its well-known
    account and key) and AZURITE_BLOB_STORAGE_URL for an Azurite not on port 10000."""
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", store.endpoint.removesuffix(f"/{ACCOUNT}"))
    folder = BucketFolder(f"az://{store.new_bucket()}/out")
    source = tmp_path / "x"
    source.write_bytes(b"x")
    folder.put_new("shard-000001.jsonl.zst", source)
    with pytest.raises(ObjectExists):
        folder.put_new("shard-000001.jsonl.zst", source)
    assert folder.names() == ["shard-000001.jsonl.zst"]


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
