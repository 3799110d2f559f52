"""Own a stand-in as a real subprocess: start, wait until it serves, kill -9, restart.

Tests see the same failure modes a worker sees in production (refused connections,
resets, a process that vanishes mid-request), which an in-process server cannot give.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.sglang_standin.config import LengthDist, StandinConfig, to_argv

REPO_ROOT = Path(__file__).resolve().parents[3]
# Loading transformers and a tokenizer takes a few seconds; a cold GGUF conversion more.
READY_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What the stand-in prints once it listens (server.serve): the port it bound.
LISTENING = re.compile(rb"standin listening on http://[^:]+:(\d+)")


class StandinHandle:
    """One stand-in process. With port 0 in its config the stand-in binds a free port
    itself and the handle learns it from the log in `wait_ready`: a port picked here and
    bound there could be taken in between by a parallel test's server, which would then
    answer this handle's health checks (and its worker's requests) instead."""

    def __init__(self, config: StandinConfig) -> None:
        self.config = config
        fd, log = tempfile.mkstemp(prefix="standin-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log)
        self._proc: subprocess.Popen[bytes] | None = None
        # No pooled connections: a control call must never ride a socket to a killed process.
        self._http = httpx.Client(
            base_url=self.url,
            timeout=10.0,
            trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    @property
    def port(self) -> int:
        """The port it serves on (0 until `wait_ready` has read the one it bound)."""
        return self.config.port

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    # --- process ---------------------------------------------------------------------
    def start(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.sglang_standin", *to_argv(self.config)],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S, *, healthy: bool = True) -> None:
        """Poll /health until 200 (or, with healthy=False, until it answers at all), from
        this handle's own process."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"stand-in exited before serving:\n{self.log_tail()}")
            if self.config.port == 0:
                self._read_bound_port()
            elif self._answers(healthy):
                return
            time.sleep(0.05)
        raise TimeoutError(f"stand-in not ready after {timeout_s}s:\n{self.log_tail()}")

    def _read_bound_port(self) -> None:
        found = LISTENING.search(self.log_path.read_bytes())
        if found:
            self.config = dataclasses.replace(self.config, port=int(found[1]))
            self._http.base_url = httpx.URL(self.url)

    def _answers(self, healthy: bool) -> bool:
        try:
            if self._http.get("/health").status_code != 200 and healthy:
                return False
            pid = self.stats()["pid"]
        except httpx.HTTPError:
            return False
        if self._proc is None or pid != self._proc.pid:
            # A fixed port (a restart's) that another test's server holds: ours cannot bind.
            raise RuntimeError(f"port {self.port} is served by another process (pid {pid})")
        return True

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a crashed node does: no cleanup, no responses."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait()

    def restart(self, *, wait: bool = True, **changes: Any) -> None:
        """A fresh process on the same port (the old one is killed first if alive),
        optionally with changed options, e.g. `restart(startup_delay=1.0)`."""
        self.kill()
        self.config = dataclasses.replace(self.config, **changes)
        self.start()
        if wait:
            self.wait_ready()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._http.close()
        self.log_path.unlink(missing_ok=True)

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:]

    # --- control routes ----------------------------------------------------------------
    def fault(
        self,
        kind: str | None = None,
        count: int = 1,
        delay_s: float = 0.0,
        *,
        clear: bool = False,
        healthy: bool | None = None,
    ) -> dict[str, Any]:
        """Arm `count` faults of `kind` (config.FAULT_KINDS), flip health, or clear."""
        body: dict[str, Any] = {"clear": clear}
        if kind is not None:
            body.update(kind=kind, count=count, delay_s=delay_s)
        if healthy is not None:
            body["healthy"] = healthy
        response = self._http.post("/_fault", json=body)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def stats(self) -> dict[str, Any]:
        response = self.get("/_stats")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def served(self) -> list[dict[str, Any]]:
        """The last requests it completed, oldest first: rid, prompt and cached tokens."""
        response = self.get("/_served")
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()
        return result

    def slot_log(self) -> list[dict[str, Any]]:
        """Each request's time on a slot (Scheduler.slot_log), oldest first."""
        response = self.get("/_slot_log")
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()
        return result

    def get(self, path: str) -> httpx.Response:
        return self._http.get(path)

    def generate(self, body: dict[str, Any]) -> httpx.Response:
        """A raw POST /generate, for contract checks and expected outputs."""
        return self._http.post("/generate", json=body)


def start_standin(port: int | None = None, **options: Any) -> StandinHandle:
    """Start a stand-in without waiting; call `.wait_ready()` (lets tests start several)."""
    if isinstance(options.get("output_len_dist"), str):
        options["output_len_dist"] = LengthDist.parse(options["output_len_dist"])
    options["fault"] = tuple(options.get("fault", ()))
    handle = StandinHandle(StandinConfig(port=port or 0, **options))
    handle.start()
    return handle


@contextlib.contextmanager
def run_standin(port: int | None = None, **options: Any) -> Iterator[StandinHandle]:
    """A serving stand-in subprocess on a free port it binds itself (or on `port`), always
    cleaned up."""
    handle = start_standin(port, **options)
    try:
        handle.wait_ready(healthy=not options.get("startup_delay") and not options.get("unhealthy"))
        yield handle
    finally:
        handle.close()
