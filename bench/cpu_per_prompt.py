"""regen's own CPU per prompt, per stage, against a near-zero-latency server.

Runs the SGLang stand-in with instant decoding and short answers, one real
`regen worker generate --engine sglang` and one real `regen worker tokenize` (drift
check on, the default), then `regen enqueue` of N short prompts, until every prompt is
committed to a shard. It reads each regen process's own CPU seconds (user + system, its
threads and children included; the stand-in's and Redis's are not regen's) and prints
CPU ms per prompt for each stage and summed, and the run's prompts/s.

- Workers: measured from the moment the producer starts to the last commit (their
  start-up, and a warm-up job that loads the tokenizer, come before).
- Producer: its steady part, from its first chunk in Redis to its exit; its start-up
  (imports, tokenizer load) is printed apart (`bench/startup.py` measures that).

On shared cores wall time depends on the neighbours and the stand-in's own CPU; CPU
seconds per prompt much less, but they still move with the host: the same code measured
minutes apart on this 2-core machine varied by up to 1.5x. So the bench runs several
jobs (`--rounds`) on the same workers and prints each and the median, and before each
round times a fixed pure-Python loop (`reference`), which shows how fast the host was
then. Run from the repository root:

    python bench/cpu_per_prompt.py [--prompts 20000] [--rounds 3] [--py-spy DIR]

`--py-spy DIR` also samples each stage of the first round with py-spy (on PATH) into
DIR/STAGE-N.txt, collapsed stacks of the threads holding the GIL (where Python spends CPU).

`--fleet` runs the same jobs on a mixed fleet instead: two stand-ins of 32 slots, one 16x
slower than the other (FLEET_MS_PER_TOKEN: 16x), one generate worker each. Prompts then wait in
the slow worker while the fast one has idle slots, so unstarted prompts are given back
(docs/design/placement.md, "Only what can start soon"): the run shows what that costs per prompt in
CPU and in Redis commands.

Each round also prints Redis's commands per prompt (every client's, heartbeats and idle
polls included) and the bytes the job leaves in Redis per prompt once committed.

The target is <= 1 ms summed over the stages.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path

import orjson
import psutil
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from regen.common import defaults, keys  # noqa: E402
from tests.support.generate_harness import Worker  # noqa: E402
from tests.support.redis_server import running_redis  # noqa: E402
from tests.support.sglang_standin.process import StandinHandle, run_standin  # noqa: E402

WARMUP_PROMPTS = 128
# The workers run with regen's own lease and sweep settings, not the tests' short ones.
PRODUCT_SETTINGS = {
    "REGEN_VISIBILITY_TIMEOUT": str(defaults.VISIBILITY_TIMEOUT_S),
    "REGEN_RESTORE_INTERVAL": str(defaults.UNACKED_RESTORE_INTERVAL_S),
    "REGEN_RESTORE_THROTTLE": str(defaults.UNACKED_RESTORE_THROTTLE),
    "HF_HUB_OFFLINE": "1",
}
TIMEOUT_S = 1800.0
STAGES = ("producer", "generate", "tokenize")
# --fleet: ms per token of each server; 16-token answers take 32 and 512 ms on 32 slots.
FLEET_MS_PER_TOKEN = (2.0, 32.0)
FLEET_SLOTS = 32


def reference_loop_ms() -> float:
    """CPU ms of a fixed pure-Python loop: how fast the host runs Python right now."""
    started = time.process_time()
    total = 0
    for i in range(2_000_000):
        total += i * i
    return (time.process_time() - started) * 1000


def cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU of the process, its threads and its waited-for children."""
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def wait_until(condition: Callable[[], bool], what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(poll_s)


def committed(r: redis.Redis, job: str) -> int:
    return int(r.hget(keys.job_counters(job), keys.COMMITTED_PROMPTS) or 0)


def write_rows(path: Path, n: int, tag: str) -> Path:
    path.write_bytes(
        b"".join(orjson.dumps({"prompt": f"{tag} {i}: name one fact about {i}."}) + b"\n"
                 for i in range(n))
    )  # fmt: skip
    return path


class Stage:
    """A regen process being measured, its log in a file."""

    def __init__(self, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.popen = popen
        self.process = psutil.Process(popen.pid)
        self.log = log

    def sample(self, profile: Path) -> None:
        """py-spy samples it until it exits (or is stopped) into `profile`."""
        subprocess.Popen(
            ["py-spy", "record", "--pid", str(self.popen.pid), "--format", "raw",
             "--nonblocking", "--gil", "--threads", "--output", str(profile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def cpu(self) -> float:
        return cpu_seconds(self.process)

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.log.name} exited:\n{self.log.read_text()[-3000:]}")


def enqueue(url: str, rows: Path, job: str, log: Path) -> Stage:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "regen", "enqueue", str(rows), "--job", job,
               "--model", "smollm2", "--redis-url", url]  # fmt: skip
    with log.open("ab") as out:
        popen = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Stage(popen, log)


def standins(args: argparse.Namespace) -> list[AbstractContextManager[StandinHandle]]:
    """One instant server with room for everything, or the --fleet's two slot-bound ones."""
    dist = f"fixed:n={args.output_tokens}"
    if not args.fleet:
        return [run_standin(max_running_requests=4096, decode_tokens_per_s=0.0,
                            output_len_dist=dist)]  # fmt: skip
    return [run_standin(max_running_requests=FLEET_SLOTS, decode_tokens_per_s=1000.0 / ms,
                        output_len_dist=dist) for ms in FLEET_MS_PER_TOKEN]  # fmt: skip


def run(args: argparse.Namespace, tmp: Path) -> None:
    with (
        running_redis(tmp / "redis") as redis_server,
        ExitStack() as stack,
    ):
        servers = [stack.enter_context(standin) for standin in standins(args)]
        url = redis_server.url
        generate = [stack.enter_context(Worker(url, tmp, "--engine", "sglang", "--server",
                                               server.url, env=PRODUCT_SETTINGS))
                    for server in servers]  # fmt: skip
        tokenize = stack.enter_context(
            Worker(url, tmp, "--out", str(tmp / "out"), "--idle-commit", "0.5",
                   env=PRODUCT_SETTINGS, kind="tokenize")
        )  # fmt: skip
        r = redis.Redis.from_url(url)
        workers = [(worker.kind, Stage(worker.process, worker.log_path))
                   for worker in (*generate, tokenize)]  # fmt: skip
        # A warm-up job: the workers have found jobs and loaded the tokenizer.
        warm = enqueue(url, write_rows(tmp / "warm.jsonl", WARMUP_PROMPTS, "Warm-up"),
                       "warmup", tmp / "warmup.log")  # fmt: skip
        warm.popen.wait()

        def warmed() -> bool:
            for _, stage in workers:
                stage.check_alive()
            return committed(r, "warmup") == WARMUP_PROMPTS

        wait_until(warmed, "the warm-up job")
        fleet = (f"a fleet of {len(servers)} servers of {FLEET_SLOTS} slots at "
                 f"{', '.join(f'{ms:g}' for ms in FLEET_MS_PER_TOKEN)} ms per token"
                 if args.fleet else "one near-zero-latency stand-in")  # fmt: skip
        print(f"{args.prompts} prompts a round, drift check on, {fleet}")
        rounds = []
        for number in range(1, args.rounds + 1):
            reference = reference_loop_ms()
            profile = args.py_spy if number == 1 else None
            cpu = measure(args, tmp, url, r, workers, f"bench-{number}", profile)
            report(f"round {number}", args.prompts, cpu)
            print(f"  reference loop before it: {reference:.0f} ms CPU")
            rounds.append(cpu)
        median = {name: statistics.median(cpu[name] for cpu in rounds) for name in STAGES}
        report(f"median of {args.rounds} rounds", args.prompts, median)
        opened = sum(server.stats()["connections_total"] for server in servers)
        print(f"  stand-ins: {opened} connections opened")


def measure(
    args: argparse.Namespace,
    tmp: Path,
    url: str,
    r: redis.Redis,
    workers: list[tuple[str, Stage]],
    job: str,
    profile: Path | None,
) -> dict[str, float]:
    """One job of args.prompts prompts: CPU seconds of each stage."""
    rows = write_rows(tmp / f"{job}.jsonl", args.prompts, f"Prompt of {job}")
    before = [stage.cpu() for _, stage in workers]
    redis_before = RedisCost.read(r)
    started = time.monotonic()
    producer = enqueue(url, rows, job, tmp / f"{job}.log")
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        for index, (name, stage) in enumerate([("producer", producer), *workers]):
            stage.sample(profile / f"{name}-{index}.txt")
    wait_until(lambda: bool(r.hlen(keys.job_chunks(job))) or producer.popen.poll() is not None,
               "the first chunk", poll_s=0.005)  # fmt: skip
    producer_start_up = producer.cpu()
    # The producer's own CPU is read at its exit from the kernel's account of the child.
    _, status, usage = os.wait4(producer.popen.pid, 0)
    producer.popen.returncode = os.waitstatus_to_exitcode(status)
    if producer.popen.returncode != 0:
        raise RuntimeError(f"regen enqueue failed:\n{producer.log.read_text()[-3000:]}")
    producer_total = usage.ru_utime + usage.ru_stime

    def done() -> bool:
        for _, stage in workers:
            stage.check_alive()
        return committed(r, job) >= args.prompts

    wait_until(done, "every prompt committed")
    wall = time.monotonic() - started
    redis_cost = RedisCost.read(r) - redis_before
    print(f"  {job}: producer start-up {producer_start_up:.2f} s CPU (not counted), "
          f"wall {wall:.1f} s = {args.prompts / wall:.0f} prompts/s (shared cores)")  # fmt: skip
    # Prompts given back unstarted go to the queue in new chunks (of at most
    # GIVEN_BACK_CHUNK_SIZE), beyond the producer's chunks of CHUNK_SIZE.
    published = math.ceil(args.prompts / defaults.CHUNK_SIZE)
    split_off = r.hlen(keys.job_chunks(job)) - published
    print(f"  Redis: {redis_cost.commands / args.prompts:.1f} commands and "
          f"{redis_cost.memory / args.prompts:.1f} B left per prompt; "
          f"{published} chunks published, {split_off} more of prompts given back")  # fmt: skip
    cpu = {name: 0.0 for name in STAGES}
    cpu["producer"] = producer_total - producer_start_up
    for (name, stage), cpu_before in zip(workers, before, strict=True):
        cpu[name] += stage.cpu() - cpu_before
    return cpu


@dataclass(frozen=True)
class RedisCost:
    """Redis's commands processed (every client's) and memory in use."""

    commands: int
    memory: int

    @classmethod
    def read(cls, r: redis.Redis) -> RedisCost:
        stats, memory = r.info("stats"), r.info("memory")
        return cls(int(stats["total_commands_processed"]), int(memory["used_memory"]))

    def __sub__(self, other: RedisCost) -> RedisCost:
        return RedisCost(self.commands - other.commands, self.memory - other.memory)


def report(title: str, n: int, cpu: dict[str, float]) -> None:
    print(title)
    for name in STAGES:
        seconds = cpu[name]
        print(f"  {name:9s} {seconds * 1000 / n:6.3f} ms CPU per prompt ({seconds:6.2f} s)")
    total = sum(cpu[name] for name in STAGES)
    print(f"  {'summed':9s} {total * 1000 / n:6.3f} ms CPU per prompt (target <= 1 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20_000, help="3000 for a quick run")
    parser.add_argument("--rounds", type=int, default=3, help="jobs measured, one after another")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--py-spy", type=Path, help="also profile each stage into this folder")
    parser.add_argument("--fleet", action="store_true",
                        help="two slot-bound servers, one 16x slower, a worker each")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="regen-cpu-bench-") as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
