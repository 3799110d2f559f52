"""A real Redis Sentinel deployment for tests: a primary, a replica and three sentinels
(redis-server with `--sentinel`), each on a free port in a temporary folder."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from regen.common.embedded_redis import find_redis_server
from tests.support.helpers import wait_for
from tests.support.redis_server import RedisServer, free_port

MASTER = "regen"
# Quick enough for a test: a primary silent for 1 s is down, and a failover that stalls
# is retried after 5 s.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


@dataclass
class SentinelCluster:
    folder: Path
    primary: RedisServer = field(init=False)
    replica: RedisServer = field(init=False)
    sentinel_ports: list[int] = field(default_factory=list)
    _sentinels: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> SentinelCluster:
        self.primary = RedisServer(self.folder / "primary", free_port()).start()
        self.replica = RedisServer(
            self.folder / "replica",
            free_port(),
            extra_args=("--replicaof", "127.0.0.1", str(self.primary.port)),
        ).start()
        for i in range(3):
            self._start_sentinel(i)
        wait_for(self._all_sentinels_see_the_replica, what="sentinels to see the replica")
        return self

    def _start_sentinel(self, i: int) -> None:
        port = free_port()
        folder = self.folder / f"sentinel-{i}"
        folder.mkdir(parents=True)
        conf = folder / "sentinel.conf"  # a sentinel rewrites its config: a file of its own
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {folder}\n"
            f"logfile {folder / 'sentinel.log'}\n"  # kept with a failed chaos seed's folder
            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {MASTER} 1\n"
        )
        process = subprocess.Popen(
            [find_redis_server(), str(conf), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        self._sentinels.append(process)
        self.sentinel_ports.append(port)

    def _all_sentinels_see_the_replica(self) -> bool:
        try:
            return all(
                len(sentinel(port).sentinel_slaves(MASTER)) == 1
                and len(sentinel(port).sentinel_sentinels(MASTER)) == 2
                for port in self.sentinel_ports
            )
        except redis.RedisError:
            return False

    def url(self, password: str | None = None, db: int = 0) -> str:
        login = f":{password}@" if password else ""
        entries = [f"sentinel://{login}127.0.0.1:{port}" for port in self.sentinel_ports]
        return ";".join(entries) + f"/{db}"

    def master_port(self) -> int:
        """The primary's port, as the first sentinel that answers names it."""
        for port in self.sentinel_ports:
            with contextlib.suppress(redis.RedisError):
                _host, master = sentinel(port).sentinel_get_master_addr_by_name(MASTER)
                return int(master)
        raise RuntimeError("no sentinel answers")

    def replica_in_sync(self) -> bool:
        """The replica holds every write the primary took (equal replication offsets)."""
        info = redis.Redis(port=self.primary.port).info("replication")
        replica = info.get("slave0")
        return bool(
            replica
            and replica.get("state") == "online"
            and int(replica["offset"]) == int(info["master_repl_offset"])
        )

    def steady(self) -> bool:
        """Every sentinel names the same primary, it says it is one, and its replica has
        applied every write the primary had taken when asked: a failover now would lose
        nothing. (A replica restarted from its own stale files serves them until its first
        sync; promoted then, it would roll the job back.)"""
        try:
            ports = {
                int(sentinel(port).sentinel_get_master_addr_by_name(MASTER)[1])
                for port in self.sentinel_ports
            }
            if len(ports) != 1:
                return False
            primary = redis.Redis(port=ports.pop(), socket_timeout=2).info("replication")
            listed = primary.get("slave0")
            if primary.get("role") != "master" or not listed:
                return False
            # The replica's own offset, read after the primary's: the ack the primary
            # lists trails by up to a second under a steady trickle of writes.
            replica = redis.Redis(port=int(listed["port"]), socket_timeout=2).info("replication")
        except (redis.RedisError, TypeError):  # TypeError: a sentinel that names none
            return False
        return replica.get("master_link_status") == "up" and int(
            replica.get("slave_repl_offset", -1)
        ) >= int(primary["master_repl_offset"])

    def stop(self) -> None:
        for process in self._sentinels:
            process.kill()
            process.wait()
        for server in (getattr(self, "replica", None), getattr(self, "primary", None)):
            if server is not None:
                server.kill()


def sentinel(port: int) -> redis.Redis:
    return redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=2)


@contextlib.contextmanager
def sentinel_cluster(folder: Path) -> Iterator[SentinelCluster]:
    cluster = SentinelCluster(folder)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
