"""regen against SpecForge's `scripts/regenerate_train_data.py` on the same work, one
after the other in one run (not a test; a measurement, issue 30).

Each tool gets fresh SGLang stand-ins at a real time scale (32 running slots per server,
ms per token per request, lognormal answer lengths averaging 2,000 tokens, as
bench/long_generations.py starts them) and the same input file: one ShareGPT row per
prompt, `{"id", "conversations": [{"role": "user", "content": ...}]}`, which both read.
The stand-in's answer length is a hash of the prompt ids (tests/support/sglang_standin/
completer.py), and regen renders the ids SGLang's chat path renders for SpecForge's
`/v1/chat/completions` requests, so both tools get identical work; the bench checks it
(each prompt answered once on each side, the same output tokens per prompt).

Each tool runs at its own defaults: regen's `regen enqueue` with no `--chunk-size`, one
`regen worker generate` per server (`--max-inflight auto`) and one `regen worker
tokenize`; SpecForge's script with its `--concurrency 64` per server, round robin over
`--server-address`. Both are given the same `--max-new-tokens`/`--max-tokens`: 8x the
mean plus 64 (the stand-in's longest answer), so no answer is cut; both tools default
to 4096 (regen also gets `--context-length`, the stand-in's 65,536, since SmolLM2's own
config says 8,192).

Figures per tool:
- wall: from the tool's start to its last record written. regen: from `regen enqueue`,
  the workers started at the same instant (on a fleet, see `--first`), to the last
  shard's manifest time (the last
  record committed by the tokenize worker). SpecForge: from its start to its output
  file's last write (then it exits);
- span: the servers' first request start to last answer end (the stand-ins' slot logs);
- util: busy slot time / (slots x servers x span), and per server; per server also the
  answers it gave and when its last one ended (from the tool's start);
- cpu: user+sys of the tool's processes (regen: enqueue, workers and their children);
- overhead: wall - span; start: first request - tool start; end: last record - last
  answer.

Runs: `one` (one server at 20 ms per token) and `two-speed` (20 and 80 ms per token;
regen one generate worker per server; SpecForge both `--server-address` values), 264
prompts each. `--first` (two-speed, regen's side): `fast` or `slow` starts that
server's generate worker (and the tokenize worker) at the enqueue's instant and the
other once the first holds a chunk (as bench/long_generations.py starts its fleets), so
which worker meets the queue alone is known, not a race between two start-ups; `both`
(the default) runs regen's side twice, once each way, against one SpecForge run. Full
scale, `one` takes ~7 minutes per tool, `two-speed` ~5 minutes per regen side and ~18
for SpecForge. `--scale 10` divides answer lengths by 10 (under a minute a
tool; tests/ops/test_specforge_side_by_side.py runs it).

SpecForge's script is not in the `specforge` wheel: point `--specforge-script` at
`scripts/regenerate_train_data.py` in a SpecForge checkout (it imports
`conversation_validation.py` beside it) and `--specforge-python` at an interpreter with
`openai` and `tqdm` (default: this one). Without `--specforge-script` only regen runs.

    python bench/specforge_side_by_side.py \\
        --specforge-script ~/SpecForge/scripts/regenerate_train_data.py \\
        [--specforge-python ~/sf-env/bin/python] [--runs one,two-speed] [--scale 1] \\
        [--first fast|slow|both]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from math import nan
from pathlib import Path
from typing import Any

import orjson
import psutil
import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from long_generations import CONTEXT_LENGTH, standins  # noqa: E402

from regen.common import defaults, keys  # noqa: E402
from regen.common.chat_family import render_prompt_ids  # noqa: E402
from regen.common.ledger.commit_ledger import CommitLedger  # noqa: E402
from regen.common.tokenizer import load_tokenizer  # noqa: E402
from regen.consumers.tokenize.shard_files import read_manifest  # noqa: E402
from tests.support.generate_harness import Worker  # noqa: E402
from tests.support.redis_server import running_redis  # noqa: E402
from tests.support.sglang_standin.process import StandinHandle  # noqa: E402

RUNS = ("one", "two-speed")
# Which regen generate worker starts first on a fleet (see the module doc).
FIRST = ("fast", "slow", "both")
TOOLS = ("regen", "specforge")
JOB = "sbs"
MODEL = "smollm2"
# The delivery settings a deployment has (tests.support.generate_harness.Worker shortens them).
DEFAULT_DELIVERY = {
    "REGEN_VISIBILITY_TIMEOUT": str(defaults.VISIBILITY_TIMEOUT_S),
    "REGEN_RESTORE_INTERVAL": str(defaults.UNACKED_RESTORE_INTERVAL_S),
    "REGEN_RESTORE_THROTTLE": str(defaults.UNACKED_RESTORE_THROTTLE),
}
TIMEOUT_S = 3 * 3600.0


@dataclass(frozen=True)
class Side:
    tool: str
    run: str
    first: str  # whose regen worker started first (`--first`); "-": one server, SpecForge
    prompts: int
    records: int  # records written (regen: committed to shards; SpecForge: success rows)
    answered_once: bool  # every prompt completed exactly once on the servers
    output_tokens: int  # the job's answers' tokens, from the slot logs
    wall_s: float
    span_s: float
    util: float
    util_per_server: list[float]
    cpu_s: float
    start_s: float
    end_s: float
    # Per server (the fast one first): its first request and its last answer's end,
    # from the tool's start (NaN: none), and the job's answers it gave.
    first_request_s: list[float]
    last_answer_s: list[float]
    answers_per_server: list[int]
    other_requests: int  # requests not for a job prompt (SpecForge's one-token probe)
    aborted: int
    handed_over: int  # answers a server handed over to another, which continued them
    # (prompt hash, output tokens) of each answer, to check both sides did the same work.
    work: list[tuple[int, int]] = field(repr=False, default_factory=list)

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.span_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="one", help=f"of {','.join(RUNS)}")
    parser.add_argument("--tools", default=",".join(TOOLS), help="run these, in this order")
    parser.add_argument("--specforge-script", type=Path, help="its regenerate_train_data.py")
    parser.add_argument("--specforge-python", default=sys.executable, help="runs the script")
    parser.add_argument("--scale", type=float, default=1.0, help="divide answer lengths by")
    parser.add_argument("--prompts", type=int, default=264)
    parser.add_argument("--slots", type=int, default=32, help="running slots per server")
    parser.add_argument("--ms-per-token", type=float, default=20.0)
    parser.add_argument("--slow-ms-per-token", type=float, default=80.0, help="two-speed")
    parser.add_argument(
        "--first", choices=FIRST, default="both", help="fleets: whose regen worker starts first"
    )
    parser.add_argument("--mean-tokens", type=float, default=2000.0)
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal spread")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    tools = args.tools.split(",")
    if "specforge" in tools and args.specforge_script is None:
        print(
            "SpecForge's side skipped: no --specforge-script (its scripts/"
            "regenerate_train_data.py is not in the specforge wheel; point this at a "
            "SpecForge checkout's copy)",
            flush=True,
        )
        tools.remove("specforge")
    sides = [side for name in args.runs.split(",") for side in compare(name, tools, args)]
    if args.json:
        args.json.write_bytes(
            orjson.dumps([{**asdict(s), "overhead_s": s.overhead_s, "work": None} for s in sides])
        )


def compare(name: str, tools: list[str], args: argparse.Namespace) -> list[Side]:
    """Run each tool on `name`'s fleet, one after the other (regen once per worker
    start order on a fleet); print each, then each regen side against SpecForge's."""
    if name not in RUNS:
        raise SystemExit(f"unknown run {name!r}: one of {RUNS}")
    sides = [
        run_side(tool, name, first, args)
        for tool in tools
        for first in (regen_orders(name, args.first) if tool == "regen" else ["-"])
    ]
    for side in sides:
        report(side, args)
    for sf in (s for s in sides if s.tool == "specforge"):
        for regen_side in (s for s in sides if s.tool == "regen"):
            same = regen_side.work == sf.work
            print(
                f"{name:>9}: regen{order_note(regen_side)} / SpecForge: "
                f"wall {regen_side.wall_s / sf.wall_s:.2f}x, "
                f"span {regen_side.span_s / sf.span_s:.3f}x, "
                f"util {regen_side.util:.3f} vs {sf.util:.3f}, "
                f"cpu {regen_side.cpu_s:.0f} s vs {sf.cpu_s:.0f} s, "
                f"overhead {regen_side.overhead_s:.1f} s vs {sf.overhead_s:.1f} s; "
                f"same work (prompt ids and answer tokens): {'yes' if same else 'NO'}",
                flush=True,
            )
    return sides


def order_note(side: Side) -> str:
    return f" ({side.first} first)" if side.first != "-" else ""


def regen_orders(name: str, first: str) -> list[str]:
    """Whose worker starts first in each regen side of run `name`."""
    if name == "one":
        return ["-"]
    return ["fast", "slow"] if first == "both" else [first]


def run_side(tool: str, name: str, first: str, args: argparse.Namespace) -> Side:
    speeds = [args.ms_per_token] + ([args.slow_ms_per_token] if name == "two-speed" else [])
    mean = args.mean_tokens / args.scale
    longest = int(mean * 8)
    dist = f"lognormal:mean={mean},sigma={args.sigma},min=1,max={longest}"
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        rows, prompt_keys = write_rows(tmp / "rows.jsonl", args.prompts)
        # The fleet's own store of handed-over answers' rests (a fresh one each run).
        cont = str(tmp / "continuations")
        servers = stack.enter_context(standins(speeds, args.slots, dist, continuations_dir=cont))
        if tool == "regen":
            order = first_order(servers, first)
            started, last_record, records, cpu_s = run_regen(stack, tmp, rows, order, longest)
        else:
            started, last_record, records, cpu_s = run_specforge(tmp, rows, servers, longest, args)
        logs = [server.slot_log() for server in servers]
        aborted = sum(int(server.stats()["aborted_total"]) for server in servers)
    return measure(
        tool, name, first, args, prompt_keys, logs, started, last_record, records, cpu_s, aborted
    )


def write_rows(path: Path, prompts: int) -> tuple[Path, set[int]]:
    """The input both tools read, and the slot-log key of each of its prompts: the hash
    of the ids SGLang's chat path renders (tests/support/sglang_standin/scheduler.py)."""
    tokenizer = load_tokenizer(MODEL)
    rows, hashes = [], set()
    for i in range(prompts):
        messages = [{"role": "user", "content": f"Long prompt {i}: explain item {i} in depth."}]
        rows.append(orjson.dumps({"id": f"p{i}", "conversations": messages}) + b"\n")
        hashes.add(hash(tuple(render_prompt_ids(tokenizer, messages, {}))))
    path.write_bytes(b"".join(rows))
    return path, hashes


def first_order(servers: list[StandinHandle], first: str) -> list[list[StandinHandle]]:
    """The servers whose regen workers start together, group after group: the fast
    server is servers[0], the slow one the last."""
    if first == "-" or len(servers) == 1:
        return [servers]
    lead = servers[0] if first == "fast" else servers[-1]
    return [[lead], [s for s in servers if s is not lead]]


def run_regen(
    stack: ExitStack, tmp: Path, rows: Path, order: list[list[StandinHandle]], longest: int
) -> tuple[float, float, int, float]:
    """(start, last record committed, records, CPU seconds): `regen enqueue`, the
    tokenize worker and the first group's generate workers start at the same instant, as
    a user who launches them together; each later group once a worker holds a chunk."""
    url = stack.enter_context(running_redis(tmp / "redis")).url
    out = tmp / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), **DEFAULT_DELIVERY}
    enqueue_cmd = [
        sys.executable, "-m", "regen", "enqueue", str(rows), "--job", JOB, "--model", MODEL,
        "--max-new-tokens", str(longest + 64), "--context-length", str(CONTEXT_LENGTH),
        "--redis-url", url,
    ]  # fmt: skip
    started = time.time()
    with open(tmp / "enqueue.log", "wb") as log:
        enqueue = subprocess.Popen(enqueue_cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def generate_workers(group: list[StandinHandle]) -> list[Worker]:
        return [
            stack.enter_context(
                Worker(url, tmp, "--engine", "sglang", "--server", server.url,
                       "--loglevel", "WARNING", env=DEFAULT_DELIVERY)
            )
            for server in group
        ]  # fmt: skip

    workers = generate_workers(order[0])
    tokenizer = stack.enter_context(
        Worker(url, tmp, "--out", str(out), env=DEFAULT_DELIVERY, kind="tokenize")
    )
    workers.append(tokenizer)
    r = redis.Redis.from_url(url)
    for group in order[1:]:
        wait_until_held(r, enqueue)
        workers += generate_workers(group)
    enqueue_cpu = wait_with_cpu(enqueue, TIMEOUT_S)
    if enqueue.returncode != 0:
        raise SystemExit(f"regen enqueue failed:\n{(tmp / 'enqueue.log').read_text()[-4000:]}")
    ledger = CommitLedger(r, JOB)
    deadline = time.monotonic() + TIMEOUT_S
    total = sum(1 for _ in rows.open("rb"))
    while ledger.count() != (total, 0):
        if time.monotonic() > deadline or any(w.process.poll() is not None for w in workers):
            raise SystemExit(f"regen not done: {ledger.count()}\n{tokenizer.log()[-4000:]}")
        time.sleep(0.1)
    cpu_s = enqueue_cpu + sum(tree_cpu_s(w.process.pid) for w in workers)
    shards = read_manifest(out / JOB).shards.values()
    return started, max(s.created for s in shards), sum(s.rows for s in shards), cpu_s


def wait_until_held(r: redis.Redis, enqueue: subprocess.Popen[bytes]) -> None:
    """Until a worker holds a chunk (delivered, not acknowledged), as
    bench/long_generations.py waits before it starts a fleet's second worker."""
    deadline = time.monotonic() + TIMEOUT_S
    while not r.hlen(keys.KOMBU_UNACKED):
        # Whether the enqueue failed, without reaping it: wait_with_cpu reaps it.
        ended = os.waitid(os.P_PID, enqueue.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if time.monotonic() > deadline or (ended is not None and ended.si_status != 0):
            raise SystemExit("the first regen worker never held a chunk")
        time.sleep(0.05)


def run_specforge(
    tmp: Path, rows: Path, servers: list[StandinHandle], longest: int, args: argparse.Namespace
) -> tuple[float, float, int, float]:
    """(start, output file complete, success rows, CPU seconds) of SpecForge's script at
    its defaults, every stand-in one of its --server-address values."""
    out = tmp / "specforge.jsonl"
    cmd = [
        args.specforge_python, str(args.specforge_script), "--model", MODEL,
        "--max-tokens", str(longest + 64), "--input-file-path", str(rows),
        "--output-file-path", str(out),
        "--server-address", *(f"{s.config.host}:{s.port}" for s in servers),
    ]  # fmt: skip
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    started = time.time()
    with open(tmp / "specforge.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    cpu_s = wait_with_cpu(proc, TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"SpecForge's script failed:\n{(tmp / 'specforge.log').read_text()}")
    statuses = Counter(orjson.loads(line)["status"] for line in out.read_bytes().splitlines())
    return started, out.stat().st_mtime, statuses["success"], cpu_s


def wait_with_cpu(proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Wait for `proc` to exit; the user+sys seconds it and its reaped children used."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return float(usage.ru_utime + usage.ru_stime)
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{proc.args!r} still running after {timeout_s:.0f} s")
        time.sleep(0.05)


def tree_cpu_s(pid: int) -> float:
    """User+sys seconds of a live process, its live descendants and its reaped children."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def measure(
    tool: str,
    name: str,
    first: str,
    args: argparse.Namespace,
    prompt_keys: set[int],
    logs: list[list[dict[str, Any]]],
    started: float,
    last_record: float,
    records: int,
    cpu_s: float,
    aborted: int,
) -> Side:
    entries = [e for log in logs for e in log]
    first_request = min(e["start"] for e in entries)
    last_end = max(e["end"] for e in entries)
    span = last_end - first_request
    busy = [sum(e["end"] - e["start"] for e in log) for log in logs]
    done = [e for e in entries if e["outcome"] == "completed" and e["prompt"] in prompt_keys]
    answers = Counter(e["prompt"] for e in done)
    return Side(
        tool=tool,
        run=name,
        first=first,
        prompts=args.prompts,
        records=records,
        answered_once=set(answers) == prompt_keys and set(answers.values()) == {1},
        # A handed-over answer's rest is logged under its prompt, with the tokens
        # decoded before it on the server it left (the stand-in's slot log).
        output_tokens=sum(e["tokens"] + e.get("resumed", 0) for e in done),
        wall_s=last_record - started,
        span_s=span,
        util=sum(busy) / (args.slots * len(logs) * span),
        util_per_server=[b / (args.slots * span) for b in busy],
        cpu_s=cpu_s,
        start_s=first_request - started,
        first_request_s=[min((e["start"] for e in log), default=nan) - started for log in logs],
        last_answer_s=[max((e["end"] for e in log), default=nan) - started for log in logs],
        answers_per_server=[
            sum(e["outcome"] == "completed" and e["prompt"] in prompt_keys for e in log)
            for log in logs
        ],
        end_s=last_record - last_end,
        other_requests=sum(e["prompt"] not in prompt_keys for e in entries),
        aborted=aborted,
        work=sorted((e["prompt"], e["tokens"] + e.get("resumed", 0)) for e in done),
        handed_over=sum(e["outcome"] == "moved" for e in entries),
    )


def report(s: Side, args: argparse.Namespace) -> None:
    per_server = "/".join(f"{u:.3f}" for u in s.util_per_server)
    answers = "/".join(str(n) for n in s.answers_per_server)
    ends = "/".join(f"{t:.1f}" for t in s.last_answer_s)
    print(
        f"{s.run:>9} {s.tool:>9}: {s.records}/{s.prompts} records, scale 1/{args.scale:g}, "
        f"{order_note(s).strip(' ()')}{', ' if s.first != '-' else ''}"
        f"answered once {'yes' if s.answered_once else 'NO'}, {s.output_tokens} output tokens: "
        f"wall {s.wall_s:.1f} s, span {s.span_s:.1f} s, util {s.util:.3f} ({per_server}), "
        f"answers {answers}, last answer at {ends} s, "
        f"cpu {s.cpu_s:.1f} s, overhead {s.overhead_s:.1f} s (start {s.start_s:.1f} s, "
        f"end {s.end_s:.1f} s), other requests {s.other_requests}, aborted {s.aborted}, "
        f"handed over {s.handed_over}",
        flush=True,
    )


if __name__ == "__main__":
    main()
