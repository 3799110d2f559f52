"""`regen plan` and `regen preflight` against real tokenizers (SmolLM2's GGUF, the Kimi
fixture) and real dataset files; the estimate arithmetic on its own."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner, Result

from regen.cli_plan import plan, preflight
from regen.common import jobspec
from regen.common.celery_app import make_app
from regen.common.chat_family import render_prompt_ids
from regen.common.tokenizer import tokenizer_fingerprint
from regen.producer.enqueue import Enqueuer
from regen.producer.plan import Estimate, human_duration
from regen.producer.prompt_scan import scan_prompts
from regen.producer.record_size import measure
from regen.producer.rows import to_prompt
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import user_rows, write_jsonl

KIMI_THINK, KIMI_END_THINK, KIMI_MASK, KIMI_IM_END = 163606, 163607, 163838, 163586

# Every row shape, a duplicate (same content in another shape), and bad rows.
ROWS: list[Any] = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"conversations": [{"from": "human", "value": "What is the capital of France?"}]},
    {"instruction": "Translate to German", "input": "Good morning"},
    {"prompt": "Write a haiku about the sea."},
    {"prompt": "Write a haiku about the sea."},
    {"question": "Why is the sky blue? " + "Explain it in great detail. " * 40},
    {"text": "Summarise the plot of Hamlet."},
    {"system": "Be brief.", "prompt": "Name three colours."},
    "{not json",
    {"unexpected": "shape"},
    {"messages": [{"role": "assistant", "content": "no user turn here"}]},
]  # fmt: skip


def run(command: Any, *args: str) -> Result:
    result = CliRunner().invoke(command, [*args], catch_exceptions=False)
    return result


def plan_json(*args: str) -> dict[str, Any]:
    result = run(plan, *args, "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = orjson.loads(result.output)
    return data


def checks_by_name(*args: str) -> tuple[int, dict[str, dict[str, Any]]]:
    result = run(preflight, *args, "--json")
    report = orjson.loads(result.output)
    assert report["ok"] is (result.exit_code == 0)
    return result.exit_code, {check["name"]: check for check in report["checks"]}


# --- the estimate ----------------------------------------------------------------------


def test_900k_prompts_of_2k_tokens_at_800_tokens_per_s_take_26_7_days() -> None:
    est = Estimate(prompts=900_000, output_tokens_per_prompt=2048, tokens_per_s=800)
    assert est.output_tokens == 1_843_200_000
    assert est.seconds == 2_304_000
    assert est.days == pytest.approx(26.67, abs=0.01)
    assert human_duration(est.seconds) == "26.7 days (640 hours)"
    # Eight servers share the work.
    fleet = Estimate(prompts=900_000, output_tokens_per_prompt=2048, tokens_per_s=800, servers=8)
    assert fleet.days == pytest.approx(26.67 / 8, abs=0.01)


def test_estimate_totals_and_disk() -> None:
    est = Estimate(
        prompts=1000, output_tokens_per_prompt=500.5, tokens_per_s=100, prompt_tokens=12_345,
        bytes_per_record=2048.0,
    )  # fmt: skip
    assert est.total_tokens == 12_345 + 500_500
    assert est.disk_bytes == 2_048_000
    assert Estimate(prompts=1, output_tokens_per_prompt=1, tokens_per_s=1).disk_bytes is None
    with pytest.raises(ValueError, match="tokens_per_s"):
        Estimate(prompts=1, output_tokens_per_prompt=1, tokens_per_s=0)


# --- plan ------------------------------------------------------------------------------


def test_plan_counts_prompts_and_tokens_exactly(tmp_path: Path, smollm2_tokenizer: Any) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    report = plan_json(
        str(data), "--model", "smollm2", "--max-new-tokens", "256", "--max-prompt-tokens", "100",
        "--output-tokens-per-s", "50", "--servers", "2", "--out", str(tmp_path / "out"),
    )  # fmt: skip

    # The reference: every distinct prompt rendered on its own.
    lengths: dict[str, int] = {}
    for row in ROWS[:8]:
        prompt = to_prompt(row)
        lengths[prompt.id] = len(render_prompt_ids(smollm2_tokenizer, prompt.messages, {}))
    accepted = sorted(n for n in lengths.values() if n <= 100)
    assert len(lengths) == 6 and len(accepted) == 5  # the long question is over the limit

    assert report["rows_read"] == len(ROWS)
    assert report["unique_prompts"] == 6 and report["duplicates"] == 2
    assert report["rejected"] == {
        "invalid_json": 1, "unknown_shape": 1, "no_user_turn": 1, "prompt_too_long": 1,
    }  # fmt: skip
    assert report["exact"] and report["tokenized"] == 6
    assert report["prompts"] == 5
    tokens = report["prompt_tokens"]
    assert tokens["total"] == sum(accepted)
    assert tokens["max"] == accepted[-1] and tokens["p50"] == accepted[2]
    assert report["output_tokens"] == {
        "per_prompt": 256.0, "from": "max_new_tokens, an upper bound", "total": 5 * 256,
    }  # fmt: skip
    assert report["total_tokens"] == sum(accepted) + 5 * 256
    assert report["generation"]["seconds"] == pytest.approx(5 * 256 / (50 * 2))
    assert report["disk"]["fits"] is True and report["warnings"] == []


def test_plan_agrees_with_enqueue(redis_url: str, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", ROWS)
    report = plan_json(str(data), "--model", "smollm2", "--max-new-tokens", "64",
                       "--max-prompt-tokens", "100", "--out", str(tmp_path))  # fmt: skip
    prepared = prepare_job(
        JobOptions(job="j", model="smollm2", max_new_tokens=64, max_prompt_tokens=100)
    )
    r = redis.Redis.from_url(redis_url)
    jobspec.save(r, prepared.spec)
    stats = Enqueuer(r, make_app(redis_url), prepared, high_water=10_000).run([data])
    assert report["prompts"] == stats.enqueued
    assert report["duplicates"] == stats.duplicates
    assert report["rejected"] == stats.rejected_by_reason


def test_plan_samples_big_inputs_and_scales_up(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", user_rows(400, pad=3))
    common = ["--model", "smollm2", "--max-new-tokens", "64", "--out", str(tmp_path)]
    exact = plan_json(str(data), *common, "--sample", "0")
    sampled = plan_json(str(data), *common, "--sample", "50")
    assert exact["exact"] and exact["tokenized"] == 400
    assert not sampled["exact"] and sampled["tokenized"] == 50
    assert sampled["prompts"] == sampled["unique_prompts"] == 400
    # Rows of nearly equal length: the scaled sample lands close to the exact count.
    assert sampled["prompt_tokens"]["total"] == pytest.approx(
        exact["prompt_tokens"]["total"], rel=0.02
    )
    again = plan_json(str(data), *common, "--sample", "50")
    # Seeded: the same sample gives the same plan (free disk space may move meanwhile).
    del again["disk"]["free_bytes"], sampled["disk"]["free_bytes"]
    assert again == sampled
    text = run(plan, str(data), *common, "--sample", "50").output
    assert "sampled: 50 of 400 unique prompts tokenized" in text


def prose_rows(n: int, words: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompts of made-up prose: a Zipf-distributed vocabulary of pseudo-words, so text
    compresses about as real text does (unlike templated rows, which compress far more)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "sto", "vu", "bel", "dra", "ni", "qua", "tes", "or"]
    vocab = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    weights = [1 / rank for rank in range(1, len(vocab) + 1)]
    return [
        {"prompt": " ".join(rng.choices(vocab, weights, k=words)).capitalize() + "?"}
        for _ in range(n)
    ]


def test_plan_measures_bytes_per_record(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", prose_rows(100, 60))
    report = plan_json(str(data), "--model", "smollm2", "--max-new-tokens", "512",
                       "--mean-output-tokens", "300", "--out", str(tmp_path))  # fmt: skip
    model = report["disk"]["record_model"]
    assert model["records"] == 32 and model["measured_output_tokens"] == 300
    assert not model["text_shuffled"]
    # A token costs ~5 digits and a comma in input_ids, "0," or "1," in loss_mask and a
    # few characters of text, before zstd: 1 to 5 bytes after it, not less nor more.
    assert 1 < model["bytes_per_token"] < 5 and 2 < model["zstd_ratio"] < 8
    per_record = model["fixed_bytes"] + model["bytes_per_token"] * (
        report["prompt_tokens"]["mean"] + 300
    )
    assert report["disk"]["bytes_per_record"] == pytest.approx(per_record)
    assert report["disk"]["bytes"] == round(report["prompts"] * per_record)


def test_record_size_extrapolates_to_longer_answers(tmp_path: Path) -> None:
    """Sizes measured at 300-token answers predict records with 1,200-token answers."""
    data = write_jsonl(tmp_path / "data.jsonl", prose_rows(300, 80))
    job = prepare_job(JobOptions(job="j", model="smollm2", max_new_tokens=2048))
    scan = scan_prompts([data], job, sample=None)
    mean_prompt = scan.prompt_tokens / scan.accepted
    short = measure(job, scan.examples, scan.answer_texts, 300)
    long = measure(job, scan.examples, scan.answer_texts, 1200)
    assert not long.text_shuffled
    predicted = short.bytes_per_record(mean_prompt, 1200)
    assert predicted == pytest.approx(long.bytes_per_record(mean_prompt, 1200), rel=0.1)


def test_plan_warns_when_the_shards_will_not_fit(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", user_rows(3))
    out = tmp_path / "not" / "yet" / "there"
    # 10^15 tokens per answer: petabytes, more than any test machine's disk.
    args = [str(data), "--model", "smollm2", "--max-new-tokens", "64",
            "--mean-output-tokens", "1e15", "--out", str(out)]  # fmt: skip

    loose = run(plan, *args)
    assert loose.exit_code == 0
    assert "WARNING: the shards need about" in loose.output
    assert f"{tmp_path} has only" in loose.output

    strict = run(plan, *args, "--strict")
    assert strict.exit_code == 1 and "WARNING: the shards need about" in strict.output
    report = orjson.loads(run(plan, *args, "--json").output)
    assert report["disk"]["fits"] is False and report["disk"]["out"] == str(tmp_path)
    assert report["disk"]["bytes"] > report["disk"]["free_bytes"]


def test_plan_to_object_storage_says_it_checks_no_free_space(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", user_rows(3))
    args = [str(data), "--model", "smollm2", "--max-new-tokens", "64",
            "--mean-output-tokens", "1e15", "--out", "s3://bucket/runs"]  # fmt: skip
    result = run(plan, *args)  # petabytes, but no disk to run out of
    assert result.exit_code == 0, result.output
    assert "WARNING: the shards need" not in result.output
    assert "not checked: s3://bucket/runs is object storage" in result.output
    report = orjson.loads(run(plan, *args, "--json").output)
    assert report["disk"]["free_bytes"] is None and report["disk"]["fits"] is None
    assert report["disk"]["out"] == "s3://bucket/runs"


def test_plan_strict_passes_a_plan_that_fits(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", user_rows(3))
    result = run(plan, str(data), "--model", "smollm2", "--max-new-tokens", "64",
                 "--out", str(tmp_path), "--strict")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "WARNING" not in result.output
    assert "generation " in result.output and "shards on disk     about" in result.output


@pytest.mark.parametrize("thinking", ["--thinking", "--no-thinking"])
def test_plan_models_kimi_records_with_and_without_thinking(
    tmp_path: Path, kimi_tokenizer_dir: Path, thinking: str
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", user_rows(40, pad=5))
    report = plan_json(str(data), "--model", str(kimi_tokenizer_dir), "--trust-remote-code",
                       thinking, "--max-new-tokens", "256", "--out", str(tmp_path))  # fmt: skip
    assert report["chat_family"] == "kimi"
    assert report["chat_template_kwargs"] == {"thinking": thinking == "--thinking"}
    assert report["warnings"] == [] and report["disk"]["bytes"] > 0


def test_plan_without_remote_code_names_the_flag(tmp_path: Path, kimi_tokenizer_dir: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", user_rows(2))
    result = run(plan, str(data), "--model", str(kimi_tokenizer_dir), "--out", str(tmp_path))
    assert result.exit_code == 1 and "--trust-remote-code" in result.output


# --- preflight -------------------------------------------------------------------------


def test_preflight_smollm2_has_no_thinking_switch(smollm2_tokenizer: Any) -> None:
    code, checks = checks_by_name("--model", "smollm2")
    assert code == 0
    assert checks["chat family"]["family"] == "chatml"
    assert checks["chat family"]["thinking_switch"] is None
    assert "thinking on" not in checks and "thinking off" not in checks
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert checks["end of turn"]["end_of_turn_ids"] == [im_end]
    assert (
        checks["chat template"]["tail_ids"][-3:]
        == smollm2_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    )
    assert checks["mask token"]["status"] == "warn"
    assert checks["context length"]["context_length"] == 8192
    assert checks["fingerprint"]["fingerprint"] == tokenizer_fingerprint(smollm2_tokenizer)

    text = run(preflight, "--model", "smollm2").output
    assert "✓ chat family: chatml (no thinking switch in the chat template)" in text
    assert text.rstrip().endswith("ready")


def test_preflight_kimi_thinking_on_and_off(kimi_tokenizer_dir: Path) -> None:
    code, checks = checks_by_name("--model", str(kimi_tokenizer_dir), "--trust-remote-code")
    assert code == 0
    assert checks["chat family"]["thinking_switch"] == "thinking"
    on, off = checks["thinking on"]["tail_ids"], checks["thinking off"]["tail_ids"]
    assert on[-1] == KIMI_THINK and KIMI_END_THINK not in on
    assert off[-2:] == [KIMI_THINK, KIMI_END_THINK]
    assert checks["thinking on"]["tail_tokens"][-1] == "<think>"
    assert checks["thinking default"]["default"] == "on"
    assert checks["end of turn"]["end_of_turn_ids"] == [KIMI_IM_END]
    assert checks["mask token"]["mask_token_id"] == KIMI_MASK
    assert checks["think tags"]["status"] == "ok"
    assert checks["context length"]["context_length"] == 262_144
    assert checks["tokenizer"]["vocab_size"] == 163_840

    text = run(preflight, "--model", str(kimi_tokenizer_dir), "--trust-remote-code").output
    assert "✓ mask token: 163838" in text and "✓ thinking off:" in text


def test_preflight_kimi_without_remote_code_fails(kimi_tokenizer_dir: Path) -> None:
    code, checks = checks_by_name("--model", str(kimi_tokenizer_dir))
    assert code == 1
    assert checks["tokenizer"]["status"] == "fail"
    assert "--trust-remote-code" in checks["tokenizer"]["detail"]
    text = run(preflight, "--model", str(kimi_tokenizer_dir)).output
    assert text.startswith("✗ tokenizer:") and "NOT ready" in text


def test_preflight_names_a_missing_package(needs_missing_package_dir: Path) -> None:
    code, checks = checks_by_name("--model", str(needs_missing_package_dir), "--trust-remote-code")
    assert code == 1
    assert "pip install regen_test_absent_package" in checks["tokenizer"]["detail"]


def test_special_think_tags_are_flagged_and_break_thinking_records(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    """Think tags marked special vanish from SGLang's text (skip_special_tokens), so the
    records of a thinking job would all fail: preflight warns and plan says so."""
    folder = tmp_path / "kimi-special-think"
    shutil.copytree(kimi_tokenizer_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for token_id in (str(KIMI_THINK), str(KIMI_END_THINK)):
        token = config["added_tokens_decoder"][token_id]
        token["special"] = True
        config["additional_special_tokens"].append(token["content"])
    config_path.write_text(json.dumps(config))

    code, checks = checks_by_name("--model", str(folder), "--trust-remote-code")
    assert code == 0 and checks["think tags"]["status"] == "warn"
    assert checks["think tags"]["special"] == ["<think>", "</think>"]

    data = write_jsonl(tmp_path / "data.jsonl", user_rows(3))
    result = run(plan, str(data), "--model", str(folder), "--trust-remote-code",
                 "--max-new-tokens", "128", "--out", str(tmp_path), "--strict")  # fmt: skip
    assert result.exit_code == 1
    assert "the record checks reject a well-formed synthetic answer" in result.output
    assert "unclosed_thinking" in result.output
