"""What the demo prints at the end: the run's numbers and one record, decoded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.table import Table
from rich.text import Text

from regen.common import dlq, jobspec
from regen.common.ledger.job_ids import JobIds
from regen.consumers.tokenize.operator_view import iter_records, read_manifest, shard_paths

# Tokens of the prompt's tail and of the answer shown around the loss-mask boundary.
CONTEXT_TOKENS = 12


def show_summary(
    console: Console, r: redis.Redis, spec: jobspec.JobSpec, folder: Path, elapsed_s: float
) -> None:
    manifest = read_manifest(folder).shards
    completion = sum(info.completion_tokens for info in manifest.values())
    prompt = sum(info.prompt_tokens for info in manifest.values())
    records = sum(info.rows for info in manifest.values())
    table = Table(title="summary", show_header=False)
    table.add_row("prompts in the job", str(JobIds(r, spec.name).count()))
    table.add_row("records in shards", str(records))
    table.add_row("prompt / output tokens", f"{prompt} / {completion}")
    table.add_row(
        "output tokens/s (in shards, over the whole run)",
        f"{completion / max(elapsed_s, 1e-9):.1f}",
    )
    table.add_row(
        "shards",
        f"{len(manifest)} in {folder} ({sum(i.compressed_bytes for i in manifest.values())} bytes)",
    )
    letters = dlq.reasons(r, [spec.name])
    for stage, reasons in letters.items():
        if reasons:
            table.add_row(f"DLQ {stage}", ", ".join(f"{k}: {v}" for k, v in reasons.items()))
    console.print(table)
    flagged: Counter[str] = Counter()
    for info in manifest.values():
        flagged.update(info.flags)
    for line in outcome(spec, records, flagged, letters):
        console.print(line)


# What each quality flag and dead-letter reason means, in a newcomer's words.
FLAG_WORDS = {
    "truncated": "the answer reached max_new_tokens ({max_new_tokens} here) and was cut; "
    "kept, since every token is still the model's own",
    "empty": "the model answered nothing",
    "thinking_only": "the model thought but gave no answer",
    "repetition": "the answer ends in a loop",
    "bad_tool_call": "a tool call that does not parse, or names a tool not offered",
}
REASON_WORDS = {
    "empty_content": "a row with an empty message; the sample holds one on purpose",
    "rejected_by_server": "the server refused the prompt (e.g. longer than its context)",
    "prompt_too_long": "the prompt does not fit the context with max_new_tokens",
    "truncated": "cut at max_new_tokens (this tokenize worker runs --on-truncated dlq)",
}


def outcome(
    spec: jobspec.JobSpec,
    records: int,
    flagged: Counter[str],
    letters: dict[str, Counter[str]],
) -> list[str]:
    """Where every prompt ended, and why, in words."""
    max_new_tokens = spec.sampling.get("max_new_tokens")
    lines = [
        "[bold green]Done: every prompt is accounted for.[/]",
        f"  {records} written as training records.",
    ]
    for flag, n in sorted(flagged.items()):
        words = FLAG_WORDS.get(flag, "").format(max_new_tokens=max_new_tokens)
        lines.append(f"    {n} of them flagged {flag}: {words}.")
    if flagged:
        lines.append(
            "    Flags let a trainer choose: `regen shards export` leaves out every flag "
            "but truncated by default (--drop)."
        )
    for stage, reasons in letters.items():
        for reason, n in sorted(reasons.items()):
            words = REASON_WORDS.get(reason, "see `regen dlq list`")
            lines.append(f"  {n} in the {stage} dead-letter queue as {reason}: {words}.")
    return lines


def example_record(folder: Path) -> dict[str, Any] | None:
    """The record to show a newcomer: the first with no quality flag (one a trainer
    keeps as it is), else the first; None when there is none."""
    first = None
    for shard in shard_paths(folder):
        for record in iter_records(shard):
            if not record.get("flags"):
                return record
            first = first or record
    return first


def show_record(console: Console, folder: Path, tokenizer: Any) -> None:
    """The example record: its conversation, and where the loss mask turns on."""
    record = example_record(folder)
    if record is None:
        console.print("[red]no record was written[/]")
        return
    ids, mask = record["input_ids"], record["loss_mask"]
    boundary = mask.index(1) if 1 in mask else len(mask)
    flags = ", ".join(record.get("flags") or ()) or "none"
    console.rule(f"record {record['id']} (schema {record['schema']}, flags: {flags})")
    for message in record["messages"]:
        console.print(Text(f"{message['role']}: ", style="bold"), Text(message["content"]))
    console.print(
        f"input_ids: {len(ids)} tokens = {record['prompt_tokens']} prompt (loss_mask 0) + "
        f"{record['completion_tokens']} generated (loss_mask 1, end of turn included)"
    )
    window = range(max(boundary - CONTEXT_TOKENS, 0), min(boundary + CONTEXT_TOKENS, len(ids)))
    line = Text()
    for i in window:
        piece = tokenizer.decode([ids[i]]).replace("\n", "\\n")
        line.append(f"{piece}", style="on grey23" if mask[i] == 0 else "on dark_green")
        line.append("|")
    console.print("tokens around the boundary (grey: mask 0, green: mask 1):")
    console.print(line)
    last = tokenizer.decode([ids[-1]])
    console.print(f"last token: {last!r} (id {ids[-1]}), loss_mask {mask[-1]}")
