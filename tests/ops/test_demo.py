"""`regen demo` end to end, as the README runs it: embedded Redis, real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.common.embedded_redis import EmbeddedRedis
from regen.consumers.tokenize.shard_files import iter_records, shard_paths
from regen.ops.shards_inspect import verify
from tests.support.generate_harness import REPO
from tests.support.redis_server import free_port, running_redis
from tests.support.sglang_standin.process import run_standin

pytestmark = pytest.mark.slow


def run_demo(tmp_path: Path, *args: str) -> tuple[str, Path]:
    env = {**os.environ, "REGEN_HOME": str(tmp_path / "home"),
           "REGEN_EMBEDDED_PORT": str(free_port()), "COLUMNS": "120"}  # fmt: skip
    env.pop("REGEN_REDIS_URL", None)
    embedded = EmbeddedRedis(home=Path(env["REGEN_HOME"]).absolute(),
                             port=int(env["REGEN_EMBEDDED_PORT"]))  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "regen", "demo", "--out", str(tmp_path / "out"), *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        left_running = embedded.running()
    finally:
        embedded.stop()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The demo started the embedded Redis, so it stops it, and says so last (#29).
    assert not left_running
    assert done.stdout.rstrip().splitlines()[-1].startswith("Stopped the embedded Redis")
    (folder,) = [p for p in (tmp_path / "out").iterdir() if p.name.startswith("demo-")]
    return done.stdout, folder


def check_output(stdout: str, folder: Path) -> None:
    assert "summary" in stdout and "records in shards" in stdout
    assert "loss_mask 1" in stdout  # the decoded record and where its mask turns on
    assert "rejected empty_content: 1" in stdout and "duplicates 1" in stdout
    assert verify(folder) == []
    records = [r for shard in shard_paths(folder) for r in iter_records(shard)]
    assert records
    for record in records:
        assert record["loss_mask"][-1] == 1
        # An answer cut by the demo's small max_new_tokens is kept, flagged.
        assert (record["finish_reason"] == "length") == ("truncated" in record["flags"])
    assert "Done: every prompt is accounted for." in stdout
    # The two tool-use rows render with their tools; each answers its tool's result.
    tool_records = [record for record in records if "tools" in record]
    assert 1 <= len(tool_records) <= 2
    for record in tool_records:
        assert [m["role"] for m in record["messages"][-3:]] == ["assistant", "tool", "assistant"]
        assert record["messages"][-3]["tool_calls"]


def test_the_demo_against_an_sglang_server(tmp_path: Path) -> None:
    with run_standin() as server:
        stdout, folder = run_demo(tmp_path, "--engine", "sglang", "--server", server.url)
    check_output(stdout, folder)


# A real model on the CPU: ~2 min on 2 idle cores, more beside other work; the suite's
# 300 s default would fail a slow machine, not a broken demo (run_demo stops at 900 s).
@pytest.mark.timeout(900)
def test_the_demo_on_the_local_engine(tmp_path: Path) -> None:
    # The README's command, with shorter answers to keep the suite quick.
    stdout, folder = run_demo(tmp_path, "--max-new-tokens", "96")
    check_output(stdout, folder)
    assert "engine local" in stdout


def children_cmdlines(pid: int) -> list[str]:
    """The command lines of a process's children, as any user of the host sees them."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # the process has ended
        return []
    lines = []
    for child in children:
        try:
            lines.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # ended meanwhile
            continue
    return lines


def test_the_demo_keeps_the_redis_password_out_of_worker_command_lines(tmp_path: Path) -> None:
    secret = "demo-s3cret-pw"
    with (
        running_redis(tmp_path / "redis", "--requirepass", secret) as redis_server,
        run_standin() as server,
    ):
        env = {**os.environ, "REGEN_HOME": str(tmp_path / "home"), "COLUMNS": "120",
               "REGEN_REDIS_URL": f"redis://:{secret}@127.0.0.1:{redis_server.port}/0"}  # fmt: skip
        demo = subprocess.Popen(
            [sys.executable, "-m", "regen", "demo", "--out", str(tmp_path / "out"),
             "--engine", "sglang", "--server", server.url],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        seen: set[str] = set()
        while demo.poll() is None:  # the workers live while the job runs
            seen.update(line for line in children_cmdlines(demo.pid) if " worker " in line)
            time.sleep(0.05)
        output = demo.stdout.read() if demo.stdout else ""
    assert demo.returncode == 0, output[-3000:]
    assert {"generate", "tokenize"} <= {line.split(" worker ")[1].split()[0] for line in seen}
    assert not [line for line in seen if secret in line], "a password in a worker's argv"
    assert secret not in output
