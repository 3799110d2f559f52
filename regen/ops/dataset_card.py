"""The dataset card of a `--format hf` export: a README.md with a Hugging Face YAML header
(features, the split, its size; the license left for the user to fill) and a body that
says what made the data and what is in it, with a histogram of answer lengths.

`datasets.load_from_disk` reads the folder as `save_to_disk` wrote it; the header's
`configs` points `datasets.load_dataset` at the same Arrow files, and `huggingface_hub`'s
`DatasetCard` parses it as the Hub does.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from huggingface_hub import DatasetCard, DatasetCardData

from regen.common.quality_flags import FLAGS

# Answer lengths are counted in bins that double: 1, 2-3, 4-7, ... tokens, so the
# histogram needs no list of every length (memory stays flat over millions of records).
HISTOGRAM_FILE = "answer_lengths.png"
_PROVENANCE_ROWS = (
    ("regen version", "regen_version"), ("model", "model"), ("model revision", "model_revision"),
    ("tokenizer", "tokenizer"), ("tokenizer fingerprint", "tokenizer_fingerprint"),
    ("chat template sha256", "chat_template_sha256"), ("chat template kwargs",
    "chat_template_kwargs"), ("thinking", "thinking"), ("turns", "turns"),
    ("sampling sent", "sampling"), ("sampling in effect", "effective_sampling"),
    ("SGLang versions (records)", "server_versions"),
)  # fmt: skip


@dataclass
class ExportedStats:
    """What the records an export wrote hold, counted as they stream by."""

    records: int = 0
    prompt_tokens: int = 0
    answer_tokens: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    flags: Counter[str] = field(default_factory=Counter)
    length_bins: Counter[int] = field(default_factory=Counter)  # bin k: 2**k .. 2**(k+1)-1
    models: set[str] = field(default_factory=set)

    def add(self, record: dict[str, Any]) -> None:
        self.records += 1
        self.models.add(record["model"])
        self.prompt_tokens += record["prompt_tokens"]
        self.answer_tokens += record["completion_tokens"]
        self.finish_reasons[record["finish_reason"]] += 1
        self.flags.update(record.get("flags", ()))
        self.length_bins[max(record["completion_tokens"], 1).bit_length() - 1] += 1


def length_bins(bins: Counter[int]) -> list[tuple[str, int]]:
    """Every bin from the shortest answer's to the longest's: its label and its count."""
    ks = range(min(bins, default=0), max(bins, default=0) + 1)
    return [(f"{2**k}" if k == 0 else f"{2**k}-{2 ** (k + 1) - 1}", bins.get(k, 0)) for k in ks]


def histogram_png(bins: Counter[int]) -> bytes | None:
    """A bar chart of answer lengths by doubling bins, as PNG bytes; None without
    matplotlib (the `export` extra), the one part of the card that needs it."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display: write files only
    from matplotlib import pyplot

    labels, counts = zip(*length_bins(bins), strict=True)
    figure, axes = pyplot.subplots(figsize=(8, 3.5), dpi=100)
    axes.bar(labels, counts, color="#4c72b0")
    axes.set_xlabel("answer length (tokens)")
    axes.set_ylabel("records")
    axes.set_title("Answer lengths")
    axes.tick_params(axis="x", labelrotation=45)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    pyplot.close(figure)
    return out.getvalue()


def write_card(
    folder: Path,
    *,
    features: list[dict[str, Any]],
    num_bytes: int,
    stats: ExportedStats,
    dropped: Counter[str],
    provenances: list[dict[str, Any]],
    dead_letters: dict[str, Counter[str]] | None,
) -> bool:
    """Write README.md and the histogram into an exported `datasets` folder; False when
    the histogram could not be drawn (no matplotlib): the card gives it as a table."""
    picture = histogram_png(stats.length_bins)
    if picture is not None:
        (folder / HISTOGRAM_FILE).write_bytes(picture)
    data = DatasetCardData(
        # The user's to fill: it follows the prompts' and the model's licenses.
        license="unknown",
        tags=["speculative-decoding", "drafter-training", "regen"],
        task_categories=["text-generation"],
        configs=[{"config_name": "default",
                  "data_files": [{"split": "train", "path": "data-*.arrow"}]}],
        dataset_info={"features": features,
                      "splits": [{"name": "train", "num_bytes": num_bytes,
                                  "num_examples": stats.records}]},
    )  # fmt: skip
    body = "\n".join(_body(stats, dropped, provenances, dead_letters, picture is not None))
    card = DatasetCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")
    card.save(str(folder / "README.md"))
    return picture is not None


def _body(
    stats: ExportedStats,
    dropped: Counter[str],
    provenances: list[dict[str, Any]],
    dead_letters: dict[str, Counter[str]] | None,
    picture: bool,
) -> list[str]:
    models = ", ".join(sorted(stats.models | {p["model"] for p in provenances if "model" in p}))
    lines = [
        "# Drafter training data regenerated by regen",
        "",
        f"Answers regenerated by the target model ({models}) and written token-exact: each "
        "row's `input_ids` are the prompt ids as sent to the server then the output ids as "
        "generated, and `loss_mask` is 1 on every generated token. The license in the "
        "header is `unknown` until you fill it in: it follows the prompts' and the model's.",
        "",
        "## Contents",
        "",
        "| | |",
        "|---|---|",
        f"| records | {stats.records:,} |",
        f"| prompt tokens | {stats.prompt_tokens:,} |",
        f"| answer tokens | {stats.answer_tokens:,} |",
    ]
    for reason, n in sorted(stats.finish_reasons.items()):
        lines.append(f"| finish `{reason}` | {n:,} |")
    for flag in FLAGS:
        lines.append(f"| flagged `{flag}` (kept) | {stats.flags.get(flag, 0):,} |")
    for reason, n in sorted(dropped.items()):
        lines.append(f"| left out: `{reason}` | {n:,} |")
    if picture:
        lines += ["", f"![Answer lengths]({HISTOGRAM_FILE})"]
    else:
        lines += ["", "| answer length (tokens) | records |", "|---|---|"]
        lines += [f"| {label} | {n:,} |" for label, n in length_bins(stats.length_bins)]
    lines += ["", "## Dead letters", ""]
    if dead_letters is None:
        lines.append("Not known: the export was made without the job's Redis (`--redis-url`).")
    else:
        letters = [(s, r, n) for s, reasons in dead_letters.items() for r, n in reasons.items()]
        lines += ["| stage | reason | prompts |", "|---|---|---|"]
        lines += [f"| {stage} | `{reason}` | {n:,} |" for stage, reason, n in sorted(letters)]
        if not letters:
            lines.append("| - | none | 0 |")
    lines += ["", "## Provenance", ""]
    for made_by in provenances:
        lines += [f"### Job `{made_by.get('job')}`", "", "| | |", "|---|---|"]
        for label, key in _PROVENANCE_ROWS:
            value = made_by.get(key)
            shown = value if isinstance(value, str) else orjson.dumps(value).decode()
            lines.append(f"| {label} | `{shown}` |")
        lines.append("")
    if not provenances:
        lines.append("Not recorded (the jobs predate provenance).")
    return lines
