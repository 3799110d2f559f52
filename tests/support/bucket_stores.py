"""The object stores the bucket tests run on, each a real emulator started by the tests
on a free port: S3 (moto's server), Azure Blob (Azurite) and GCS (fake-gcs-server). A
test that takes the `store` fixture (tests/conftest.py) runs on each; a store whose
emulator is not installed, or cannot serve regen's client, is skipped, saying why."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import pytest

from tests.support.azurite_server import azurite_server
from tests.support.gcs_server import gcs_server
from tests.support.s3_server import s3_server


class StoreServer(Protocol):
    @property
    def scheme(self) -> str:
        """The `--out` URL's scheme: s3, az or gs."""

    @property
    def env(self) -> dict[str, str]:
        """The variables regen's clients read, as a user of this store sets them."""

    @property
    def secret(self) -> str:
        """A credential in `env`, never to appear in anything regen prints."""

    def new_bucket(self) -> str:
        """A fresh, empty bucket (container)."""


KINDS = ("s3", "az", "gs")


def store_server(kind: str) -> AbstractContextManager[StoreServer]:
    starts = {"s3": s3_server, "az": azurite_server, "gs": gcs_server}
    return starts[kind]()


def use_store(store: StoreServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's variables in this test's environment (and its workers')."""
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)


def bucket_url(store: StoreServer, path: str = "runs/out") -> str:
    """`--out` on a fresh bucket: SCHEME://BUCKET/PATH."""
    return f"{store.scheme}://{store.new_bucket()}/{path}"
