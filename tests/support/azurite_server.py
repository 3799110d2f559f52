"""A real Azure Blob API for tests: Azurite (Microsoft's emulator, an npm package that
scripts/setup.sh installs) in a process of its own on a free port, with the variables an
Azure user sets for a storage account behind a custom endpoint (Azurite, a private
endpoint): account name and key, AZURE_STORAGE_ENDPOINT, AZURE_ALLOW_HTTP."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.emulator import answers, serving
from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
# Where scripts/setup.sh installs it (npm, in the ignored .venv).
INSTALLED = REPO / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's one account and its well-known key, published in Azure's documentation for
# the emulator: not a secret anywhere, but regen must print it no more than a real key.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_binary() -> str | None:
    found = shutil.which("azurite-blob")
    if found:
        return found
    return str(INSTALLED) if INSTALLED.exists() else None


@dataclass(frozen=True)
class AzuriteServer:
    endpoint: str  # the account's blob endpoint, http://127.0.0.1:PORT/devstoreaccount1
    env: dict[str, str]
    scheme: str = "az"
    secret: str = ACCOUNT_KEY

    def new_bucket(self) -> str:
        """A fresh, empty container's name (az://CONTAINER/prefix)."""
        from azure.storage.blob import BlobServiceClient

        name = f"regen-{uuid.uuid4().hex[:12]}"
        connection = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};"
                      f"AccountKey={ACCOUNT_KEY};BlobEndpoint={self.endpoint};")  # fmt: skip
        BlobServiceClient.from_connection_string(connection).create_container(name)
        return name


@contextmanager
def azurite_server() -> Iterator[AzuriteServer]:
    binary = azurite_binary()
    if binary is None:
        pytest.skip("Azurite is not installed (scripts/setup.sh installs it with npm)")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    argv = [binary, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
            "--disableTelemetry", "--skipApiVersionCheck", "--silent"]  # fmt: skip
    with serving(argv, lambda: answers(f"{endpoint}?comp=list"), "Azurite"):
        env = {
            "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": ACCOUNT_KEY,
            "AZURE_STORAGE_ENDPOINT": endpoint,
            "AZURE_ALLOW_HTTP": "true",  # obstore refuses plain http without it
        }
        yield AzuriteServer(endpoint, env)
