"""What made a job: computed at enqueue, stored once, copied beside the shards."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import redis

from regen.common import provenance
from regen.producer.spec import JobOptions, prepare_job, save_job


def test_effective_sampling_fills_what_the_job_left_unset(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 7})
    )
    defaults = provenance.generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    sent = {"max_new_tokens": 512, "temperature": 1.0}
    assert provenance.effective_sampling(sent, defaults) == {
        "max_new_tokens": 512, "temperature": 1.0, "top_p": 0.95, "top_k": 20,
    }  # fmt: skip
    assert provenance.generation_defaults(tmp_path / "absent") == {}


def test_a_hub_cache_snapshot_names_its_revision(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert provenance.model_revision(tmp_path / "snapshots" / commit) == commit
    assert provenance.model_revision(tmp_path / "Kimi-K2.6") is None


def test_a_new_job_stores_its_provenance_once(
    r: redis.Redis, kimi_tokenizer_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "kimi"
    shutil.copytree(kimi_tokenizer_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    options = JobOptions(job="prov", model=str(model), trust_remote_code=True, thinking=False,
                         max_new_tokens=256, top_p=0.9)  # fmt: skip
    prepared = save_job(r, prepare_job(options))
    stored = provenance.load(r, "prov")
    assert stored is not None
    assert stored["effective_sampling"] == {"max_new_tokens": 256, "top_p": 0.9, "temperature": 0.6}
    assert stored["sampling"] == prepared.spec.sampling == {"max_new_tokens": 256, "top_p": 0.9}
    assert stored["thinking"] is False and stored["turns"] == "last"
    assert stored["tokenizer_fingerprint"] == prepared.spec.tokenizer_fingerprint
    assert stored["chat_template_sha256"] == provenance.template_hash(prepared.tokenizer)
    assert stored["regen_version"] != ""
    # Enqueueing into the job again keeps what made it.
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.1}))
    save_job(r, prepare_job(options))
    assert provenance.load(r, "prov") == stored
