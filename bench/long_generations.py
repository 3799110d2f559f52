"""Real answer lengths: does a busy server stay busy, and is nothing thrown away? (not a
test; a measurement, docs/design/limits.md, "Timers at real lengths").

Runs the SGLang stand-in at a real time scale (32 running slots per server, 20 ms per
token per request, answers averaging 2,000 tokens with a lognormal long tail, so ~40 s
each) against real `regen worker generate` processes, one per server, and prints for
each run:

- busy: the share of each server's slot time that was busy from the first request
  until the last prompt (or turn) was started, while some prompt could have started
  but had not (a conversation's next turn can start only once its previous turn has
  ended): no slot idle while work waits. A server whose worker left the job's last
  prompts to faster servers (docs/design/placement.md, "Faster servers take the end") is not
  counted while it was away; the seconds it was are printed beside it;
- waste: the share of busy slot time spent on answers later thrown away (aborted
  mid-way, answered twice, or lost with a killed server);
- aborted requests, chunks given back (deliveries that ended other than done);
- prompts moved: prompts a worker had not started and gave back to the queue for
  another worker's idle slots (docs/design/placement.md, "Only what can start soon"), and of
  those, the ones the same worker took back and ran (ping-pong: should be 0); prompts
  run per server; running answers a slow worker handed over to faster servers, which
  continued them, and the tokens they had decoded (docs/design/placement.md, "A slow server's
  last answers move": moved work, counted as neither waste nor an abort);
- span over ideal: from the first request to the last answer, over the useful tokens
  at the fleet's token rate (informative only: with long-tailed lengths the last
  answers dominate a small job's span).

Runs: `last` (256 prompts, one server), `all` (128 two-turn conversations, `--turns
all`), `two-speed` (two servers at 20 and 80 ms per token, 32 slots each, one worker
per server, the slow server's worker started first: it meets the queue alone),
`four-speed` (four servers at 20, 20, 40 and 80 ms per token, the slowest's worker
first; `--fast-first` starts the fastest first instead), `kill` (`last`, with the
server killed at 40% of the answers and restarted: only the requests that were on it
are redone). Targets: busy >= 0.97 (>= 0.95 for
`all` and the fleets), waste <= 1%, 0 aborted, in every run but `kill`; 0 given back
with one server.
Every run uses the product's defaults (`regen enqueue` with no --chunk-size: 64 prompts
a chunk; `--max-inflight auto`) unless a flag says otherwise.

Each full-scale run takes ~5 minutes of wall time. `--scale 10` divides answer lengths
by 10 (a run in well under a minute; tests/ops/test_long_generations.py runs it).

    python bench/long_generations.py [--runs last,all,two-speed,kill] [--scale 1]
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.common import defaults, jobspec, keys
from regen.common.celery_app import make_app
from regen.producer.enqueue import Enqueuer
from regen.producer.spec import JobOptions, prepare_job
from tests.support.generate_harness import Worker, all_generated, attempts, results
from tests.support.helpers import write_jsonl
from tests.support.redis_server import running_redis
from tests.support.sglang_standin.process import StandinHandle, start_standin

RUNS = ("last", "all", "two-speed", "four-speed", "kill")
# ms per token of each server in the fleet runs, the first one's worker started first.
FLEETS = {"two-speed": "slow,fast", "four-speed": "slow,fast,fast,mid"}
JOB = "long"
# Room for the longest answer after a two-turn conversation's first answer.
CONTEXT_LENGTH = 65_536
# The delivery settings a deployment has by default (the test harness shortens them).
DEFAULT_DELIVERY = {"REGEN_VISIBILITY_TIMEOUT": "100", "REGEN_RESTORE_INTERVAL": "10"}
# Share of the answers handed off when the `kill` run kills its server.
KILL_AT = 0.4


# held_prompts.py's line for running answers handed over to faster servers.
HANDED_OVER = re.compile(
    r"handed (?P<answers>\d+) running answers \((?P<tokens>\d+) tokens so far\)"
)


@dataclass(frozen=True)
class Figures:
    run: str
    prompts: int
    busy: list[float]  # per server, while work waits
    waste: float
    aborted: int
    given_back: int
    span_s: float
    ideal_s: float
    redone: int = 0  # requests started twice (kill: those on the killed server)
    lost_at_kill: int = 0
    moved: int = 0  # prompts not started, given back to the queue for another worker
    moved_back: int = 0  # of those, run by the worker that gave them back
    # Running answers a worker handed over to a faster server, which continued them
    # (held_prompts.py), and the tokens they had decoded by then.
    handed_over: int = 0
    handed_over_tokens: int = 0
    per_server_prompts: list[int] | None = None
    # Per server: seconds its worker had left the job's end to faster servers while
    # work waited (not counted in busy).
    away_s: list[float] | None = None

    @property
    def span_over_ideal(self) -> float:
        return self.span_s / self.ideal_s if self.ideal_s else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default=",".join(RUNS[:3]), help=f"of {','.join(RUNS)}")
    parser.add_argument("--scale", type=float, default=1.0, help="divide answer lengths by")
    parser.add_argument("--prompts", type=int, default=256, help="prompts (turns with all)")
    parser.add_argument("--slots", type=int, default=32, help="running slots per server")
    parser.add_argument("--ms-per-token", type=float, default=20.0)
    parser.add_argument("--slow-ms-per-token", type=float, default=80.0, help="two-speed")
    parser.add_argument("--mean-tokens", type=float, default=2000.0)
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal spread")
    parser.add_argument("--chunk-size", type=int, default=defaults.CHUNK_SIZE)
    parser.add_argument(
        "--fast-first", action="store_true", help="fleets: start the fastest server's worker first"
    )
    parser.add_argument("--max-inflight", default="auto", help="the workers' --max-inflight")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--log-dir", type=Path,
                        help="keep each run's worker logs and server slot logs here")  # fmt: skip
    args = parser.parse_args()
    figures = [run(name, args) for name in args.runs.split(",")]
    if args.json:
        args.json.write_bytes(orjson.dumps([asdict(f) for f in figures]))


def run(name: str, args: argparse.Namespace) -> Figures:
    if name not in RUNS:
        raise SystemExit(f"unknown run {name!r}: one of {RUNS}")
    speeds = fleet_speeds(name, args)
    mean = args.mean_tokens / args.scale
    longest = int(mean * 8)
    dist = f"lognormal:mean={mean},sigma={args.sigma},min=1,max={longest}"
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        url = stack.enter_context(running_redis(tmp / "redis")).url
        r = redis.Redis.from_url(url)
        spec = enqueue(url, tmp, name, args, max_new_tokens=longest + 64)
        # The fleet's own store of handed-over answers' rests (a fresh one each run).
        cont = str(tmp / "continuations")
        servers = stack.enter_context(standins(speeds, args.slots, dist, continuations_dir=cont))
        workers = []
        for i, server in enumerate(servers):
            workers.append(stack.enter_context(
                Worker(url, tmp, "--engine", "sglang", "--server", server.url,
                       "--max-inflight", args.max_inflight, "--jobs", JOB,
                       "--loglevel", "INFO", env=DEFAULT_DELIVERY)
            ))  # fmt: skip
            if i == 0 and len(servers) > 1:  # the first worker meets the queue alone
                wait_until_held(r)
        logs: list[list[dict[str, Any]]] = [[] for _ in servers]
        waste_s = 0.0
        lost = 0
        if name == "kill":
            waste_s, lost, logs[0] = kill_and_restart(r, spec, servers[0], args.prompts)
        wait_done(r, spec)
        stats = [server.stats() for server in servers]
        for i, server in enumerate(servers):
            logs[i] += server.slot_log()
        away = [stand_downs(worker.log()) for worker in workers]
        figures = measure(name, r, spec, logs, stats, speeds, args, waste_s, lost, away)
        figures = moves(figures, r, spec, workers)
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            for i, worker in enumerate(workers):
                (args.log_dir / f"{name}-worker-{i}.log").write_text(worker.log())
                (args.log_dir / f"{name}-server-{i}.json").write_bytes(orjson.dumps(logs[i]))
    report(figures, args)
    return figures


def fleet_speeds(name: str, args: argparse.Namespace) -> list[float]:
    """ms per token of each server, in the order their workers start."""
    if name not in FLEETS:
        return [args.ms_per_token]
    fast, slow = args.ms_per_token, args.slow_ms_per_token
    ms = {"fast": fast, "slow": slow, "mid": 2 * fast}
    speeds = [ms[kind] for kind in FLEETS[name].split(",")]
    return sorted(speeds) if args.fast_first else speeds


def enqueue(
    url: str, tmp: Path, name: str, args: argparse.Namespace, max_new_tokens: int
) -> jobspec.JobSpec:
    if name == "all":  # two-turn conversations: each counts two prompts
        rows: list[dict[str, Any]] = [
            {"messages": [
                {"role": "user", "content": f"Conversation {i}: describe item {i}."},
                {"role": "assistant", "content": "(the dataset's answer)"},
                {"role": "user", "content": f"Now compare item {i} with item {i + 1}."},
                {"role": "assistant", "content": "(the dataset's second answer)"},
            ]}
            for i in range(args.prompts // 2)
        ]  # fmt: skip
    else:
        rows = [
            {"prompt": f"Long prompt {i}: explain item {i} in depth."} for i in range(args.prompts)
        ]
    path = write_jsonl(tmp / "rows.jsonl", rows)
    prepared = prepare_job(
        JobOptions(job=JOB, model="smollm2", chunk_size=args.chunk_size,
                   max_new_tokens=max_new_tokens, context_length=CONTEXT_LENGTH,
                   turns="all" if name == "all" else "last")
    )  # fmt: skip
    r = redis.Redis.from_url(url)
    jobspec.save(r, prepared.spec)
    Enqueuer(r, make_app(url), prepared, high_water=10_000).run([path])
    return prepared.spec


@contextmanager
def standins(
    speeds: list[float], slots: int, dist: str, **options: Any
) -> Iterator[list[StandinHandle]]:
    servers = [
        start_standin(
            max_running_requests=slots, decode_tokens_per_s=1000.0 / ms, output_len_dist=dist,
            context_length=CONTEXT_LENGTH, **options,
        )
        for ms in speeds
    ]  # fmt: skip
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.close()


def wait_until_held(r: redis.Redis, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not r.hlen(keys.KOMBU_UNACKED):
        if time.monotonic() > deadline:
            raise SystemExit(f"no chunk held after {timeout_s:.0f} s")
        time.sleep(0.05)


def wait_done(r: redis.Redis, spec: jobspec.JobSpec, timeout_s: float = 3600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all_generated(r, spec):
        if time.monotonic() > deadline:
            raise SystemExit(f"not done after {timeout_s:.0f} s")
        time.sleep(0.5)


def kill_and_restart(
    r: redis.Redis, spec: jobspec.JobSpec, server: StandinHandle, prompts: int
) -> tuple[float, int, list[dict[str, Any]]]:
    """Kill the server once KILL_AT of the answers are in, restart it; (busy seconds
    lost with it, requests it was running, its slot log until the kill)."""
    while r.xlen(keys.results_stream(spec.name)) < prompts * KILL_AT:
        time.sleep(0.2)
    log = server.slot_log()
    killed_at = time.time()
    server.kill()
    running = [entry for entry in log if entry["end"] is None]
    for entry in running:  # its answer is gone: the slot time it had is wasted
        entry["end"], entry["outcome"] = killed_at, "lost"
    time.sleep(3.0)
    server.restart()
    return sum(killed_at - e["start"] for e in running), len(running), log


def measure(
    name: str,
    r: redis.Redis,
    spec: jobspec.JobSpec,
    logs: list[list[dict[str, Any]]],
    stats: list[dict[str, Any]],
    speeds: list[float],
    args: argparse.Namespace,
    lost_s: float,
    lost: int,
    away: list[list[tuple[float, float]]] | None = None,
) -> Figures:
    entries = [e for log in logs for e in log]
    first = min(e["start"] for e in entries)
    busy, away_s = busy_and_away(logs, args.slots, away)
    total_busy = sum(e["end"] - e["start"] for e in entries)
    waste_s = lost_s + sum(s["aborted_busy_s"] + s["repeated_busy_s"] for s in stats)
    chunk_ids = [raw.decode() for raw in r.hkeys(keys.job_chunks(spec.name))]
    given_back = sum(
        a["status"] != "done" for chunk in chunk_ids for a in attempts(r, spec.name, chunk)
    )
    useful = sum(res.completion_tokens for res in results(r, spec.name))
    rate = sum(args.slots * 1000.0 / ms for ms in speeds)
    started: dict[int, int] = {}
    for e in entries:  # the same prompt ids: the same prompt, in any delivery or retry
        if not e.get("resumed"):  # the rest of a handed-over answer is not a new start
            started[e["prompt"]] = started.get(e["prompt"], 0) + 1
    return Figures(
        run=name,
        prompts=args.prompts,
        busy=busy,
        waste=waste_s / total_busy if total_busy else 0.0,
        aborted=sum(int(s["aborted_total"]) for s in stats),
        given_back=given_back,
        span_s=max(e["end"] for e in entries) - first,
        ideal_s=useful / rate,
        redone=sum(n - 1 for n in started.values()),
        lost_at_kill=lost,
        away_s=away_s,
    )


def moves(f: Figures, r: redis.Redis, spec: jobspec.JobSpec, workers: list[Worker]) -> Figures:
    """The prompts each worker's log says it gave back (held_prompts.py), and how many
    of them the same worker ran after all (ping-pong); prompts run per server."""
    ran_by = {res.id: res.worker for res in results(r, spec.name)}
    moved = moved_back = handed = handed_tokens = 0
    for worker in workers:
        for line in worker.log().splitlines():
            if "back to the queue in" in line:
                ids = line.rsplit(": ", 1)[1].split(",")
                moved += len(ids)
                moved_back += sum(ran_by.get(i) == worker.name for i in ids)
            elif (hand_over := HANDED_OVER.search(line)) is not None:
                handed += int(hand_over["answers"])
                handed_tokens += int(hand_over["tokens"])
    per_server = [sum(w == worker.name for w in ran_by.values()) for worker in workers]
    return replace(f, moved=moved, moved_back=moved_back, per_server_prompts=per_server,
                   handed_over=handed, handed_over_tokens=handed_tokens)  # fmt: skip


def available_at(entries: list[dict[str, Any]], first: float) -> dict[int, float]:
    """When each request could have started (by its index in `entries`): a conversation's
    later turn once its previous turn ended, anything else from the first request on.
    Turn rids are CHUNK-CONVERSATION-TURN-ATTEMPT, a retry's with "~N" after."""
    turns: dict[str, dict[int, dict[str, Any]]] = {}
    for e in entries:
        key, turn, _ = e["rid"].split("~")[0].rsplit("-", 2)
        if turn.isdigit() and e["outcome"] == "completed":
            turns.setdefault(key, {})[int(turn)] = e
    available = {}
    for i, e in enumerate(entries):
        key, turn, _ = e["rid"].split("~")[0].rsplit("-", 2)
        previous = turns.get(key, {}).get(int(turn) - 1) if turn.isdigit() else None
        available[i] = previous["end"] if previous is not None else first
    return available


def busy_while_work_waits(logs: list[list[dict[str, Any]]], slots: int) -> list[float]:
    """Per server, the share of its slot time busy while some request of the job could
    have started but had not, from the server's first request (its worker joined the
    fleet: the fleet runs start them one after the other) until the last one started."""
    return busy_and_away(logs, slots)[0]


def stand_downs(worker_log: str) -> list[tuple[float, float]]:
    """When the worker left the job's last prompts to faster servers (stand_down.py),
    until it took the queue again (or the end): (from, to) in epoch seconds."""
    spans: list[tuple[float, float]] = []
    left_at: float | None = None
    for line in worker_log.splitlines():
        if "leaving the last prompts of" in line or (" taking " in line and " again" in line):
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if "leaving" in line:
                left_at = stamp
            elif left_at is not None:
                spans.append((left_at, stamp))
                left_at = None
    if left_at is not None:
        spans.append((left_at, math.inf))
    return spans


def busy_and_away(
    logs: list[list[dict[str, Any]]],
    slots: int,
    away: list[list[tuple[float, float]]] | None = None,
) -> tuple[list[float], list[float]]:
    """busy_while_work_waits, but a server does not count as waited on while its worker
    had left the job's end to faster servers (`away`, per server: stand_downs): its
    idle slots then are the schedule, not a prompt stuck. Also returns, per server, the
    seconds it was away while work waited."""
    entries = [e for log in logs for e in log]
    first = min(e["start"] for e in entries)
    last_start = max(e["start"] for e in entries)
    available = available_at(entries, first)
    times = sorted({first, last_start, *(t for e in entries for t in (e["start"], e["end"])),
                    *available.values()})  # fmt: skip
    times = [t for t in times if first <= t <= last_start]
    joined = [min((e["start"] for e in log), default=last_start) for log in logs]
    busy = [0.0 for _ in logs]
    waited = [0.0 for _ in logs]
    gone = [0.0 for _ in logs]
    spans = away or [[] for _ in logs]
    for a, b in itertools.pairwise(times):
        mid = (a + b) / 2
        if not any(available[i] <= mid < e["start"] for i, e in enumerate(entries)):
            continue  # nothing could start: an idle slot wastes nothing
        for s, log in enumerate(logs):
            if mid < joined[s]:
                continue
            if any(start <= mid < end for start, end in spans[s]):
                gone[s] += b - a
                continue
            waited[s] += b - a
            busy[s] += (b - a) * sum(e["start"] <= mid < e["end"] for e in log)
    shares = [b / (slots * w) if w else 1.0 for b, w in zip(busy, waited, strict=True)]
    return shares, gone


def report(f: Figures, args: argparse.Namespace) -> None:
    busy = " ".join(f"{b:.3f}" for b in f.busy)
    target = 0.97 if f.run in ("last", "kill") else 0.95
    print(
        f"{f.run:>10}: {f.prompts} prompts, scale 1/{args.scale:g}, chunk {args.chunk_size}, "
        f"--max-inflight {args.max_inflight}: busy {busy} (target >= {target}), "
        f"waste {f.waste:.2%}, aborted {f.aborted}, given back {f.given_back}, "
        f"prompts moved {f.moved} (back to their giver {f.moved_back}), "
        f"answers handed over {f.handed_over} ({f.handed_over_tokens} tokens), "
        f"prompts per server {f.per_server_prompts}, "
        f"left to faster servers {' '.join(f'{a:.0f}' for a in f.away_s or [])} s, "
        f"span {f.span_s:.0f} s over ideal {f.ideal_s:.0f} s = {f.span_over_ideal:.2f}x"
        + (f", lost at kill {f.lost_at_kill}, redone {f.redone}" if f.run == "kill" else ""),
        flush=True,
    )


if __name__ == "__main__":
    main()
