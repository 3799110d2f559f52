"""What made a job's data: written once when the job is created, kept in Redis, copied into
the job's shard folder (`provenance.json`) and into every export (docs/design/records.md,
"Provenance").

A trainer reading a dataset months later needs to know which regen, which model (and
revision), which template and tokenizer, which sampling the server really used, and
whether thinking was on. The sampling a job sends leaves some parameters unset on
purpose: SGLang fills an unset temperature, top_p, top_k or min_p from the model's
`generation_config.json` (docs/design/sglang.md, SGLang contract), so the effective values are
the job's with the model's filling the gaps, as the server does.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from regen.common import keys
from regen.common.jobspec import JobSpec

# The sampling parameters SGLang takes from generation_config.json when a request
# leaves them unset (`--sampling-defaults model`, its default).
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
PROVENANCE_FILE = "provenance.json"


def regen_version() -> str:
    try:
        return importlib.metadata.version("regen")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def model_revision(folder: Path) -> str | None:
    """The model's revision where its folder says: a Hugging Face cache snapshot's
    commit (`.../snapshots/<commit>/`), else None."""
    if folder.parent.name == "snapshots" and len(folder.name) == 40:
        return folder.name
    return None


def generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults in the model's generation_config.json (none when absent)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    return {name: config[name] for name in MODEL_DEFAULTED if name in config}


def effective_sampling(sampling: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """What the server samples with: the job's parameters, the model's where unset."""
    return {**{k: v for k, v in defaults.items() if k not in sampling}, **sampling}


def template_hash(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def job_provenance(spec: JobSpec, tokenizer: Any, model_folder: Path | None) -> dict[str, Any]:
    """The provenance of a new job (see the module docstring)."""
    model_defaults = generation_defaults(model_folder) if model_folder else {}
    thinking = None
    for key in ("thinking", "enable_thinking"):
        if key in spec.chat_template_kwargs:
            thinking = bool(spec.chat_template_kwargs[key])
    return {
        "job": spec.name,
        "regen_version": regen_version(),
        "created": time.time(),
        "model": spec.model,
        "model_revision": model_revision(model_folder) if model_folder else None,
        "tokenizer": spec.tokenizer,
        "tokenizer_fingerprint": spec.tokenizer_fingerprint,
        "chat_family": spec.chat_family,
        "chat_template_sha256": template_hash(tokenizer),
        "chat_template_kwargs": spec.chat_template_kwargs,
        # None: the template's own default (Kimi and Qwen3 think by default).
        "thinking": thinking,
        "turns": spec.turns,
        "sampling": spec.sampling,
        "effective_sampling": effective_sampling(spec.sampling, model_defaults),
        "model_sampling_defaults": model_defaults,
    }


def save(r: redis.Redis, provenance: dict[str, Any]) -> None:
    """Store a job's provenance unless it has one: the first enqueue made the job."""
    r.set(keys.job_provenance(provenance["job"]), orjson.dumps(provenance), nx=True)


def load(r: redis.Redis, job: str) -> dict[str, Any] | None:
    raw = r.get(keys.job_provenance(job))
    return None if raw is None else orjson.loads(raw)


def read_file(folder: Path) -> dict[str, Any] | None:
    """A job folder's provenance.json, or None (a job made before it existed)."""
    path = folder / PROVENANCE_FILE
    return orjson.loads(path.read_bytes()) if path.is_file() else None


def write_file(folder: Path, provenance: dict[str, Any]) -> None:
    """Write a job folder's provenance.json once, whole (temp file, fsync, rename)."""
    path = folder / PROVENANCE_FILE
    if path.exists():
        return
    staging = path.with_name(f".{PROVENANCE_FILE}.tmp")
    with staging.open("wb") as out:
        out.write(orjson.dumps(provenance, option=orjson.OPT_INDENT_2))
        out.flush()
        os.fsync(out.fileno())
    staging.replace(path)


def mixed_versions(versions: dict[str, int]) -> str | None:
    """What `regen status` and `regen verify` say when servers of more than one SGLang
    version generated a job's committed records (a server upgraded mid-job): None
    otherwise."""
    if len(versions) < 2:
        return None
    counts = ", ".join(f"{v} ({n:,} records)" for v, n in sorted(versions.items()))
    return f"servers of more than one SGLang version generated this job: {counts}"
