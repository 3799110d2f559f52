"""One chaos run drawn from its seed: the job, the workers, and the faults with their times.

Everything a run does is drawn here from `random.Random(f"{mode}:{seed}")`, before the run
starts, so a seed replays the same job and the same schedule (the processes' own timing
still varies: a replay that passes where the first run failed points at a race). The
faults added later (LATER_FAULTS) are drawn from a stream of their own, so that a seed
drew the same job and the same earlier faults before they were added.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("single", "turns")

# Named points where a worker kills itself the first time it gets there (common/crashpoints).
GENERATE_CRASHPOINTS = ("generate.after_hand_off", "generate.before_ack")
TURN_CRASHPOINTS = ("generate.between_turns",)
TOKENIZE_CRASHPOINTS = (
    "tokenize.mid_shard",
    "tokenize.after_claim",
    "tokenize.after_place",
    "tokenize.after_rename",
)
EXPORT_CRASHPOINT = "export.before_commit"

# Timed faults, and how often each is drawn.
FAULT_WEIGHTS = {
    "kill_generate": 4,  # SIGKILL of a generate worker's process group (its host dies)
    "kill_tokenize": 3,
    "freeze_generate": 2,  # SIGSTOP past the chunk lease, then SIGCONT
    "freeze_tokenize": 1,  # SIGSTOP past the shard lease, then SIGCONT
    "redis_kill": 2,  # SIGKILL of Redis, restarted from its append-only file
    "redis_rollback": 2,  # Redis back from an older copy; it heals by itself
    "server_errors": 3,  # the SGLang server answers errors for a few requests
}
SERVER_ERROR_KINDS = ("500", "503", "drop", "malformed")
# Faults added to a seed's schedule, each with its chance, from `Random(f"{mode}:{seed}:later")`.
LATER_FAULTS = {
    # One more generate worker whose first process SIGKILLs itself inside kombu's window
    # (a chunk popped, not yet in `unacked`); drawn early, while chunks are still queued.
    "kill_in_kombu_window": 0.25,
    # The seed runs on a Redis Sentinel deployment; its primary is SIGKILLed and the
    # replica promoted, whatever it had not yet replicated lost.
    "sentinel_failover": 0.2,
}
KOMBU_WINDOW_BEFORE_S = 2.0
# A generate worker told to stop (SIGTERM, as Slurm, Kubernetes and `docker stop` do): it
# drains, handing its running answers back to the queue, and is started again, as a
# requeued job is. From its own stream `Random(f"{mode}:{seed}:drain")`; its detail:
# "" (the drain runs to its end), "kill:S" (SIGKILL S seconds in: mid-abort or
# mid-give-back) or "twice" (a second SIGTERM once it drains: it exits at once).
DRAIN_CHANCE = 0.35
DRAIN_DETAILS = ("", "kill", "twice")
# The chance that a seed's shards go to a bucket (moto's S3 server) instead of a local
# folder, from its own stream `Random(f"{mode}:{seed}:store")`: earlier draws unchanged.
BUCKET_CHANCE = 0.25


@dataclass(frozen=True)
class Fault:
    at_s: float  # after the workers were started
    kind: str
    target: int = 0  # which worker of its kind (modulo those running)
    detail: str = ""  # server_errors: the kind; redis_rollback: when the copy was taken


@dataclass(frozen=True)
class Scenario:
    seed: int
    mode: str
    rows: int
    chunk_size: int
    generate_workers: int
    tokenize_workers: int
    # (worker kind, crash point): that worker's first process dies there.
    crashpoints: tuple[tuple[str, str], ...] = ()
    faults: tuple[Fault, ...] = ()
    export_crash: bool = False
    copy_at_s: float | None = None  # when the copy a rollback restores is taken
    samples: int = 1  # answers a prompt (`--samples`)
    oversized_row: bool = False  # a row over --max-row-bytes: refused into the input DLQ
    sentinel: bool = False  # Redis is a primary, a replica and three sentinels
    bucket: bool = False  # the shards go to object storage (`--out s3://...`)

    def describe(self) -> str:
        faults = ", ".join(
            f"{f.kind}{'(' + f.detail + ')' if f.detail else ''}@{f.at_s:.1f}s" for f in self.faults
        )
        crashes = ", ".join(f"{kind}:{point}" for kind, point in self.crashpoints)
        return (
            f"seed {self.seed} ({self.mode}): {self.rows} rows in chunks of {self.chunk_size}, "
            f"{self.generate_workers} generate + {self.tokenize_workers} tokenize worker(s); "
            f"crash points [{crashes}]; faults [{faults}]"
            f"{'; export crashes once' if self.export_crash else ''}"
            f"{f'; {self.samples} samples a prompt' if self.samples > 1 else ''}"
            f"{'; one row too large' if self.oversized_row else ''}"
            f"{'; on Redis Sentinel' if self.sentinel else ''}"
            f"{'; shards to a bucket' if self.bucket else ''}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def draw(seed: int, mode: str) -> Scenario:
    """The run of `seed` in `mode` ("single": the last turn of each row; "turns": every
    turn, tool conversations among them)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    rng = random.Random(f"{mode}:{seed}")
    rows = rng.randint(8, 24) if mode == "single" else rng.randint(4, 10)
    crashpoints: list[tuple[str, str]] = []
    generate_points = GENERATE_CRASHPOINTS + (TURN_CRASHPOINTS if mode == "turns" else ())
    for _ in range(rng.choice((0, 1, 1, 2))):
        if rng.random() < 0.5:
            crashpoints.append(("generate", rng.choice(generate_points)))
        else:
            crashpoints.append(("tokenize", rng.choice(TOKENIZE_CRASHPOINTS)))
    kinds = list(FAULT_WEIGHTS)
    weights = list(FAULT_WEIGHTS.values())
    faults: list[Fault] = []
    copy_at_s = None
    for _ in range(rng.randint(1, 3)):
        kind = rng.choices(kinds, weights)[0]
        if kind == "redis_rollback" and copy_at_s is not None:
            kind = "redis_kill"  # one copy a run: a second rollback adds nothing new
        at_s = round(rng.uniform(0.0, 6.0 if mode == "single" else 10.0), 2)
        detail = ""
        if kind == "server_errors":
            detail = f"{rng.choice(SERVER_ERROR_KINDS)}:{rng.randint(1, 4)}"
        elif kind == "redis_rollback":
            copy_at_s = round(rng.uniform(0.0, at_s), 2)
            detail = f"copy@{copy_at_s}s"
        faults.append(Fault(at_s, kind, rng.randrange(3), detail))
    later = random.Random(f"{mode}:{seed}:later")
    for kind, chance in LATER_FAULTS.items():
        if later.random() < chance:
            until_s = (
                KOMBU_WINDOW_BEFORE_S
                if kind == "kill_in_kombu_window"
                else (6.0 if mode == "single" else 10.0)
            )
            faults.append(Fault(round(later.uniform(0.0, until_s), 2), kind))
    drain = random.Random(f"{mode}:{seed}:drain")
    if drain.random() < DRAIN_CHANCE:
        detail = drain.choice(DRAIN_DETAILS)
        if detail == "kill":
            detail = f"kill:{round(drain.uniform(0.05, 1.5), 2)}"
        at_s = round(drain.uniform(0.5, 6.0 if mode == "single" else 10.0), 2)
        faults.append(Fault(at_s, "drain_generate", drain.randrange(3), detail))
    faults.sort(key=lambda f: f.at_s)
    return Scenario(
        seed=seed,
        mode=mode,
        rows=rows,
        chunk_size=rng.randint(2, 5),
        generate_workers=rng.randint(1, 3),
        tokenize_workers=rng.randint(1, 3),
        crashpoints=tuple(crashpoints),
        faults=tuple(faults),
        export_crash=rng.random() < 0.3,
        copy_at_s=copy_at_s,
        samples=rng.choice((1, 1, 1, 2)),
        oversized_row=rng.random() < 0.2,
        sentinel=any(f.kind == "sentinel_failover" for f in faults),
        bucket=random.Random(f"{mode}:{seed}:store").random() < BUCKET_CHANCE,
    )
