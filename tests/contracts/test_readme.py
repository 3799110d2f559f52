"""The README's commands, run as written.

Its ```bash blocks carry a marker after the language that says how each is checked:
- none: run, in order, with `set -euo pipefail`; each must exit 0;
- `daemon`: long-running processes: each line is started, the test waits for what it is
  for (the job done, the metrics served), and at the end each must stop cleanly on SIGTERM;
- `site`: the variables a user sets for their site; the test sets the same ones to its
  own (a Redis, a Kimi-format tokenizer, a dataset, an out folder, an SGLang stand-in);
- `gpu` (an SGLang server), `docker` (compose), `self` (the two commands: CI runs the
  test one, tests/ops/test_demo.py the demo): not run here.
Every `regen` command in any block, run or not, is checked against the CLI.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import zstandard

from regen.common import jobspec
from regen.ops import status_snapshot
from tests.contracts.test_compose import cli_problems
from tests.support.helpers import wait_for
from tests.support.redis_server import RedisServer
from tests.support.sglang_standin.process import run_standin

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
MARKERS = {"", "daemon", "site", "gpu", "docker", "self"}
JOB = "k26-run1"
METRICS_PORT = 9102
GRACE_S = 30


@dataclass(frozen=True)
class Block:
    marker: str
    text: str

    def commands(self) -> list[str]:
        """Its commands: continuation lines joined, comments and blank lines dropped."""
        joined = self.text.replace("\\\n", " ")
        return [
            line.split(" # ")[0].strip()
            for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")
        ]


def blocks() -> list[Block]:
    return [
        Block(marker.strip(), text)
        for marker, text in re.findall(r"^```bash([^\n]*)\n(.*?)^```$", README, re.M | re.S)
    ]


def site_variables() -> dict[str, str]:
    (site,) = [b for b in blocks() if b.marker == "site"]
    pairs = [shlex.split(c.removeprefix("export "))[0] for c in site.commands()]
    return dict(pair.split("=", 1) for pair in pairs)


# --- fast checks --------------------------------------------------------------------------


def test_the_readme_is_short_and_every_block_is_marked_as_one_the_test_knows() -> None:
    assert len(README.splitlines()) <= 250
    assert [b.marker for b in blocks() if b.marker not in MARKERS] == []
    assert not re.search(r"^```(?!bash|$)\w", README, re.M), "a fenced block of another shell"


def test_the_two_commands_are_the_ones_ci_and_the_demo_test_run() -> None:
    (two,) = [b for b in blocks() if b.marker == "self"]
    assert two.commands() == [
        "bash scripts/setup.sh && .venv/bin/regen demo",
        "bash scripts/test.sh",
    ]
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()
    assert '"regen", "demo"' in (REPO / "tests" / "ops" / "test_demo.py").read_text()


def test_every_regen_command_in_the_readme_is_one_the_cli_takes() -> None:
    problems = []
    for block in blocks():
        for command in block.commands():
            for part in command.split("&&"):
                argv = shlex.split(part)
                if argv and argv[0] == "regen":
                    problems += cli_problems(argv[1:])
    assert problems == []
    assert sum(c.startswith("regen ") for b in blocks() for c in b.commands()) >= 15


# --- the README, run ----------------------------------------------------------------------


def write_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": f"Name a prime number above {i * 10}."}]}
            for i in range(6)]  # fmt: skip
    raw = b"".join(orjson.dumps(row) + b"\n" for row in rows)
    (folder / "prompts.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    return folder


def job_done(r: redis.Redis) -> bool:
    if JOB not in jobspec.list_jobs(r):
        return False
    prompts = status_snapshot.snapshot(r, job=JOB)["jobs"][0]["prompts"]
    return bool(prompts["total"]) and prompts["done"] + prompts["dead_lettered"] == prompts["total"]


def metrics_served() -> bool:
    try:
        url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
        return "regen_job_prompts{" in httpx.get(url, timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return False


@pytest.fixture
def site(
    redis_server: RedisServer, kimi_tokenizer_dir: Path, tmp_path: Path
) -> Iterator[dict[str, str]]:
    """The site the README's variables describe, on this machine."""
    url = redis_server.url.rsplit("/", 1)[0] + "/8"  # a database of its own
    redis.Redis.from_url(url).flushdb()
    options: dict[str, Any] = {"tokenizer": str(kimi_tokenizer_dir), "trust_remote_code": True,
                               "think": True, "output_len_dist": "fixed:n=40",
                               "context_length": 262_144}  # fmt: skip
    with run_standin(**options) as server:
        yield {
            "REGEN_REDIS_URL": url,
            "MODEL": str(kimi_tokenizer_dir),
            "DATA": str(write_dataset(tmp_path / "data")),
            "OUT": str(tmp_path / "out"),
            "SGLANG_URL": server.url,
        }


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block.text],
                          cwd=cwd, env=env, capture_output=True, timeout=600)  # fmt: skip
    return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def start(command: str, cwd: Path, env: dict[str, str], n: int) -> subprocess.Popen[bytes]:
    with open(cwd / f"daemon-{n}.log", "wb") as log:
        return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env,
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


@pytest.mark.slow
def test_the_readme_runs_as_written(site: dict[str, str], tmp_path: Path) -> None:
    assert set(site) == set(site_variables())
    env = {**os.environ, **site, "REGEN_HOME": str(tmp_path / "home"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
    r = redis.Redis.from_url(site["REGEN_REDIS_URL"])
    daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
    ran = []
    try:
        for i, block in enumerate(blocks()):
            if block.marker == "":
                code, output = run_block(block, tmp_path, env)
                assert code == 0, f"README block {i}:\n{block.text}\n{output}"
                ran += block.commands()
            elif block.marker == "daemon":
                for command in block.commands():
                    daemons.append((command, start(command, tmp_path, env, len(daemons))))
                    ran.append(command)
                if any("worker generate" in c for c in block.commands()):
                    wait_for(lambda: job_done(r), timeout=300, what="the job done")
                if any("metrics serve" in c for c in block.commands()):
                    wait_for(metrics_served, timeout=60, what="the job metrics served")
                for command, process in daemons:
                    # The follower alone leaves by itself, once the job is done.
                    left = process.poll() == 0 and "--follow" in command and job_done(r)
                    assert process.poll() is None or left, f"{command} exited early"
    finally:
        # Each stops within the grace Slurm, Kubernetes and compose give a SIGTERM
        # before the SIGKILL (30 s), having committed what it holds.
        codes = {}
        for command, process in daemons:
            process.send_signal(signal.SIGTERM)
            try:
                codes[command] = process.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                codes[command] = process.wait()
    assert codes and set(codes.values()) == {0}, codes
    # What the commands left is what the README says they do.
    assert any(c.startswith("regen shards export") for c in ran)
    assert (tmp_path / "sf.jsonl").read_text().count("\n") == 6
    assert (tmp_path / "sf-8k.heldout.jsonl").exists()
