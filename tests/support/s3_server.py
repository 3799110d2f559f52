"""A real S3 HTTP API for tests: moto's server in a process of its own on a free port (its
memory apart from the test's), with the environment regen's clients read (AWS_*
variables, as an S3-compatible store's users set them)."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import boto3

from tests.support.emulator import answers, serving
from tests.support.redis_server import free_port


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    env: dict[str, str]
    scheme: str = "s3"

    @property
    def secret(self) -> str:
        """What must never appear in anything regen prints."""
        return self.env["AWS_SECRET_ACCESS_KEY"]

    def new_bucket(self) -> str:
        """A fresh, empty bucket's name."""
        name = f"regen-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def client(self) -> Any:  # boto3's clients are made at run time, untyped
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        )


@contextmanager
def s3_server() -> Iterator[S3Server]:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with serving(argv, lambda: answers(endpoint), "moto's S3 server"):
        env = {
            "AWS_ACCESS_KEY_ID": "regen-test-key",
            "AWS_SECRET_ACCESS_KEY": "regen-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",  # obstore refuses plain http without it
        }
        yield S3Server(endpoint, env)
