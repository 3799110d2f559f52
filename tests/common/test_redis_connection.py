"""Reaching Redis: the embedded server, passwords, TLS, and secrets kept out of output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from regen.cli import main
from regen.common import jobspec
from regen.common.connection import redact
from regen.common.embedded_redis import EmbeddedRedis, find_redis_server
from tests.support.generate_harness import REPO, Worker, all_generated
from tests.support.helpers import job_ids, user_rows, wait_for, write_jsonl
from tests.support.redis_server import free_port, running_redis
from tests.support.sglang_standin.process import run_standin

SECRET = "s3cret-Pa55word"


def test_redact_hides_only_the_password() -> None:
    assert redact(f"redis://:{SECRET}@host:6379/0") == "redis://:***@host:6379/0"
    assert redact(f"rediss://user:{SECRET}@h:1/2?ssl_cert_reqs=none") == (
        "rediss://user:***@h:1/2?ssl_cert_reqs=none"
    )
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


def test_embedded_redis_starts_once_persists_and_stops(
    tmp_path: Path, regen_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REGEN_EMBEDDED_PORT", str(free_port()))
    monkeypatch.delenv("REGEN_REDIS_URL", raising=False)
    runner = CliRunner()
    try:
        started = runner.invoke(main, ["redis", "start"])
        assert started.exit_code == 0 and "started" in started.output
        assert str(regen_home / "redis") in started.output
        again = runner.invoke(main, ["redis", "start"])
        assert "already running" in again.output

        data = write_jsonl(tmp_path / "d.jsonl", user_rows(3))
        result = runner.invoke(
            main,
            ["enqueue", str(data), "--job", "e", "--model", "smollm2", "--max-new-tokens", "16"],
        )
        assert result.exit_code == 0, result.output
        server = EmbeddedRedis.from_env()
        assert (regen_home / "redis" / "appendonly.aof").exists() or list(
            (regen_home / "redis").glob("appendonlydir/*")
        )
        assert runner.invoke(main, ["redis", "stop"]).exit_code == 0
        assert "stopped" in runner.invoke(main, ["redis", "status"]).output

        # Append-only persistence: the job is still there after a restart.
        server.ensure_running(quiet=True)
        r = redis.Redis.from_url(server.url)
        assert jobspec.load(r, "e").sampling["max_new_tokens"] == 16
        assert len(job_ids(r, "e")) == 3
    finally:
        EmbeddedRedis.from_env().stop()


def run_enqueue(
    url: str, data: Path, job: str, *options: str, verbose: bool = False
) -> subprocess.CompletedProcess[str]:
    """`regen enqueue` of `data` into `job` with SmolLM2, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "regen", *(["-vv"] if verbose else []), "enqueue", str(data),
         "--job", job, "--model", "smollm2", "--max-new-tokens", "16", *options,
         "--redis-url", url],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip


def test_a_password_url_works_and_never_shows(tmp_path: Path) -> None:
    with running_redis(tmp_path / "redis", "--requirepass", SECRET) as server:
        url = f"redis://:{SECRET}@127.0.0.1:{server.port}/0"
        data = write_jsonl(tmp_path / "d.jsonl", user_rows(5))
        result = run_enqueue(url, data, "p", verbose=True)
        assert result.returncode == 0, result.stderr
        assert SECRET not in result.stdout + result.stderr
        assert ":***@" in result.stderr
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, password="wrong").ping()
        assert len(job_ids(redis.Redis.from_url(url), "p")) == 5


def test_a_refused_login_is_one_clear_line_in_every_command(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", user_rows(2))
    commands = [
        ["status"],
        ["enqueue", str(data), "--job", "p", "--model", "smollm2", "--max-new-tokens", "16"],
        ["worker", "tokenize", "--out", str(tmp_path / "out")],
        ["worker", "generate", "--engine", "sglang", "--server", "http://127.0.0.1:9"],
    ]
    with running_redis(tmp_path / "redis", "--requirepass", SECRET) as server:
        for password in ("wrong-one", None):  # a wrong password, and none at all
            auth = f":{password}@" if password else ""
            url = f"redis://{auth}127.0.0.1:{server.port}/0"
            for command in commands:
                done = subprocess.run(
                    [sys.executable, "-m", "regen", *command],
                    env={**os.environ, "PYTHONPATH": str(REPO), "REGEN_REDIS_URL": url},
                    capture_output=True, text=True, cwd=REPO, timeout=300,
                )  # fmt: skip
                errors = [line for line in done.stderr.splitlines() if line.startswith("Error")]
                assert done.returncode == 1, (command, done.stderr)
                assert "Traceback" not in done.stderr, (command, done.stderr)
                assert len(errors) == 1 and "Redis refused the login" in errors[0], done.stderr
                assert password is None or password not in done.stdout + done.stderr


def _tls_capable(binary: str) -> bool:
    """A build without TLS rejects the tls-port directive itself; one with TLS fails later,
    on the missing certificate file."""
    probe = subprocess.run(
        [binary, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return ">>> 'tls-port" not in probe.stdout + probe.stderr


@pytest.mark.slow
def test_a_tls_url_carries_a_whole_run(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    if not _tls_capable(find_redis_server()):
        pytest.skip("this redis-server is built without TLS (CI installs Debian's, which has it)")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_path, cert_path, key_path = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    tls_port = free_port()
    with running_redis(
        tmp_path / "redis",
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(cert_path),
        "--tls-key-file",
        str(key_path),
        "--tls-ca-cert-file",
        str(ca_path),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        SECRET,
    ):
        url = f"rediss://:{SECRET}@127.0.0.1:{tls_port}/0?ssl_ca_certs={ca_path}"
        data = write_jsonl(tmp_path / "d.jsonl", user_rows(6))
        enqueue = run_enqueue(url, data, "g", "--chunk-size", "3")
        assert enqueue.returncode == 0, enqueue.stderr
        r = redis.Redis.from_url(url)
        spec = jobspec.load(r, "g")
        with (
            run_standin() as server,
            Worker(
                url, tmp_path, "--engine", "sglang", "--server", server.url, "--jobs", "g"
            ) as worker,
        ):
            wait_for(
                lambda: all_generated(r, spec),
                timeout=120,
                what="a run over TLS",
            )
            assert SECRET not in worker.log()
