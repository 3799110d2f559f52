"""A real one-node Slurm cluster for tests: Debian's `slurm-wlm` and `munge` (Slurm
22.05), run as root in a temporary folder (what a site runs: deploy/slurm/).

munged runs as the munge user with a key of its own, slurmctld and slurmd as root, each
in the foreground as a child of the test, on free ports, with every state, spool, log and
pid file under the folder: nothing of the host's own Slurm or munge is used or changed,
and two test sessions on one host each get a cluster of their own. Clients find it
through SLURM_CONF (`SlurmCluster.env`, or `run`)."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.redis_server import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "sinfo", "squeue")
# Where Debian puts the daemons: /usr/sbin is not on every user's PATH.
SBIN = ("/usr/sbin", "/sbin")
# A requeued job waits this long before it may run again (Slurm's default is 120 s, the
# lifetime of a job credential; a test of requeues cannot wait that long each time).
CRED_EXPIRE_S = 5
# How often the scheduler looks at pending jobs (default 60 s): a requeued job becomes
# eligible CRED_EXPIRE_S after its requeue, and only a scheduler pass starts it.
SCHED_INTERVAL_S = 1
# The node's GPUs, as generate.sbatch asks (--gres=gpu:8): gres.conf names empty files as
# their devices (slurmd logs that they are no devices, and counts them), so the job is
# allocated as on a GPU node and a second one waits for the first.
GPUS = 8
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def find(binary: str) -> str | None:
    return shutil.which(binary) or shutil.which(binary, path=os.pathsep.join(SBIN))


def unavailable() -> str | None:
    """Why no cluster can run here (for a skip), or None."""
    if os.geteuid() != 0:
        return "a test Slurm cluster runs as root (SlurmUser=root), and this is not root"
    missing = [b for b in (*DAEMONS, *CLIENTS) if find(b) is None]
    if missing:
        return (
            f"Slurm or munge is not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm munge"
        )
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package makes it)"
    return None


@dataclass
class SlurmCluster:
    folder: Path
    host: str = field(default_factory=socket.gethostname)
    partition: str = "main"
    _munge_dir: Path | None = None
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.folder / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's clients (sbatch, scontrol ...): this cluster's
        SLURM_CONF and /usr/sbin on the PATH."""
        path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path}

    def start(self) -> SlurmCluster:
        for sub in ("etc", "state", "spool", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_config()
        conf = str(self.conf)
        self._spawn("slurmctld", [find("slurmctld") or "slurmctld", "-D", "-f", conf])
        self._spawn("slurmd", [find("slurmd") or "slurmd", "-D", "-f", conf])
        self._wait(self._node_idle, "the node to be idle in sinfo")
        return self

    def _start_munge(self) -> None:
        # Its own folder straight under /tmp: munged, as the munge user, must reach the
        # socket, which pytest's root-only tmp_path would hide, and checks that the
        # folder holding its socket is open to everyone (0755) and its key is its own.
        self._munge_dir = Path(tempfile.mkdtemp(prefix="regen-munge-"))
        self._munge_dir.chmod(0o755)
        key = self._munge_dir / "munge.key"
        key.write_bytes(os.urandom(128))  # what `mungekey -c` writes: 1024 random bits
        key.chmod(0o400)
        munge = pwd.getpwnam("munge")
        for path in (self._munge_dir, key):
            os.chown(path, munge.pw_uid, munge.pw_gid)
        where = self._munge_dir
        self._spawn(
            "munged",
            [find("munged") or "munged", "--foreground", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--log-file={where / 'munged.log'}",
             f"--pid-file={where / 'munged.pid'}", f"--seed-file={where / 'munged.seed'}"],
            user=munge.pw_uid, group=munge.pw_gid,
        )  # fmt: skip
        self._wait(self.munge_socket.exists, "munged's socket")

    @property
    def munge_socket(self) -> Path:
        assert self._munge_dir is not None
        return self._munge_dir / "munge.sock"

    def _write_config(self) -> None:
        f, host = self.folder, self.host
        self.conf.write_text(
            f"ClusterName=regentest\n"
            f"SlurmctldHost={host}(127.0.0.1)\n"
            f"SlurmctldPort={free_port()}\nSlurmdPort={free_port()}\n"
            "AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
            "SlurmUser=root\nSlurmdUser=root\nReturnToService=2\nMpiDefault=none\n"
            "JobAcctGatherType=jobacct_gather/none\nMailProg=/bin/true\n"
            "GresTypes=gpu\n"
            f"SchedulerParameters=sched_interval={SCHED_INTERVAL_S}\n"
            # Take the node as written here, whatever this host has: a CI machine with
            # fewer cores or less memory must not drain it.
            "SlurmdParameters=config_overrides\n"
            f"StateSaveLocation={f / 'state'}\nSlurmdSpoolDir={f / 'spool'}\n"
            f"SlurmctldPidFile={f / 'slurmctld.pid'}\nSlurmdPidFile={f / 'slurmd.pid'}\n"
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}\n"
            f"SlurmdLogFile={f / 'log' / 'slurmd.log'}\n"
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=20000 "
            f"Gres=gpu:{GPUS} State=UNKNOWN\n"
            f"PartitionName={self.partition} Nodes={host} Default=YES MaxTime=INFINITE "
            "State=UP\n"
        )
        # slurmd reads cgroup.conf beside slurm.conf even with no cgroup plugin in use;
        # 22.05 has no "disabled" plugin, and automount would touch the host's cgroups.
        (self.folder / "etc" / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"
        )
        dev = self.folder / "dev"
        dev.mkdir(exist_ok=True)
        for i in range(GPUS):
            (dev / f"nvidia{i}").touch()
        (self.folder / "etc" / "gres.conf").write_text(
            f"Name=gpu File={dev}/nvidia[0-{GPUS - 1}]\n"
        )

    def _spawn(
        self, name: str, argv: list[str], user: int | None = None, group: int | None = None
    ) -> None:
        with open(self.folder / "log" / f"{name}.out", "ab") as log:
            self._processes[name] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, user=user, group=group
            )

    def _wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            for name, process in self._processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode}):\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        done = self.run("sinfo", "--noheader", "--Node", "--format=%T", check=False)
        return done.returncode == 0 and done.stdout.strip() == "idle"

    def logs(self, n_chars: int = 3000) -> str:
        """The tail of each daemon's log, for a failure's message."""
        tails = []
        for path in sorted((self.folder / "log").glob("*")):
            tails.append(f"--- {path.name}\n{path.read_text(errors='replace')[-n_chars:]}")
        return "\n".join(tails)

    # --- clients -----------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        done = subprocess.run(
            [find(argv[0]) or argv[0], *argv[1:]],
            env=self.env, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.returncode}\n{done.stderr}")
        return done

    def sbatch(self, *argv: str, env: dict[str, str] | None = None) -> int:
        """Submit; the job id. `env` goes over this cluster's client environment (sbatch
        hands the job the environment it was run with)."""
        done = subprocess.run(
            [find("sbatch") or "sbatch", "--parsable", *argv],
            env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=30,
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(argv)}: {done.returncode}\n{done.stderr}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as KEY: value (JobState, Restarts, RunTime, Reason ...)."""
        out = self.run("scontrol", "--oneliner", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    # --- stop ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Kill every job (slurmd leaves a job's processes running when it stops), then
        the daemons, then munged; the munge folder goes."""
        if "slurmctld" in self._processes and self._processes["slurmctld"].poll() is None:
            self.run("scancel", "--signal=KILL", f"--partition={self.partition}", check=False)
            with contextlib.suppress(RuntimeError):
                deadline = time.monotonic() + STOP_TIMEOUT_S
                while self.run("squeue", "--noheader", check=False).stdout.strip():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
        for name in reversed(list(self._processes)):  # slurmd, slurmctld, munged
            process = self._processes.pop(name)
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self._munge_dir is not None:
            shutil.rmtree(self._munge_dir, ignore_errors=True)


@contextlib.contextmanager
def slurm_cluster(folder: Path) -> Iterator[SlurmCluster]:
    """A started cluster, with SLURM_CONF set for the Slurm clients this process runs
    (sbatch, squeue ... from subprocess) until it stops; everything stopped at the end."""
    cluster = SlurmCluster(folder)
    before = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)
        yield cluster
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()
