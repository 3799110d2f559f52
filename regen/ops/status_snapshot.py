"""What `regen status` reports, as one JSON-ready document: per job its prompt counts,
rates, ETA, shards and warnings; per worker its last heartbeat.

Every count is O(window) or O(1) in Redis (common/ledger/places.py), so it can be redrawn
every few seconds on a 1M-prompt job; `regen verify` is the exact, id-by-id check.
"""

from __future__ import annotations

import os
import time
from typing import Any

import orjson
import redis

from regen.common import (
    defaults,
    job_pause,
    jobspec,
    keys,
    provenance,
    settings,
    tokenizer_refusals,
)
from regen.common.jobspec import JobSpec
from regen.common.ledger import places
from regen.consumers.tokenize.operator_view import (
    CommitLedger,
    LocalFolder,
    Sample,
    behind_message,
    folder_at,
)


def window_rates(samples: list[Sample], now: Sample, window_s: float) -> tuple[float, float] | None:
    """(prompts/s, output tokens/s) over about the last `window_s`, from the samples the
    tokenize stage takes at each shard commit (oldest first) and the totals `now`.

    The baseline is the newest sample at least `window_s` old; a job younger than that
    is measured from its first commit. None when there is nothing to measure yet: a
    single recent commit says how much, not how fast.
    """
    start = now.time - window_s
    older = [s for s in samples if s.time <= start]
    if older:
        base = older[-1]
    elif len(samples) >= 2:
        base = samples[0]
    else:
        return None
    span = now.time - base.time
    if span <= 0:
        return None
    return (now.prompts - base.prompts) / span, (now.tokens - base.tokens) / span


def _free_bytes(output: dict[str, Any], beats: dict[str, dict[str, Any]]) -> int | None:
    """Free space where the job's shards are: measured now when they are on this host,
    else the writing worker's last report (`beats`: live workers by name)."""
    folder = output.get("dir")
    if output.get("host") == os.uname().nodename and folder and os.path.isdir(folder):
        stat = os.statvfs(folder)
        return stat.f_bavail * stat.f_frsize
    beat = beats.get(output.get("worker", ""))
    return None if beat is None or beat.get("free_bytes") is None else int(beat["free_bytes"])


def _behind_disk(
    ledger: CommitLedger, job: str, output: dict[str, Any], workers: list[dict[str, Any]]
) -> str | None:
    """Why the job is not written because Redis is behind its shards, with the fix: as a
    live tokenize worker reports it, or checked here when the folder is on this host."""
    for worker in workers:
        if job in (worker.get("behind") or {}):
            return f"tokenize worker {worker['name']}: {worker['behind'][job]}"
    where = output.get("dir")
    if not where:
        return None
    folder = folder_at(where)
    on_this_host = output.get("host") == os.uname().nodename
    if isinstance(folder, LocalFolder) and not (on_this_host and folder.readable_here()):
        return None
    return behind_message(ledger, job, folder)


def job_status(
    r: redis.Redis, spec: JobSpec, workers: list[dict[str, Any]], window_s: float
) -> dict[str, Any]:
    job = spec.name
    counts = places.count_places(r, spec)
    ledger = CommitLedger(r, job)
    totals = ledger.totals()
    raw_output = r.hget(keys.TOKENIZE_OUTPUTS, job)
    output = orjson.loads(raw_output) if raw_output else {}
    free = _free_bytes(output, {w["name"]: w for w in workers if not w["stale"]})
    now = totals.now
    rates = window_rates(totals.samples, now, window_s)
    remaining = max(counts.total - counts.done - counts.dead_lettered - counts.purged, 0)
    eta = 0.0 if remaining == 0 else remaining / rates[0] if rates and rates[0] > 0 else None

    live = [w for w in workers if not w["stale"]]
    generators = [w for w in live if w.get("kind") == "generate" and spec.queue in w["queues"]]
    # Workers on slower servers that left the job's end to faster ones (stand_down.py).
    left = [w for w in live if spec.queue in w.get("left_to_faster", [])]
    tokenizers = [w for w in live if w.get("kind") == "tokenize" and job in w.get("jobs", {})]
    flags = []
    paused = r.get(keys.job_paused(job))
    if paused is not None:
        flags.append(f"paused{' --now' if paused == job_pause.NOW.encode() else ''}: no worker "
                     f"takes its prompts until `regen resume {job}`")  # fmt: skip
    behind = _behind_disk(ledger, job, output, live)
    if behind:
        flags.append(behind)
    if counts.waiting_chunks and not generators and paused is None:
        flags.append(
            f"{counts.waiting_chunks} chunk(s) wait on {spec.queue} but no live generate "
            "worker consumes it"
        )
    if counts.results_pending and not tokenizers:
        flags.append(
            f"{counts.results_pending} result(s) wait but no live tokenize worker has this job open"
        )
    for worker in tokenizers:
        if worker.get("paused_for_disk"):
            flags.append(f"tokenize worker {worker['name']} is paused: low disk")
    mixed = provenance.mixed_versions(totals.server_versions)
    if mixed:
        flags.append(mixed)
    flags += tokenizer_refusals.warnings(r, job, {w["name"] for w in live})
    if remaining and not r.exists(keys.job_follower(job)):
        flags.append(
            "no `regen enqueue --follow` is following this unfinished job: prompts a failure "
            "loses (a chunk lost in kombu's window, a Redis rollback) are not queued again; "
            "run the job's enqueue command with --follow"
        )
    if counts.unplaced:
        flags.append(
            f"{counts.unplaced:+} prompt(s) in no place by these counts: "
            "`regen verify` checks id by id"
        )
    return {
        "job": job,
        "model": spec.model,
        "queue": spec.queue,
        "prompts": {
            "total": counts.total, "waiting": counts.waiting, "in_flight": counts.in_flight,
            "done": counts.done, "dead_lettered": counts.dead_lettered,
            "purged": counts.purged, "unplaced": counts.unplaced,
        },
        # In flight, by where: prompts in chunks workers hold, results not yet in a shard
        # (of which `committing` are claimed by a shard being committed).
        "in_flight_parts": {
            "generating": counts.generating, "results_pending": counts.results_pending,
            "committing": counts.committing,
        },
        "chunks": {"waiting": counts.waiting_chunks, "in_flight": counts.in_flight_chunks},
        "dead_letters": counts.dead_letters,
        "dead_letters_without_prompt": counts.other_dead_letters,
        "committed": {
            "prompts": now.prompts, "output_tokens": now.tokens, "flagged": totals.flags,
            "server_versions": totals.server_versions,
        },
        "rate": {
            "window_s": window_s,
            "prompts_per_s": rates[0] if rates else None,
            "output_tokens_per_s": rates[1] if rates else None,
        },
        "eta_s": None if paused is not None else eta,
        "paused": paused is not None,
        "shards": {
            "count": totals.shards, "bytes": totals.shard_bytes, "dir": output.get("dir"),
            "host": output.get("host"), "free_bytes": free,
        },
        "workers": {
            "generate": len(generators), "tokenize": len(tokenizers),
            "left_to_faster": len(left),
        },
        "flags": flags,
    }  # fmt: skip


def worker_status(r: redis.Redis) -> list[dict[str, Any]]:
    """Every worker's last heartbeat, with its age and whether it is stale (a worker that
    stopped cleanly removes its record, so a stale one died or is stuck)."""
    now = time.time()
    out = []
    for name, raw in sorted(r.hgetall(keys.WORKERS).items()):
        beat = orjson.loads(raw)
        age = now - float(beat.get("last_seen", 0))
        beat.update(
            name=places.text(name), age_s=age, stale=age > settings.current().heartbeat_stale_s,
            queues=beat.get("queues") or [],
        )  # fmt: skip
        out.append(beat)
    return out


def snapshot(
    r: redis.Redis, job: str | None = None, window_s: float = defaults.STATUS_RATE_WINDOW_S
) -> dict[str, Any]:
    """The whole status document: one job, or every job in this Redis."""
    names = [job] if job else jobspec.list_jobs(r)
    workers = worker_status(r)
    jobs = [job_status(r, jobspec.load(r, name), workers, window_s) for name in names]
    return {"time": time.time(), "jobs": jobs, "workers": workers}
