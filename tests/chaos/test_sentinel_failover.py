"""A real job on a Redis Sentinel deployment survives a SIGKILL of its primary: every
process follows the promoted replica, and the job finishes with each prompt once and no
operator step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
import redis
from click.testing import CliRunner, Result

from regen.cli import main
from regen.common import connection, dlq, keys, settings
from regen.consumers.tokenize.shard_files import iter_ids, shard_paths
from tests.ops.test_metrics import try_scrape, value
from tests.support.generate_harness import REPO, Worker
from tests.support.helpers import committed_count, job_ids, wait_for, write_jsonl
from tests.support.sentinel_cluster import MASTER, sentinel_cluster
from tests.support.sglang_standin.process import free_port, run_standin
from tests.tokenize.test_redis_restore import TokenizeWorker

JOB = "sf"
PROMPTS = [f"Tell me fact number {i} about the wind." for i in range(96)]
# No prompt in it: an input dead letter, for `regen dlq` to find after the failover.
BAD_ROW = {"nothing": "here"}


def regen(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--redis-url", url], catch_exceptions=False)


def job_settled(r: redis.Redis) -> bool:
    total = len(job_ids(r, JOB))
    dead = sum(dlq.count(r, JOB, stage) for stage in keys.STAGES)
    return bool(
        total == len(PROMPTS)
        and committed_count(r, JOB) + dead >= total
        and not r.hlen(keys.pending_shards(JOB))
        and not r.xlen(keys.results_stream(JOB))
        and not r.hlen(keys.KOMBU_UNACKED)
    )


@pytest.mark.slow
def test_a_job_follows_its_primary_through_a_sentinel_failover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL of the primary mid-job, with the producer, a generate worker and a
    tokenize worker running: the job finishes, each prompt in exactly one place, and
    `regen verify` passes, with no process restarted and no `regen recover`.

    After it, each operator command (status, dlq, recover, verify) and a `regen metrics
    serve` started before the kill read the promoted replica.

    Replication is asynchronous, so a failover may lose the last writes: a rollback, which
    regen heals by itself (the chaos harness's sentinel_failover fault kills the primary
    without waiting). This test checks the failover itself: the primary's writes are paused
    (CLIENT PAUSE WRITE) until the replica's offset equals the primary's, then it is
    killed; the paused commands fail with the connection and their clients send them
    again to the new primary."""
    monkeypatch.setenv("REGEN_REDIS_SENTINEL_MASTER", MASTER)
    settings.load()
    out = tmp_path / "out"
    folder = out / JOB
    dataset = write_jsonl(tmp_path / "wind.jsonl", [*({"prompt": p} for p in PROMPTS), BAD_ROW])
    with sentinel_cluster(tmp_path / "redis") as cluster:
        url = cluster.url(db=0)
        r = connection.client(url)
        env = {**os.environ, "PYTHONPATH": str(REPO), "REGEN_REDIS_URL": url}
        # The producer, held by backpressure (4 chunks waiting) so it runs through the kill.
        enqueue_log = tmp_path / "enqueue.log"
        with open(enqueue_log, "wb") as log:
            producer = subprocess.Popen(
                [sys.executable, "-m", "regen", "enqueue", str(dataset), "--job", JOB,
                 "--model", "smollm2", "--max-new-tokens", "48", "--chunk-size", "4",
                 "--high-water", "4"],
                env=env, stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
        tokenize = TokenizeWorker(url, out, tmp_path / "tokenize.log")
        # `regen metrics serve`, started before the kill, reads the new primary after it.
        metrics_port = free_port()
        metrics_log = open(tmp_path / "metrics.log", "wb")  # noqa: SIM115 (closed below)
        metrics = subprocess.Popen(
            [sys.executable, "-m", "regen", "metrics", "serve", "--redis-url", url,
             "--host", "127.0.0.1", "--port", str(metrics_port), "--refresh", "1"],
            env=env, stdout=metrics_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        with run_standin(decode_tokens_per_s=40, output_len_dist="fixed:n=12") as sglang:
            generate = Worker(url, tmp_path, "--engine", "sglang", "--server", sglang.url,
                              "--jobs", JOB, "--concurrency", "1")  # fmt: skip
            processes = {"enqueue": producer, "tokenize": tokenize.process,
                         "generate": generate.process, "metrics": metrics}  # fmt: skip

            def all_running() -> None:
                for name, process in processes.items():
                    if name == "enqueue" and process.returncode == 0:
                        continue  # done
                    assert process.poll() in (None, 0), f"{name} exited {process.returncode}"

            try:
                wait_for(lambda: all_running() or r.hlen(keys.shards(JOB)) >= 2, timeout=180,
                         what="two shards committed")  # fmt: skip
                assert producer.poll() is None, "the producer finished before the kill"
                primary = redis.Redis(port=cluster.primary.port)
                primary.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
                wait_for(cluster.replica_in_sync, what="the replica in sync")
                shards_before = len(shard_paths(folder))
                killed_at = time.monotonic()
                cluster.primary.kill()

                first_commit_after: list[float] = []

                def a_commit_after_the_kill() -> bool:
                    all_running()
                    if len(shard_paths(folder)) > shards_before:
                        first_commit_after.append(time.monotonic() - killed_at)
                        return True
                    return False

                wait_for(a_commit_after_the_kill, timeout=180,
                         what="a commit after the failover")  # fmt: skip
                stall = first_commit_after[0]
                assert cluster.master_port() == cluster.replica.port
                print(f"\nfailover stall: {stall:.1f} s from the kill to the next commit")
                assert "unreachable" in enqueue_log.read_text(), "the kill missed the producer"

                def finished() -> bool:
                    all_running()
                    return producer.poll() == 0 and job_settled(r)

                wait_for(finished, timeout=300, what="the job to finish after the failover")
                all_running()

                seen: list[tuple[float | None, float | None]] = [(None, None)]

                def metrics_show_the_whole_job() -> bool:
                    all_running()
                    samples = try_scrape(metrics_port) or {}
                    seen[0] = (
                        value(samples, "regen_job_prompts", job=JOB, place="done"),
                        value(samples, "regen_dlq_entries", job=JOB, stage="input"),
                    )
                    return seen[0] == (len(PROMPTS), 1)

                try:
                    wait_for(metrics_show_the_whole_job, timeout=60,
                             what="regen metrics serve to report the finished job")  # fmt: skip
                except AssertionError:
                    log = (tmp_path / "metrics.log").read_text(errors="replace")[-3000:]
                    raise AssertionError(f"metrics (done, dlq) {seen[0]}; log:\n{log}") from None
            finally:
                generate.stop()
                tokenize.stop()
                metrics.send_signal(signal.SIGTERM)
                metrics.wait(timeout=60)
                metrics_log.close()
                if producer.poll() is None:
                    producer.kill()
        # The operator commands, each a new client of the promoted replica.
        assert cluster.master_port() == cluster.replica.port
        status = regen(url, "status", "--job", JOB)
        assert status.exit_code == 0, status.output
        listed = regen(url, "dlq", "list", "--job", JOB, "--json")
        assert listed.exit_code == 0, listed.output
        letters = [orjson.loads(line) for line in listed.output.splitlines() if line.strip()]
        assert [letter["stage"] for letter in letters] == ["input"], listed.output
        recovered = regen(url, "recover", "--job", JOB, "--out", str(out))
        assert recovered.exit_code == 0, recovered.output  # safe to rerun: nothing to mend
        verified = regen(url, "verify", "--job", JOB, "--shards-dir", str(folder))
        assert verified.exit_code == 0, verified.output
        counts = Counter(pid for path in shard_paths(folder) for pid in iter_ids(path))
        assert max(counts.values()) == 1, "an id twice in the shards"
        assert set(counts) == job_ids(r, JOB)  # a row of no prompt gets no prompt id
        assert len(counts) == len(PROMPTS)
