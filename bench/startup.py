"""Benchmark the first-call start-up of `regen enqueue`: the tokenizer load and the
embedded Redis start, cold and warm, each in a fresh process as a user's command runs.

- tokenizer, cold: an empty `$REGEN_HOME` (the GGUF vocabulary is converted, then cached);
- tokenizer, warm: the same home again (the cached conversion is loaded);
- embedded Redis: `ensure_running` with no server up (its data folder already there, as
  on every call after the first), then a whole warm `regen enqueue` of a few rows.

Run from the repository root:

    python bench/startup.py [--repeat 3]

The target is < 2 s for each warm step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent

TOKENIZER_LOAD = """
import time
started = time.perf_counter()
from regen.common.tokenizer import load_tokenizer
load_tokenizer("smollm2")
print(time.perf_counter() - started)
"""
REDIS_START = """
import time
from regen.common.embedded_redis import EmbeddedRedis
server = EmbeddedRedis.from_env()
started = time.perf_counter()
server.ensure_running(quiet=True)
print(time.perf_counter() - started)
"""
REDIS_STOP = """
from regen.common.embedded_redis import EmbeddedRedis
EmbeddedRedis.from_env().stop()
"""


def timed_script(script: str, env: dict[str, str]) -> float:
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return float(run.stdout.strip().splitlines()[-1])


def timed_command(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(args, env=env, capture_output=True, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "REGEN_HOME": home,
            "REGEN_EMBEDDED_PORT": "16399",
        }
        cold = timed_script(TOKENIZER_LOAD, env)
        warm = [timed_script(TOKENIZER_LOAD, env) for _ in range(args.repeat)]
        starts = []
        for _ in range(args.repeat):
            starts.append(timed_script(REDIS_START, env))
            subprocess.run([sys.executable, "-c", REDIS_STOP], env=env, check=True)
        rows = Path(home) / "rows.jsonl"
        rows.write_bytes(b"".join(orjson.dumps({"prompt": f"Say {i}."}) + b"\n" for i in range(8)))
        enqueues = []
        try:
            for attempt in range(args.repeat):
                command = [sys.executable, "-m", "regen", "enqueue", str(rows),
                           "--job", f"startup-{attempt}", "--model", "smollm2"]  # fmt: skip
                enqueues.append(timed_command(command, env))
        finally:
            subprocess.run([sys.executable, "-c", REDIS_STOP], env=env, check=True)
    print(f"tokenizer load, cold (conversion):  {cold:6.2f} s")
    print(f"tokenizer load, warm (median of {args.repeat}): {statistics.median(warm):6.2f} s")
    print(f"embedded Redis start (median of {args.repeat}): {statistics.median(starts):6.2f} s")
    print(
        f"whole `regen enqueue` of 8 rows, warm, Redis started by the first "
        f"(median of {args.repeat}): {statistics.median(enqueues):6.2f} s"
    )


if __name__ == "__main__":
    main()
