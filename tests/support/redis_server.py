"""A real redis-server for tests: started on a free port in a temporary folder."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from regen.common.embedded_redis import find_redis_server, redis_config


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reserved_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 that never listens: while it is open, a
    connection there is refused and no other socket can bind the port."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    return holder


class PortTaken(RuntimeError):
    def __init__(self, port: int) -> None:
        super().__init__(f"redis-server could not hold port {port}: another process has it")


@dataclass
class RedisServer:
    data_dir: Path
    port: int
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [find_redis_server(), *redis_config(self.data_dir, self.port), *self.extra_args]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        try:
            while True:
                try:
                    answering = int(client.info("server")["process_id"])
                except redis.AuthenticationError:
                    return self  # up, and asking for the password it was started with
                except redis.ConnectionError:
                    if self.process.poll() is not None:
                        # Most often the port: bind fails when another process holds it.
                        raise PortTaken(self.port) from None
                    if time.monotonic() > deadline:
                        raise RuntimeError("test redis-server did not start") from None
                    time.sleep(0.02)
                    continue
                if answering != self.process.pid:
                    # Tests run in parallel processes: another one's server holds the port.
                    self.process.kill()
                    self.process.wait()
                    self.process = None
                    raise PortTaken(self.port)
                # INFO answers while the AOF loads; any other command fails with
                # BusyLoadingError until it is loaded (a restart on a big AOF).
                if int(client.info("persistence")["loading"]) == 0:
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError("test redis-server did not finish loading its data")
                time.sleep(0.02)
        finally:
            client.close()

    @classmethod
    def on_free_port(cls, data_dir: Path, *extra_args: str) -> RedisServer:
        """Started on a free port, another one tried if a parallel test takes it first
        (free_port's port is free only until someone binds it)."""
        for attempt in range(5):
            try:
                return cls(data_dir=data_dir, port=free_port(), extra_args=extra_args).start()
            except PortTaken:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
            self.process = None


@contextlib.contextmanager
def running_redis(data_dir: Path, *extra_args: str) -> Iterator[RedisServer]:
    server = RedisServer.on_free_port(data_dir, *extra_args)
    try:
        yield server
    finally:
        server.kill()
