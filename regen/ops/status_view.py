"""Draw a `regen status` document (status_snapshot.snapshot) with rich: a table per job,
then one for the workers."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.filesize import decimal
from rich.table import Table
from rich.text import Text

from regen.common import keys


def duration(seconds: float | None) -> str:
    """Compact and coarse: an ETA or an age ("2d 03h", "4m 05s", "12s")."""
    if seconds is None:
        return "-"
    s = int(max(seconds, 0))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {s:02d}s" if s else f"{minutes}m"
    return f"{s}s"


def _rate(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:,.1f} {unit}"


def _reasons(by_stage: dict[str, dict[str, int]]) -> str:
    parts = [
        f"{stage}: " + ", ".join(f"{reason} {n:,}" for reason, n in sorted(reasons.items()))
        for stage in keys.STAGES
        if (reasons := by_stage.get(stage))
    ]
    return " · ".join(parts) or "none"


def _flagged(flagged: dict[str, int], done: int) -> str:
    """Committed records with each quality flag, and their share of what is done."""
    parts = [f"{flag} {n:,} ({100 * n / done:.1f}%)" for flag, n in flagged.items() if n and done]
    return " · ".join(parts) or "none"


def job_table(job: dict[str, Any]) -> Table:
    p = job["prompts"]
    done_pct = f" ({100 * p['done'] / p['total']:.1f}%)" if p["total"] else ""
    rate, shards, parts = job["rate"], job["shards"], job["in_flight_parts"]
    table = Table(
        title=f"job [bold]{job['job']}[/] · {job['model']}",
        title_justify="left",
        show_header=False,
        box=box.SIMPLE,
    )
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    table.add_row(
        "prompts",
        f"{p['total']:,} total · {p['waiting']:,} waiting · {p['in_flight']:,} in flight · "
        f"[green]{p['done']:,} done{done_pct}[/] · {p['dead_lettered']:,} dead-lettered",
    )
    table.add_row(
        "chunks", f"{job['chunks']['waiting']:,} waiting · {job['chunks']['in_flight']:,} in flight"
    )
    table.add_row(
        "in flight",
        f"{parts['generating']:,} generating · {parts['results_pending']:,} results "
        f"not yet in a shard",
    )
    table.add_row(
        "rate",
        f"{_rate(rate['prompts_per_s'], 'prompts/s')} · "
        f"{_rate(rate['output_tokens_per_s'], 'output tokens/s')} "
        f"(last {duration(rate['window_s'])})",
    )
    table.add_row("ETA", duration(job["eta_s"]))
    where = f" in {shards['dir']} on {shards['host']}" if shards["dir"] else ""
    free = f" · {decimal(shards['free_bytes'])} free" if shards["free_bytes"] is not None else ""
    table.add_row("shards", f"{shards['count']:,} · {decimal(shards['bytes'])}{where}{free}")
    table.add_row("flagged records", _flagged(job["committed"]["flagged"], p["done"]))
    table.add_row("dead letters", _reasons(job["dead_letters"]))
    if job["dead_letters_without_prompt"]:
        other = job["dead_letters_without_prompt"]
        table.add_row("bad rows", ", ".join(f"{r} {n:,}" for r, n in sorted(other.items())))
    workers = job["workers"]
    left = workers.get("left_to_faster", 0)
    gone = f" (+{left} left the end to faster servers)" if left else ""
    table.add_row(
        "workers", f"{workers['generate']} generate{gone} · {workers['tokenize']} tokenize"
    )
    for flag in job["flags"]:
        table.add_row(Text("warning", style="bold red"), Text(flag, style="red"))
    return table


def _servers(worker: dict[str, Any]) -> Text:
    stats = worker.get("engine_stats") or {}
    servers = stats.get("servers")
    if not servers:  # an in-process engine: its device, and its own cache hit rate
        device = stats.get("device")
        text = Text(f"{worker.get('engine', '-')}{f' ({device})' if device else ''}")
        _append_hit_rate(text, stats)
        return text
    text = Text()
    for i, server in enumerate(servers):
        ok = server.get("healthy")
        text.append(", " if i else "")
        if not server.get("probed", True):  # no health answer yet: not known to be down
            text.append(f"{server.get('url')} probing", style="yellow")
        else:
            text.append(f"{server.get('url')} ", style="" if ok else "red")
            text.append("up" if ok else "DOWN", style="green" if ok else "bold red")
        text.append(f" {server.get('inflight', 0)}")
        if "max_inflight" in server:  # the limit, and why it last moved
            text.append(f"/{server['max_inflight']} ({server.get('limit_reason', 'fixed')})")
        _append_hit_rate(text, server)
    return text


def _append_hit_rate(text: Text, stats: dict[str, Any]) -> None:
    hit_rate = stats.get("cache_hit_rate")
    if hit_rate is not None:  # None: not reported (yet), which is not 0%
        text.append(f" cache {hit_rate:.0%}", style="dim")


def workers_table(workers: list[dict[str, Any]]) -> Table:
    table = Table(title="workers", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("worker", "kind", "engine / servers", "in flight", "tokens/s", "last seen"):
        table.add_column(name, justify="right" if name in ("in flight", "tokens/s") else "left")
    table.add_column("state")
    for w in workers:
        if w.get("kind") == "tokenize":
            jobs = w.get("jobs") or {}
            where = Text(f"{w.get('out_dir', '-')} ({decimal(w.get('free_bytes') or 0)} free)")
            inflight = str(sum(j.get("open_rows", 0) for j in jobs.values()))
        else:
            where, inflight = _servers(w), str(w.get("inflight", 0))
        if w["stale"]:
            state = Text("STALE", style="bold red")
        elif w.get("paused_for_disk"):
            state = Text("paused: disk", style="bold red")
        elif w.get("healthy") is False:
            state = Text("unhealthy", style="bold red")
        else:
            state = Text("ok", style="green")
        table.add_row(
            w["name"], str(w.get("kind", "-")), where, inflight,
            f"{w.get('tokens_per_s', 0):,.0f}", f"{duration(w['age_s'])} ago", state,
        )  # fmt: skip
    if not workers:
        table.add_row("(none)", "", "", "", "", "", "")
    return table


def render(document: dict[str, Any]) -> RenderableType:
    jobs: list[RenderableType] = [job_table(job) for job in document["jobs"]]
    return Group(*(jobs or [Text("no jobs in this Redis")]), workers_table(document["workers"]))
