"""Run one chaos scenario end to end and check the invariant (invariant.py).

Real parts only: a real redis-server (append-only, fsync per write), `regen worker
generate` and `regen worker tokenize` processes, the SGLang stand-in over HTTP, the
`regen` commands an operator runs (enqueue, verify, shards verify, export), and the job's
`regen enqueue --follow`, which heals what a fault lost with no operator command.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from click.testing import CliRunner, Result

from regen.cli import main
from regen.common import connection, dlq, jobspec, keys, settings
from regen.common.chat_family import render_prompt_ids
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.quality_flags import DEFAULT_DROP_FLAGS
from regen.common.queues import queue_lists
from regen.common.samples import sample_id
from regen.consumers.tokenize.job_folder import job_folder
from regen.consumers.tokenize.shard_files import iter_records
from regen.producer.conversations import job_prompt
from tests.chaos.cluster import CHUNK_LEASE_S, SHARD_LEASE_S, Redis, SentinelRedis, Workers
from tests.chaos.invariant import (
    Found,
    ShardWatch,
    export_violations,
    placement_violations,
    token_violations,
)
from tests.chaos.scenario import EXPORT_CRASHPOINT, Fault, Scenario
from tests.support.generate_harness import REPO
from tests.support.s3_server import S3Server, s3_server
from tests.support.sentinel_cluster import MASTER as SENTINEL_MASTER
from tests.support.sglang_standin.completer import Completer
from tests.support.sglang_standin.config import LengthDist
from tests.support.sglang_standin.process import StandinHandle, run_standin

JOB = "chaos"
GENERATE_ENV = {
    "REGEN_VISIBILITY_TIMEOUT": str(CHUNK_LEASE_S),
    "REGEN_RESTORE_INTERVAL": "1",
    "REGEN_RESTORE_THROTTLE": "1",
}
MAX_NEW_TOKENS = 64
# Every row is under this but the one a scenario makes too large (--max-row-bytes).
MAX_ROW_BYTES = 4000
# Answers of 8 to 40 tokens at 40 tokens/s: a chunk runs for seconds, so faults land
# while work is in flight.
ANSWER_LENGTHS = "uniform:min=8,max=40"
DECODE_TOKENS_PER_S = 40
STANDIN_SEED = 7
# Every answer ends with a call (turns mode): tool loops go on, other rows diverge.
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SETTLE_TIMEOUT_S = 240
# The follower's pace (REGEN_FOLLOW_*): small, so a lost chunk comes back within a seed.
FOLLOW_POLL_S = 1
FOLLOW_GRACE_S = 5
START_TIMEOUT_S = 60
POLL_S = 0.1


@dataclass
class Environment:
    """What the seeds of one mode share: the model folder, its tokenizer, one stand-in."""

    mode: str
    model_dir: Path
    tokenizer: Any
    standin: StandinHandle
    completer: Completer
    s3: S3Server  # the buckets of the seeds whose shards go to object storage


@contextlib.contextmanager
def environment(mode: str, work: Path) -> Iterator[Environment]:
    from transformers import AutoTokenizer

    from tests.common.test_record import hermes_tokenizer_dir
    from tests.support.sglang_standin.completer import load_tokenizer

    model_dir = work / "model"
    if not (model_dir / "tokenizer_config.json").exists():
        hermes_tokenizer_dir(load_tokenizer(None), model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    suffix = "\n" + CALL_TEXT if mode == "turns" else None
    options: dict[str, Any] = {
        "tokenizer": str(model_dir),
        "output_len_dist": ANSWER_LENGTHS,
        "decode_tokens_per_s": DECODE_TOKENS_PER_S,
        "seed": STANDIN_SEED,
    }
    if suffix is not None:
        options["answer_suffix"] = suffix
    completer = Completer(
        tokenizer,
        LengthDist.parse(ANSWER_LENGTHS),
        eos_id=None,
        think=False,
        seed=STANDIN_SEED,
        suffix=suffix,
    )
    with run_standin(**options) as standin, s3_server() as s3:
        # This process reads the buckets too (checks, verify, exports): the same variables
        # its workers get.
        os.environ.update(s3.env)
        yield Environment(mode, model_dir, tokenizer, standin, completer, s3)


def dataset_rows(scenario: Scenario) -> list[dict[str, Any]]:
    rng = random.Random(f"rows:{scenario.mode}:{scenario.seed}")
    rows: list[dict[str, Any]] = []
    for i in range(scenario.rows):
        ask = f"Chaos {scenario.seed}, row {i}: tell me something about city {rng.randrange(99)}."
        if scenario.mode == "single":
            if rng.random() < 0.3:
                rows.append(
                    {
                        "messages": [
                            {"role": "system", "content": "Be brief."},
                            {"role": "user", "content": ask},
                        ]
                    }
                )
            else:
                rows.append({"prompt": ask})
        elif rng.random() < 0.6:
            rows.append(_tool_loop(ask, calls=rng.randint(1, 3)))
        else:
            rows.append(_plain_conversation(ask, users=rng.randint(2, 3)))
    if rows and rng.random() < 0.3:
        rows.append(dict(rows[0]))  # the same prompt twice: one id, regenerated once
    if scenario.oversized_row:
        rows.insert(rng.randrange(len(rows) + 1), {"prompt": "Too long. " * (MAX_ROW_BYTES // 8)})
    return rows


def _tool_loop(ask: str, calls: int) -> dict[str, Any]:
    """A tool conversation: every assistant turn but the last calls get_weather."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": ask}]
    for k in range(calls):
        call_id = f"call_{k}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            }
        )
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call_id,
                "name": "get_weather",
                "content": f"{12 + k} C, cloudy",
            }
        )
    messages.append({"role": "assistant", "content": "Done."})
    return {"tools": [WEATHER_TOOL], "messages": messages}


def _plain_conversation(ask: str, users: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for k in range(users):
        messages.append({"role": "user", "content": ask if k == 0 else f"And then {k}?"})
        messages.append({"role": "assistant", "content": f"Answer {k}."})
    return {"messages": messages}


@dataclass
class Outcome:
    seed: int
    mode: str
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    ids: int = 0
    records: int = 0
    dead: int = 0
    dead_reasons: dict[str, int] = field(default_factory=dict)
    worker_exits: int = 0
    window_kills: int = 0  # worker processes that died inside kombu's window
    faults: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def line(self) -> str:
        verdict = "ok" if self.ok else f"FAILED ({len(self.violations)} violation(s))"
        return (
            f"seed {self.seed} ({self.mode}): {verdict}, {self.wall_s:.1f} s, {self.ids} ids: "
            f"{self.records} records + {self.dead} dead letters; {self.worker_exits} worker "
            f"exit(s){f' ({self.window_kills} in kombu window)' if self.window_kills else ''}; "
            f"faults: {', '.join(self.faults) or 'none'}"
        )


def regen(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--redis-url", url])


class Run:
    def __init__(self, env: Environment, scenario: Scenario, work: Path) -> None:
        self.env = env
        self.scenario = scenario
        self.work = work
        # A local folder, or (scenario.bucket) a fresh bucket on the environment's S3 server.
        self.out: Path | str = work / "out"
        store_env: dict[str, str] = {}
        if scenario.bucket:
            self.out = f"s3://{env.s3.new_bucket()}/out"
            store_env = {**env.s3.env, "REGEN_SPOOL_DIR": str(work / "spool")}
        self.folder = job_folder(self.out, JOB)
        self.outcome = Outcome(scenario.seed, scenario.mode)
        self.dataset = work / "rows.jsonl"
        self.dataset.write_bytes(
            b"".join(orjson.dumps(row) + b"\n" for row in dataset_rows(scenario))
        )
        self.redis: Redis | SentinelRedis = (
            SentinelRedis(work / "redis") if scenario.sentinel else Redis(work / "redis")
        )
        self.r = self.redis.client
        self.workers = Workers(self.redis.url, work, {**self.redis.env, **store_env})
        self.watch = ShardWatch(self.folder)
        self.copy: dict[bytes, tuple[bytes, int]] | None = None

    # --- the job ---------------------------------------------------------------------

    def enqueue_args(self) -> list[str]:
        args = [
            "enqueue", str(self.dataset), "--job", JOB, "--model", str(self.env.model_dir),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--chunk-size", str(self.scenario.chunk_size),
            "--max-row-bytes", str(MAX_ROW_BYTES), "--samples", str(self.scenario.samples),
        ]  # fmt: skip
        if self.scenario.mode == "turns":
            args += ["--turns", "all"]
        return args

    def enqueue(self) -> None:
        result = regen(self.redis.url, *self.enqueue_args())
        if result.exit_code != 0:
            raise RuntimeError(f"enqueue failed: {result.output}")

    def expected_ids(self, spec: jobspec.JobSpec) -> set[str]:
        ids: set[str] = set()
        samples = self.scenario.samples
        for line in self.dataset.read_bytes().splitlines():
            prompt, conversation = job_prompt(orjson.loads(line), spec)
            for k in range(samples):
                if conversation is None:
                    ids.add(prompt.id if samples == 1 else sample_id(prompt.id, k))
                else:
                    cid = conversation.id if samples == 1 else sample_id(conversation.id, k)
                    ids.update(replace(conversation, id=cid).turn_ids())
        return ids

    def generate_args(self) -> tuple[str, ...]:
        return ("--engine", "sglang", "--server", self.env.standin.url, "--jobs", JOB)

    def start_workers(self) -> None:
        s = self.scenario
        generate_env = GENERATE_ENV
        tokenize_env = {"REGEN_SHARD_LEASE_S": str(SHARD_LEASE_S), "REGEN_HEARTBEAT_STALE_S": "3"}
        points = {
            "generate": [p for k, p in s.crashpoints if k == "generate"],
            "tokenize": [p for k, p in s.crashpoints if k == "tokenize"],
        }
        for i in range(s.generate_workers):
            args = self.generate_args()
            point = points["generate"][i] if i < len(points["generate"]) else None
            self.workers.add("generate", args, generate_env, point)
        for i in range(s.tokenize_workers):
            args = (
                "--out",
                str(self.out),
                "--jobs",
                JOB,
                "--shard-rows",
                "4",
                "--idle-commit",
                "0.3",
                "--claim-idle",
                "3",
                "--min-free-mb",
                "0",
            )
            point = points["tokenize"][i] if i < len(points["tokenize"]) else None
            self.workers.add("tokenize", args, tokenize_env, point)
        # The job's follower: what a fault loses is queued again by it, not by the harness.
        follow_env = {"REGEN_FOLLOW_POLL_S": str(FOLLOW_POLL_S),
                      "REGEN_FOLLOW_GRACE_S": str(FOLLOW_GRACE_S)}  # fmt: skip
        # Follower runs `regen enqueue ARGS --follow`: ARGS without the command's name.
        self.workers.add("producer", tuple(self.enqueue_args()[1:]), follow_env, None)
        # A crash point with no worker of its own (more points than workers) goes to the
        # first worker's next process: every drawn point is reached by someone.
        for kind, listed in points.items():
            slots = self.workers.of_kind(kind)
            for point in listed[len(slots) :]:
                slots[0].crashpoint = slots[0].crashpoint or point

    def settled(self, expected: list[str]) -> bool:
        """Every id committed or dead-lettered, nothing left in between, and Redis steady
        (nothing more a fault set off can still roll back)."""
        if not self.redis.steady():
            return False
        r = self.r
        owners = CommitLedger(r, JOB).owner_of(expected)
        dead = dlq.dead_lettered(r, JOB, expected)
        if not all(o is not None or d for o, d in zip(owners, dead, strict=True)):
            return False
        return self.quiet()

    def quiet(self) -> bool:
        """Nothing queued, held, on the stream or being committed."""
        r = self.r
        spec = jobspec.load(r, JOB)
        pipe = r.pipeline(transaction=False)
        pipe.hlen(keys.pending_shards(JOB))
        pipe.xlen(keys.results_stream(JOB))
        pipe.hlen(keys.KOMBU_UNACKED)
        for name in queue_lists(spec.queue):
            pipe.llen(name)
        return not any(pipe.execute())

    # --- faults ----------------------------------------------------------------------

    def fire(self, fault: Fault) -> None:
        what = fault.kind
        if fault.kind == "kill_generate":
            what += f"({self.workers.kill('generate', fault.target)})"
        elif fault.kind == "kill_tokenize":
            what += f"({self.workers.kill('tokenize', fault.target)})"
        elif fault.kind == "freeze_generate":
            what += f"({self.workers.freeze('generate', fault.target, CHUNK_LEASE_S + 2)})"
        elif fault.kind == "freeze_tokenize":
            what += f"({self.workers.freeze('tokenize', fault.target, SHARD_LEASE_S + 2)})"
        elif fault.kind == "redis_kill":
            self.redis.kill_and_restart(down_s=0.3 + 0.7 * fault.target)
        elif fault.kind == "redis_rollback":
            self.rollback()
        elif fault.kind == "server_errors":
            kind, count = fault.detail.split(":")
            self.env.standin.fault(kind, int(count))
            what += f"({fault.detail})"
        elif fault.kind == "drain_generate":
            detail = f"{fault.detail}: " if fault.detail else ""
            what += f"({detail}{self.workers.drain('generate', fault.target, fault.detail)})"
        elif fault.kind == "kill_in_kombu_window":
            name = self.workers.add_in_kombu_window(self.generate_args(), GENERATE_ENV)
            what += f"({name})"
        elif fault.kind == "sentinel_failover":
            assert isinstance(self.redis, SentinelRedis)
            what += f"(primary :{self.redis.failover()} killed)"
        self.outcome.faults.append(what)

    def rollback(self) -> None:
        """Redis back from the copy, and nothing else: the tokenize stage rebuilds the
        ledger and the follower queues what the copy lost (docs/design/exactly-once.md, Healing)."""
        assert self.copy is not None
        self.redis.restore(self.copy)

    # --- the run ---------------------------------------------------------------------

    def run(self) -> Outcome:
        started = time.monotonic()
        try:
            self._run()
        finally:
            self.workers.stop()
            self.env.standin.fault(clear=True)
            self.outcome.wall_s = time.monotonic() - started
        return self.outcome

    def _run(self) -> None:
        s = self.scenario
        self.enqueue()
        spec = jobspec.load(self.r, JOB)
        expected = self.expected_ids(spec)
        self.outcome.ids = len(expected)
        ordered = sorted(expected)
        self.start_workers()
        t0 = self.first_delivery()
        pending = list(s.faults)
        next_look = 0.0
        while True:
            now = time.monotonic() - t0
            self.workers.supervise()
            # Mid-failover the primary cannot be reached for seconds (the sentinels take
            # DOWN_AFTER_MS to see it gone, then elect): what needs it is tried again.
            with contextlib.suppress(*connection.OUTAGE_ERRORS):
                self.redis.tend()
                if s.copy_at_s is not None and self.copy is None and now >= s.copy_at_s:
                    self.copy = self.redis.copy()
                while pending and now >= pending[0].at_s:
                    self.fire(pending[0])
                    pending.pop(0)
            if now >= next_look:
                next_look = now + 0.5
                self.watch.look()
                with contextlib.suppress(*connection.OUTAGE_ERRORS):
                    if not pending and not self.workers.frozen and self.settled(ordered):
                        break
            if now > SETTLE_TIMEOUT_S:
                try:
                    stuck = self.stuck(ordered)
                except connection.OUTAGE_ERRORS as exc:
                    stuck = f"Redis unreachable ({exc!r})"
                self.outcome.violations.append(f"not settled after {SETTLE_TIMEOUT_S} s: {stuck}")
                return
            time.sleep(POLL_S)
        self.outcome.violations += self.workers.violations
        self.workers.stop()
        self.check(spec, expected)

    def first_delivery(self) -> float:
        """When a worker first took a chunk: fault times count from there, so that faults
        land on work in flight rather than on workers still starting."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.r.hlen(keys.KOMBU_UNACKED) and time.monotonic() < deadline:
            self.workers.supervise()
            time.sleep(POLL_S)
        return time.monotonic()

    def stuck(self, expected: list[str]) -> str:
        owners = CommitLedger(self.r, JOB).owner_of(expected)
        dead = dlq.dead_lettered(self.r, JOB, expected)
        open_ids = [
            pid for pid, o, d in zip(expected, owners, dead, strict=True) if o is None and not d
        ]
        pending = self.r.hlen(keys.pending_shards(JOB))
        stream = self.r.xlen(keys.results_stream(JOB))
        now = time.time()
        leases = [f"{now - score:.0f}s" for _, score in
                  self.r.zrange(keys.KOMBU_UNACKED_INDEX, 0, -1, withscores=True)]  # fmt: skip
        return (
            f"{len(open_ids)} open id(s) {open_ids[:5]}, pending shards {pending}, "
            f"results {stream}, unacked leases last renewed {leases} ago, restore lock "
            f"{self.r.pttl(keys.KOMBU_UNACKED_MUTEX)} ms, workers {self.workers.describe()}"
        )

    # --- the invariant ---------------------------------------------------------------

    def check(self, spec: jobspec.JobSpec, expected: set[str]) -> None:
        v = self.outcome.violations
        found = Found()
        for path in self.folder.shards() if self.folder.readable_here() else []:
            found.records[path.name] = list(iter_records(path))
        for stage in keys.STAGES:
            found.dead[stage] = {
                letter.entry_id: letter.reason for letter in dlq.entries(self.r, JOB, stage)
            }
        self.outcome.records = found.record_count()
        self.outcome.dead = found.dead_count()
        for entries in found.dead.values():
            for reason in entries.values():
                self.outcome.dead_reasons[reason] = self.outcome.dead_reasons.get(reason, 0) + 1
        v += placement_violations(expected, found)
        v += self.watch.final()
        kwargs = spec.chat_template_kwargs
        tokenizer, completer = self.env.tokenizer, self.env.completer
        records = [rec for recs in found.records.values() for rec in recs]
        v += token_violations(
            records,
            lambda messages, tools: render_prompt_ids(tokenizer, messages, kwargs, tools),
            lambda prompt, sampling: completer.complete(prompt, dict(sampling)).output_ids,
        )
        verified = regen(self.redis.url, "verify", "--job", JOB, "--shards-dir", str(self.folder))
        if verified.exit_code != 0:
            v.append(f"regen verify exit {verified.exit_code}: {verified.output[-2000:]}")
        files = regen(self.redis.url, "shards", "verify", str(self.out))
        if files.exit_code != 0:
            v.append(f"regen shards verify exit {files.exit_code}: {files.output[-2000:]}")
        v += self.check_exports(records)

    def check_exports(self, records: list[dict[str, Any]]) -> list[str]:
        problems: list[str] = []
        ids = {rec["id"] for rec in records}
        kept = {
            rec["id"]
            for rec in records
            if not set(rec.get("flags") or ()) & set(DEFAULT_DROP_FLAGS)
        }
        exports = self.work / "exports"
        exports.mkdir()
        target = exports / "specforge.jsonl"
        if self.scenario.export_crash:
            env = {**os.environ, "PYTHONPATH": str(REPO), "REGEN_CRASHPOINT": EXPORT_CRASHPOINT}
            crashed = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "regen",
                    "shards",
                    "export",
                    str(self.out),
                    "--format",
                    "specforge",
                    "--out",
                    str(target),
                    "--redis-url",
                    self.redis.url,
                ],
                env=env,
                capture_output=True,
                check=False,
            )
            if crashed.returncode != -signal.SIGKILL:
                problems.append(
                    f"the export did not reach its crash point: {crashed.stderr[-500:]!r}"
                )
            if target.exists():
                problems.append("an export killed before its commit left its file in place")
        for fmt in ("specforge", "conversations"):
            path = exports / f"{fmt}.jsonl"
            result = regen(
                self.redis.url,
                "shards",
                "export",
                str(self.out),
                "--format",
                fmt,
                "--out",
                str(path),
            )
            if result.exit_code != 0:
                problems.append(f"export {fmt} exit {result.exit_code}: {result.output[-1000:]}")
                continue
            written = [orjson.loads(line)["id"] for line in path.read_bytes().splitlines()]
            problems += export_violations(f"export {fmt}", written, ids)
            if set(written) != kept:
                problems.append(f"export {fmt}: {len(kept - set(written))} kept record(s) missing")
        return problems


@contextlib.contextmanager
def sentinel_master(scenario: Scenario) -> Iterator[None]:
    """For a seed on Sentinel, REGEN_REDIS_SENTINEL_MASTER in this process too: the
    harness's client and the `regen` commands it runs in process read it."""
    if not scenario.sentinel:
        yield
        return
    name = "REGEN_REDIS_SENTINEL_MASTER"
    before = os.environ.get(name)
    os.environ[name] = SENTINEL_MASTER
    settings.load()
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
        settings.load()


def run_seed(env: Environment, scenario: Scenario, work: Path, keep: bool = False) -> Outcome:
    """Run `scenario` in `work` (removed afterwards unless `keep` or it failed)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    with sentinel_master(scenario):
        run = Run(env, scenario, work)
        try:
            outcome = run.run()
        except Exception as exc:  # the harness itself, or a command it ran, broke
            run.outcome.violations.append(f"the run broke: {exc!r}")
            outcome = run.outcome
        finally:
            run.redis.stop()
    outcome.worker_exits = run.workers.restarts()
    outcome.window_kills = run.workers.window_kills
    if not outcome.ok and (events := run.redis.events()):
        outcome.violations.insert(0, f"sentinel events: {events}")
    if not outcome.ok:
        (work / "violations.txt").write_text(
            "\n".join(outcome.violations) + "\n\n" + run.workers.logs()
        )
    elif not keep:
        shutil.rmtree(work, ignore_errors=True)
    return outcome
