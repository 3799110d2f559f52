"""The processes of one chaos run: a Redis that can be killed, restarted and rolled back,
and the generate and tokenize workers and the job's follower (`regen enqueue --follow`),
kept running as a supervisor would.

The supervisor restarts a worker that died, as compose's `restart: on-failure` and
systemd do; a worker that exits 0 while the job runs is never restarted by them, so it
is recorded as a violation (a fault must end a worker non-zero, or not at all). The
follower alone exits 0 by design, once every prompt has a place: it is left down then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from regen.common import connection
from tests.support.generate_harness import REPO, GroupProcess, Worker
from tests.support.redis_server import RedisServer
from tests.support.sentinel_cluster import MASTER, SentinelCluster

# Leases shortened from 100 s (chunks) and 60 s (shard claims) so that a frozen or dead
# worker's work comes back within a seed; each is renewed four times a lease.
CHUNK_LEASE_S = 4
SHARD_LEASE_S = 4
RESTART_DELAY_S = 0.3
# On a generate worker's PYTHONPATH, its sitecustomize SIGKILLs it inside kombu's window:
# a chunk popped from the queue, not yet recorded in `unacked`.
KOMBU_WINDOW = Path(__file__).resolve().parents[1] / "support" / "kombu_window"

# A copy of every key with its time to live, taken in one step (a script runs alone),
# as a backup or a lagging replica holds it: an RDB or AOF keeps each key's expiry.
_DUMP_ALL = """
local out = {}
for _, key in ipairs(redis.call('KEYS', '*')) do
  out[#out + 1] = key
  out[#out + 1] = redis.call('DUMP', key)
  out[#out + 1] = redis.call('PTTL', key)
end
return out
"""


Copy = dict[bytes, tuple[bytes, int]]


class _Snapshots:
    """Copy and restore through `client`, which reaches the primary."""

    client: redis.Redis
    env: dict[str, str]  # what a process needs, besides the URL, to reach Redis

    def copy(self) -> Copy:
        flat = self.client.eval(_DUMP_ALL, 0)
        return {key: (value, int(ttl)) for key, value, ttl in zip(*[iter(flat)] * 3, strict=True)}

    def restore(self, copy: Copy) -> None:
        """Put the copy back, each key with the time to live it had (0: none), in one
        transaction, under the running workers."""
        pipe = self.client.pipeline(transaction=True)
        pipe.flushall()
        for key, (value, ttl_ms) in copy.items():
            pipe.restore(key, max(ttl_ms, 0), value)
        pipe.execute()


class Redis(_Snapshots):
    """A redis-server on its own port and folder, append-only with an fsync per write."""

    def __init__(self, folder: Path) -> None:
        self.server = RedisServer.on_free_port(folder)
        self.url = self.server.url
        self.client = redis.Redis.from_url(self.url)
        self.env = {}

    def kill_and_restart(self, down_s: float) -> None:
        """SIGKILL, then start again on the same port from the same append-only file."""
        self.server.kill()
        time.sleep(down_s)
        self.server.start()

    def tend(self) -> None:
        """Nothing to do between faults (SentinelRedis restarts a failed-over primary)."""

    def steady(self) -> bool:
        """Always: one server, nothing to fail over to."""
        return True

    def events(self) -> str:
        """Nothing to report: no sentinels."""
        return ""

    def stop(self) -> None:
        """Stop the server; its folder stays with the seed's."""
        self.server.kill()


class SentinelRedis(_Snapshots):
    """A primary, a replica and three sentinels (tests/support/sentinel_cluster.py); every process
    and the harness's own client reach the primary through `sentinel://`, so they follow
    it through a failover (docs/operations.md, Redis Sentinel)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.cluster = SentinelCluster(folder)
        try:
            self.cluster.start()
        except BaseException:
            self.cluster.stop()
            raise
        self.servers = (self.cluster.primary, self.cluster.replica)
        self.url = self.cluster.url()
        self.env = {"REGEN_REDIS_SENTINEL_MASTER": MASTER}
        self.client = connection.client(self.url)  # the caller set REGEN_REDIS_SENTINEL_MASTER
        self.down: list[RedisServer] = []  # killed by a failover, not yet back

    def primary(self) -> RedisServer:
        port = self.cluster.master_port()
        return next(server for server in self.servers if server.port == port)

    def failover(self) -> int:
        """SIGKILL the primary without waiting for its replica to catch up (a failover
        that loses the last writes is a rollback, healed by regen: docs/design/exactly-once.md,
        Healing); the sentinels promote the replica. Returns the killed port."""
        server = self.primary()
        server.kill()
        if server not in self.down:
            self.down.append(server)
        return server.port

    def kill_and_restart(self, down_s: float) -> None:
        """SIGKILL the primary, then start it again from its append-only file: as the
        primary if the sentinels still name it, else as the new primary's replica (the
        sentinels fail over a primary silent for DOWN_AFTER_MS)."""
        server = self.primary()
        server.kill()
        time.sleep(down_s)
        self._restart(server)

    def tend(self) -> None:
        """Start a failed-over primary again, as a replica of the one promoted, once the
        sentinels name it (so that a later fault has a replica to promote)."""
        for server in list(self.down):
            if self.primary() is not server:
                self._restart(server)

    def steady(self) -> bool:
        """Both servers up, the sentinels agreed, the replica caught up: the job is not
        judged settled while a failover could still roll it back (SentinelCluster.steady)."""
        return not self.down and self.cluster.steady()

    def _restart(self, server: RedisServer) -> None:
        others = [other for other in self.servers if other is not server]
        master = self.primary()
        if master in others and master.process is not None:
            server.extra_args = ("--replicaof", "127.0.0.1", str(master.port))
        else:
            server.extra_args = ()
        server.start()
        if server in self.down:
            self.down.remove(server)

    def events(self) -> str:
        """What the first sentinel saw happen to the primary (failovers, outages, TILT),
        for a failed seed's report."""
        log = self.folder / "sentinel-0" / "sentinel.log"
        marks = ("+sdown", "-sdown", "+odown", "+switch-master", "+tilt", "+failover-end")
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return " | ".join(line[line.find("#") :] for line in lines if any(m in line for m in marks))

    def stop(self) -> None:
        """Stop every process; the folder (data, sentinel logs) stays with the seed's."""
        self.cluster.stop()


class Follower(GroupProcess):
    """The job's `regen enqueue ARGS --follow`, with a worker's interface (process, name,
    kill, stop), its log in a file."""

    def __init__(self, url: str, log_dir: Path, *args: str, env: dict[str, str]) -> None:
        self.kind = "producer"
        log_path = log_dir / f"follower-{len(list(log_dir.glob('follower-*')))}.log"
        super().__init__(["enqueue", *args, "--follow", "--redis-url", url], log_path, env)

    @property
    def name(self) -> str:
        return f"follower:{self.process.pid}"


@dataclass
class Slot:
    """One worker place: the process now in it, and what the ones before it did."""

    kind: str
    args: tuple[str, ...]
    env: dict[str, str]
    crashpoint: str | None = None
    kombu_window: bool = False  # the next process dies inside kombu's window
    in_window: bool = False  # the process now running was started to die there
    worker: Worker | Follower | None = None
    exits: list[int] = field(default_factory=list)
    died_at: float | None = None
    # The process now running was told to stop (SIGTERM): it exits 0 when its drain
    # ends, and is started again, as Slurm requeues a job.
    stopping: bool = False
    # After that SIGTERM: when to SIGKILL it (mid-drain), and whether to send a second
    # SIGTERM once it drains.
    kill_at: float | None = None
    second_signal: bool = False


class Workers:
    def __init__(self, url: str, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.url = url
        self.log_dir = log_dir
        self.env = env or {}  # every process's: how to reach Redis
        self.slots: list[Slot] = []
        self.window_kills = 0  # processes that died inside kombu's window
        self.violations: list[str] = []
        self.frozen: dict[int, float] = {}  # pid -> when to SIGCONT it

    def add(
        self, kind: str, args: tuple[str, ...], env: dict[str, str], crashpoint: str | None
    ) -> None:
        slot = Slot(kind, args, env, crashpoint)
        self.slots.append(slot)
        self._start(slot)

    def _start(self, slot: Slot) -> None:
        env = {**self.env, **slot.env}
        if slot.crashpoint is not None:
            env["REGEN_CRASHPOINT"] = slot.crashpoint
            slot.crashpoint = None  # the next process runs through
        slot.in_window = slot.kombu_window
        if slot.kombu_window:
            env["PYTHONPATH"] = f"{REPO}{os.pathsep}{KOMBU_WINDOW}"
            slot.kombu_window = False  # restarted as any other worker
        if slot.kind == "producer":
            slot.worker = Follower(self.url, self.log_dir, *slot.args, env=env)
        else:
            slot.worker = Worker(self.url, self.log_dir, *slot.args, env=env, kind=slot.kind)
        slot.died_at = None
        slot.stopping, slot.kill_at, slot.second_signal = False, None, False

    def of_kind(self, kind: str) -> list[Slot]:
        return [slot for slot in self.slots if slot.kind == kind]

    def supervise(self) -> None:
        """Restart what died; resume what was frozen long enough. Call it often."""
        now = time.monotonic()
        for pid, until in list(self.frozen.items()):
            if now >= until:
                self._signal_pid_group(pid, signal.SIGCONT)
                del self.frozen[pid]
        for slot in self.slots:
            assert slot.worker is not None
            code = slot.worker.process.poll()
            if code is None:
                self._follow_drain(slot, now)
                continue
            if code == 0 and slot.kind == "producer":
                if slot.died_at is None:
                    slot.died_at = now
                    slot.exits.append(code)
                continue  # the follower left, every prompt placed: not restarted
            if slot.died_at is None:
                slot.died_at = now
                slot.exits.append(code)
                if slot.kind == "producer" and code > 0:
                    # No fault kills the follower and it waits Redis outages out: an
                    # exit of its own is a bug (a usage error once restarted it for good).
                    self.violations.append(
                        f"{slot.worker.name} exited {code}: {slot.worker.log()[-300:]!r}"
                    )
                if slot.in_window and code == -signal.SIGKILL:
                    self.window_kills += 1  # (or a kill_generate fault that hit it first)
                if code == 0 and not slot.stopping:
                    self.violations.append(
                        f"{slot.worker.name} exited 0 while the job ran: a supervisor that "
                        "restarts on failure would leave it down"
                    )
            if now - slot.died_at >= RESTART_DELAY_S:
                self._start(slot)

    def add_in_kombu_window(self, args: tuple[str, ...], env: dict[str, str]) -> str:
        """One more generate worker, whose first process SIGKILLs itself at its first
        pop, before kombu records the chunk in `unacked`; the supervisor restarts it as
        any other. Returns its first process's name."""
        slot = Slot("generate", args, env, kombu_window=True)
        self.slots.append(slot)
        self._start(slot)
        assert slot.worker is not None
        return slot.worker.name

    def drain(self, kind: str, target: int, detail: str) -> str | None:
        """SIGTERM to a worker's main process, as Slurm, Kubernetes and `docker stop`
        send it: it drains and exits, and is started again. `detail`: "kill:S" SIGKILLs
        it S seconds later (mid-drain), "twice" sends a second SIGTERM once it drains."""
        slot = self._pick(kind, target)
        if slot is None or slot.worker is None or slot.worker.process.poll() is not None:
            return None
        if slot.worker.process.pid in self.frozen or slot.stopping:
            return None
        slot.stopping = True
        slot.worker.process.send_signal(signal.SIGTERM)
        if detail.startswith("kill:"):
            slot.kill_at = time.monotonic() + float(detail.split(":")[1])
        slot.second_signal = detail == "twice"
        return slot.worker.name

    def _follow_drain(self, slot: Slot, now: float) -> None:
        """The rest of a drain fault on a running worker: its kill, or its second signal
        (sent once the drain began: one sent before merges with the first)."""
        assert slot.worker is not None
        if slot.kill_at is not None and now >= slot.kill_at:
            slot.kill_at = None
            slot.worker.kill()
        elif slot.second_signal and "draining" in slot.worker.log()[-4000:]:
            slot.second_signal = False
            slot.worker.process.send_signal(signal.SIGTERM)

    def kill(self, kind: str, target: int) -> str | None:
        slot = self._pick(kind, target)
        if slot is None or slot.worker is None:
            return None
        slot.worker.kill()
        return slot.worker.name

    def freeze(self, kind: str, target: int, for_s: float) -> str | None:
        slot = self._pick(kind, target)
        if slot is None or slot.worker is None or slot.worker.process.poll() is not None:
            return None
        pid = slot.worker.process.pid
        if pid in self.frozen:
            return None
        self._signal_pid_group(pid, signal.SIGSTOP)
        self.frozen[pid] = time.monotonic() + for_s
        return slot.worker.name

    def _pick(self, kind: str, target: int) -> Slot | None:
        slots = self.of_kind(kind)
        return slots[target % len(slots)] if slots else None

    @staticmethod
    def _signal_pid_group(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)

    def describe(self) -> str:
        """Each worker: its name, whether it runs, and its processes' exit statuses."""
        parts = []
        for slot in self.slots:
            if slot.worker is not None:
                state = "running" if slot.worker.process.poll() is None else "dead"
                parts.append(f"{slot.worker.name} {state} exits {slot.exits}")
        return "; ".join(parts)

    def restarts(self) -> int:
        return sum(len(slot.exits) for slot in self.slots)

    def stop(self) -> None:
        for pid in list(self.frozen):
            self._signal_pid_group(pid, signal.SIGCONT)
        self.frozen.clear()
        for slot in self.slots:
            if slot.worker is None:
                continue
            slot.worker.stop()

    def logs(self, n_chars: int = 3000) -> str:
        parts = []
        for slot in self.slots:
            if slot.worker is not None:
                parts.append(
                    f"--- {slot.worker.name} ({slot.kind}), exits {slot.exits}\n"
                    f"{slot.worker.log()[-n_chars:]}"
                )
        return "\n".join(parts)
