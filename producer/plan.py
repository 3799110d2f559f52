"""`regen plan`: what a job will cost, worked out before any GPU is spent on it.

Prompts and prompt tokens are counted by `producer.prompt_scan` (as enqueue would see
them), bytes per record are measured by `producer.record_size`; this module turns them
into output tokens, generation time and disk, and checks the disk against `--out`.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from regen.common import defaults
from regen.common.bucket_folder import is_bucket_url
from regen.common.jobspec import TURNS_ALL
from regen.producer.prompt_scan import PromptScan, percentile, scan_prompts
from regen.producer.record_size import RecordModelError, RecordSizeModel, measure
from regen.producer.spec import PreparedJob

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Tokens, generation time and disk for `prompts` prompts."""

    prompts: int
    output_tokens_per_prompt: float
    # One server's output (decode) throughput under load, as SGLang's gen_throughput
    # metric reports it; prefill time is inside it.
    tokens_per_s: float
    servers: int = 1
    prompt_tokens: int = 0
    bytes_per_record: float | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0 or self.servers < 1:
            raise ValueError("tokens_per_s must be positive and servers at least 1")

    @property
    def output_tokens(self) -> int:
        return round(self.prompts * self.output_tokens_per_prompt)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def seconds(self) -> float:
        """Wall time to generate every output token, the servers sharing the work."""
        return self.output_tokens / (self.tokens_per_s * self.servers)

    @property
    def days(self) -> float:
        return self.seconds / SECONDS_PER_DAY

    @property
    def disk_bytes(self) -> int | None:
        if self.bytes_per_record is None:
            return None
        return round(self.prompts * self.bytes_per_record)


def free_space(out: Path | str) -> tuple[str, int | None]:
    """Where was measured, and the free bytes on the filesystem `out` is (or will be)
    on; None for object storage, which has no free space to read.

    `out` may not exist yet: the nearest existing folder above it is on the same
    filesystem unless a mount point is created in between, which regen never does.
    """
    if isinstance(out, str) and is_bucket_url(out):
        return out, None
    probe = Path(out).expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    return str(probe), shutil.disk_usage(probe).free


@dataclass(frozen=True)
class Plan:
    """Everything `regen plan` reports; `warnings` are what `--strict` fails on."""

    datasets: list[str]
    job: PreparedJob
    scan: PromptScan
    output_source: str  # where the output tokens per prompt come from
    tokens_per_s_assumed: bool  # the default rate, not the user's
    estimate: Estimate
    record_model: RecordSizeModel | None
    out: str  # the existing folder whose filesystem was measured, or the bucket URL
    free_bytes: int | None  # None: object storage, not measured
    warnings: list[str]

    @property
    def fits(self) -> bool | None:
        disk = self.estimate.disk_bytes
        if disk is None or self.free_bytes is None:
            return None
        return disk <= self.free_bytes

    def prompt_token_stats(self) -> dict[str, float]:
        lengths = sorted(self.scan.accepted_lengths)
        est = self.estimate
        return {
            "total": est.prompt_tokens,
            "mean": est.prompt_tokens / est.prompts if est.prompts else 0.0,
            "p50": percentile(lengths, 50),
            "p95": percentile(lengths, 95),
            "max": lengths[-1] if lengths else 0,
        }

    def to_json(self) -> dict[str, Any]:
        scan, est, spec = self.scan, self.estimate, self.job.spec
        model = self.record_model
        return {
            "datasets": self.datasets,
            "model": spec.model,
            "chat_family": spec.chat_family,
            "chat_template_kwargs": spec.chat_template_kwargs,
            "turns": spec.turns,
            "max_new_tokens": spec.sampling["max_new_tokens"],
            "prompt_token_limit": spec.prompt_token_limit(),
            "rows_read": scan.rows_read,
            "unique_prompts": scan.unique,
            "duplicates": scan.duplicates,
            "rejected": scan.rejected(),
            "tokenized": scan.tokenized,
            "exact": scan.exact,
            "prompts": est.prompts,
            "prompt_tokens": self.prompt_token_stats(),
            "output_tokens": {
                "per_prompt": est.output_tokens_per_prompt,
                "from": self.output_source,
                "total": est.output_tokens,
            },
            "total_tokens": est.total_tokens,
            "generation": {
                "tokens_per_s_per_server": est.tokens_per_s,
                "tokens_per_s_assumed": self.tokens_per_s_assumed,
                "servers": est.servers,
                "seconds": est.seconds,
                "hours": est.seconds / 3600,
                "days": est.days,
            },
            "disk": {
                "bytes": est.disk_bytes,
                "bytes_per_record": est.bytes_per_record,
                "record_model": None if model is None else asdict(model),
                "out": str(self.out),
                "free_bytes": self.free_bytes,
                "fits": self.fits,
            },
            "warnings": self.warnings,
        }

    def to_text(self) -> str:
        scan, est, spec = self.scan, self.estimate, self.job.spec
        stats = self.prompt_token_stats()
        rejected = scan.rejected()
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in rejected.items())
        if scan.exact:
            how = "exact: every unique prompt tokenized"
        else:
            how = (
                f"sampled: {scan.tokenized:,} of {scan.unique:,} unique prompts tokenized, "
                "token counts and template/length rejections scaled up"
            )
        servers = f"{est.servers} server" + ("s" if est.servers != 1 else "")
        rate = f"{est.tokens_per_s:,.0f} output tokens/s per server"
        if self.tokens_per_s_assumed:
            rate += " (assumed: pass --output-tokens-per-s)"
        lines = [
            f"model {spec.model} ({spec.chat_family}), max_new_tokens "
            f"{spec.sampling['max_new_tokens']:,}, template kwargs {spec.chat_template_kwargs}, "
            f"turns {spec.turns}",
            f"rows read          {scan.rows_read:,}",
            f"unique prompts     {scan.unique:,} (duplicates {scan.duplicates:,})",
            f"rejected           {sum(rejected.values()):,}" + (f": {reasons}" if reasons else ""),
            f"prompts to send    {est.prompts:,}{self._turns_text()}",
            f"prompt tokens      {stats['total']:,} total; mean {stats['mean']:,.0f}, "
            f"p50 {stats['p50']:,}, p95 {stats['p95']:,}, max {stats['max']:,} ({how})",
            f"output tokens      {est.output_tokens:,} "
            f"({est.output_tokens_per_prompt:,.0f} per prompt: {self.output_source})",
            f"tokens in records  {est.total_tokens:,}",
            f"generation         {human_duration(est.seconds)} at {rate} x {servers}",
            f"shards on disk     {self._disk_text()}",
            f"free space         {self._free_text()}",
        ]
        lines += [f"WARNING: {warning}" for warning in self.warnings]
        return "\n".join(lines)

    def _free_text(self) -> str:
        if self.free_bytes is None:
            return f"not checked: {self.out} is object storage (no free space to read)"
        return f"{human_bytes(self.free_bytes)} at {self.out}"

    def _turns_text(self) -> str:
        samples = self.job.spec.samples
        text = f" ({samples} samples of each)" if samples > 1 else ""
        if self.job.spec.turns != TURNS_ALL:
            return text
        return text + (
            " (every assistant turn; later turns' prompt tokens are counted without the "
            "target's earlier answers, a lower bound)"
        )

    def _disk_text(self) -> str:
        model, est = self.record_model, self.estimate
        if model is None or est.disk_bytes is None or est.bytes_per_record is None:
            return "unknown"
        reused = ""
        if model.text_shuffled:
            reused = "; too little dataset text, so answers reuse it shuffled: rough"
        return (
            f"about {human_bytes(est.disk_bytes)}: {est.bytes_per_record:,.0f} bytes per "
            f"record, {model.bytes_per_token:.2f} per token (zstd {model.zstd_ratio:.1f}x; "
            f"measured on {model.records} records built with the real tokenizer at "
            f"{model.measured_output_tokens:,} output tokens{reused})"
        )


def build_plan(
    paths: Sequence[Path],
    job: PreparedJob,
    *,
    out: Path | str,
    tokens_per_s: float | None = None,
    servers: int = defaults.PLAN_SERVERS,
    mean_output_tokens: float | None = None,
    sample: int | None = defaults.PLAN_SAMPLE,
    seed: int = defaults.PLAN_SEED,
) -> Plan:
    scan = scan_prompts(paths, job, sample=sample, seed=seed)
    max_new = job.spec.sampling["max_new_tokens"]
    per_prompt = float(max_new if mean_output_tokens is None else mean_output_tokens)
    source = "max_new_tokens, an upper bound" if mean_output_tokens is None else "given mean"
    warnings = []
    if scan.accepted == 0:
        warnings.append("no prompt in these datasets would be enqueued")
    if per_prompt > max_new:
        warnings.append(
            f"the mean output of {per_prompt:,.0f} tokens exceeds max_new_tokens {max_new:,}"
        )
    model, bytes_per_record = None, None
    if scan.examples:
        try:
            model = measure(job, scan.examples, scan.answer_texts, per_prompt)
        except RecordModelError as exc:
            warnings.append(
                f"the record checks reject a well-formed synthetic answer ({exc}): this "
                "job's records would likely be rejected too; no disk size estimated"
            )
        else:
            mean_prompt = scan.prompt_tokens / scan.accepted
            bytes_per_record = model.bytes_per_record(mean_prompt, per_prompt)
    # Each of a prompt's samples is a request and a record of its own.
    samples = job.spec.samples
    est = Estimate(
        prompts=scan.accepted * samples,
        output_tokens_per_prompt=per_prompt,
        tokens_per_s=tokens_per_s or defaults.PLAN_TOKENS_PER_S,
        servers=servers,
        prompt_tokens=scan.prompt_tokens * samples,
        bytes_per_record=bytes_per_record,
    )
    probe, free = free_space(out)
    if est.disk_bytes is not None and free is not None and est.disk_bytes > free:
        warnings.append(
            f"the shards need about {human_bytes(est.disk_bytes)} but {probe} has only "
            f"{human_bytes(free)} free"
        )
    return Plan(
        datasets=[str(p) for p in paths],
        job=job,
        scan=scan,
        output_source=source,
        tokens_per_s_assumed=tokens_per_s is None,
        estimate=est,
        record_model=model,
        out=probe,
        free_bytes=free,
        warnings=warnings,
    )


def human_bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:,.0f} B" if i == 0 else f"{n:,.1f} {units[i]}"


def human_duration(seconds: float) -> str:
    """Days and hours for long runs, hours or minutes for short ones."""
    if seconds >= SECONDS_PER_DAY:
        return f"{seconds / SECONDS_PER_DAY:,.1f} days ({seconds / 3600:,.0f} hours)"
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} hours"
    return f"{seconds / 60:,.1f} minutes"
