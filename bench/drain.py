"""A generate worker stopped mid-answer at real lengths: how long until it exits, and how
much decode is thrown away? (not a test; a measurement, docs/design/placement.md, "Drain and
pause").

One SGLang stand-in at a real time scale (32 running slots, 20 ms per token per request)
answers 66 prompts of 1,600 to 2,400 tokens (~40 s each). A `regen worker generate` at
its defaults runs them; when every slot is ~15 s into its answer, it gets SIGTERM (as
`docker stop`, Slurm and Kubernetes send it), and SIGKILL 30 s later if it is still
running (their default grace). A second worker then finishes the job. Printed:

- exit: seconds from the SIGTERM to the worker's exit, and how (its status, or killed);
- thrown away: the share of the job's decode (busy slot seconds) the server spent on
  answers whose client went away or that were answered again from their start;
- moved: answers handed back to the queue with their tokens so far;
- span: from the first request to the job's last answer (every prompt answered once is
  checked; that each moved answer is one server's is tests/generate/test_drain.py's job).

`--python` runs the workers with another checkout's interpreter (a venv with that
checkout installed), so the code before a change runs side by side with it:

    python bench/drain.py [--python OTHER/.venv/bin/python] [--scale 1]

`--scale 10` divides answer lengths and waits by 10 (seconds, not minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from regen.common import jobspec  # noqa: E402
from tests.support.generate_harness import all_generated, enqueued_ids, results  # noqa: E402
from tests.support.helpers import wait_for  # noqa: E402
from tests.support.redis_server import running_redis  # noqa: E402
from tests.support.sglang_standin import run_standin  # noqa: E402

SLOTS = 32
TOKENS_PER_S = 50  # 20 ms per token per request
PROMPTS = 66
GRACE_S = 30.0  # Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds


def lengths(scale: int) -> list[int]:
    """1,600 to 2,400 tokens, spread evenly (~40 s each at full scale)."""
    return [(1600 + (800 * i) // (PROMPTS - 1)) // scale for i in range(PROMPTS)]


def regen(python: str, *args: str) -> list[str]:
    """`regen ARGS` of the checkout `python` runs (started in the run's folder, so that
    this checkout's own `regen/` is not on its path)."""
    return [python, "-m", "regen", *args]


def enqueue(python: str, url: str, folder: Path, prompts: list[str]) -> None:
    """The job, enqueued by the checkout under test (a job spec is read by the regen
    that wrote it or a newer one)."""
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    subprocess.run(
        regen(python, "enqueue", str(data), "--job", "g", "--model", "smollm2",
              "--max-new-tokens", "4096", "--redis-url", url),
        cwd=folder, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip


def start_worker(
    python: str, url: str, server: str, folder: Path, log: str
) -> subprocess.Popen[bytes]:
    with open(folder / log, "ab") as out:
        return subprocess.Popen(
            regen(python, "worker", "generate", "--redis-url", url,
                  "--engine", "sglang", "--server", server, "--jobs", "g"),
            cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": ""},
        )  # fmt: skip


def stop(worker: subprocess.Popen[bytes]) -> tuple[float, str]:
    """SIGTERM, then SIGKILL after GRACE_S: (seconds to exit, how it ended)."""
    start = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    try:
        code = worker.wait(timeout=GRACE_S)
        return time.monotonic() - start, f"exit {code}"
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        return time.monotonic() - start, "killed (SIGKILL after 30 s)"


def run(python: str, scale: int, folder: Path) -> dict[str, Any]:
    prompts = [
        f"[answer-length {n}] Question {i} on the tides." for i, n in enumerate(lengths(scale))
    ]
    with (
        running_redis(folder / "redis") as redis_server,
        run_standin(max_running_requests=SLOTS, decode_tokens_per_s=TOKENS_PER_S,
                    answer_length_from_prompt=True,
                    continuations_dir=str(folder / "cont")) as server,
    ):  # fmt: skip
        url = redis_server.url
        r = redis.Redis.from_url(url)
        enqueue(python, url, folder, prompts)
        spec = jobspec.load(r, "g")
        first = start_worker(python, url, server.url, folder, "first.log")
        wait_for(lambda: server.stats()["running"] == SLOTS, timeout=300, what="full slots")
        time.sleep(15 / scale)
        exit_s, how = stop(first)
        moved = server.stats()["moved_total"]
        second = start_worker(python, url, server.url, folder, "second.log")
        try:
            wait_for(lambda: all_generated(r, spec), timeout=1800, what="the job")
        finally:
            stop(second)
        stats = server.stats()
        log = server.slot_log()
        got = results(r, "g")
        assert sorted(x.id for x in got) == sorted(enqueued_ids(r, "g")), "not every prompt once"
    busy = sum(e["end"] - e["start"] for e in log if e["end"] is not None)
    wasted = stats["aborted_busy_s"] + stats["repeated_busy_s"]
    span = max(e["end"] for e in log if e["end"]) - min(e["start"] for e in log)
    return {"exit_s": exit_s, "how": how, "thrown_away": wasted / busy, "moved": moved,
            "resumed": sum(1 for x in got if x.resumed_tokens), "span_s": span}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the workers' interpreter")
    parser.add_argument("--scale", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = run(args.python, args.scale, Path(folder))
    print(f"python {args.python}, scale {args.scale}")
    print(f"  exit after SIGTERM: {out['exit_s']:.1f} s ({out['how']})")
    print(f"  decode thrown away: {100 * out['thrown_away']:.2f}% of the job's busy slot time")
    print(f"  answers moved with their tokens so far: {out['moved']} "
          f"({out['resumed']} records continued one)")  # fmt: skip
    print(f"  span: {out['span_s']:.1f} s")


if __name__ == "__main__":
    main()
