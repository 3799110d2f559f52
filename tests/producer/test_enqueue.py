"""The producer against a real Redis and real tokenizers: shapes, dedupe, DLQ, spec."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import zstandard
from click.testing import CliRunner

from regen.cli import main
from regen.common import defaults, dlq, jobspec, keys
from regen.common.celery_app import make_app
from regen.common.chat_family import render_prompt_ids
from regen.producer.enqueue import Enqueuer, EnqueueStats
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import job_ids, queued_chunks, user_rows, write_jsonl


def enqueue(
    url: str, paths: list[Path], *, high_water: int = 10_000, limit: int | None = None,
    order_window: int = defaults.ORDER_WINDOW, **options: Any,
) -> EnqueueStats:  # fmt: skip
    options.setdefault("job", "j")
    options.setdefault("model", "smollm2")
    options.setdefault("max_new_tokens", 64)
    prepared = prepare_job(JobOptions(**options))
    r = redis.Redis.from_url(url)
    jobspec.save(r, prepared.spec)
    enqueuer = Enqueuer(
        r, make_app(url), prepared, high_water=high_water, order_window=order_window
    )
    return enqueuer.run(paths, limit=limit)


def queued_prompts(r: redis.Redis, job: str = "j") -> list[dict[str, Any]]:
    spec = jobspec.load(r, job)
    return [p for chunk in queued_chunks(r, spec.queue) for p in chunk["prompts"]]


SHAPES = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                       {"from": "human", "value": "tell me a joke"},
                       {"from": "gpt", "value": "old answer to regenerate"}]},
    {"conversations": [{"role": "user", "content": "Name three colours."}]},
    {"instruction": "Translate to German", "input": "Good morning"},
    {"prompt": "Write a haiku about the sea."},
    {"question": "Why is the sky blue?"},
    {"text": "Summarise the plot of Hamlet."},
]  # fmt: skip


def test_every_shape_and_format_is_enqueued_token_exact(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    jsonl = write_jsonl(tmp_path / "shapes.jsonl", SHAPES)
    more = [{"prompt": f"Format check {i}"} for i in range(4)]
    zst = tmp_path / "a.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(orjson.dumps(more[0]) + b"\n" for _ in range(1))))  # fmt: skip
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(orjson.dumps(more[1]) + b"\n"))
    arr = tmp_path / "c.json"
    arr.write_text(json.dumps([more[2]]))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "Format check 3"}]]}),
                   parquet)  # fmt: skip

    stats = enqueue(redis_url, [jsonl, zst, gz, arr, parquet], chunk_size=3)

    assert stats.enqueued == len(SHAPES) + 4 and stats.rejected == 0
    prompts = queued_prompts(r)
    assert len(prompts) == stats.enqueued
    spec = jobspec.load(r, "j")
    for prompt in prompts:
        # The ids the server gets are the template render of exactly these messages.
        assert prompt["prompt_ids"] == render_prompt_ids(
            smollm2_tokenizer, prompt["messages"], spec.chat_template_kwargs
        )
        assert prompt["messages"][-1]["role"] == "user"
    by_file = {Path(p["source"]["file"]).name for p in prompts}
    assert by_file == {"shapes.jsonl", "a.jsonl.zst", "b.jsonl.gz", "c.json", "d.parquet"}
    sharegpt = next(p for p in prompts if p["messages"][-1]["content"] == "tell me a joke")
    assert [m["role"] for m in sharegpt["messages"]] == ["user", "assistant", "user"]
    assert sharegpt["source"]["row"] == 2
    assert all(len(c["prompts"]) <= 3 for c in queued_chunks(r, spec.queue))


def test_duplicates_collapse_within_and_across_calls(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    first = write_jsonl(tmp_path / "first.jsonl", [
        {"prompt": "Hello there"}, {"prompt": "  Hello there \r\n"},
        {"messages": [{"role": "user", "content": "Hello there"}]}, {"prompt": "Other"},
    ])  # fmt: skip
    stats = enqueue(redis_url, [first], chunk_size=2)
    assert (stats.enqueued, stats.duplicates) == (2, 2)

    second = write_jsonl(tmp_path / "second.jsonl", [
        {"prompt": "Other"}, {"prompt": "Hello there"}, {"prompt": "Brand new"},
    ])  # fmt: skip
    stats = enqueue(redis_url, [second], chunk_size=2)
    assert (stats.enqueued, stats.duplicates) == (1, 2)
    ids = [p["id"] for p in queued_prompts(r)]
    assert len(ids) == len(set(ids)) == 3
    assert len(job_ids(r, "j")) == 3


def test_a_different_spec_is_refused(redis_url: str, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", user_rows(3))
    enqueue(redis_url, [data])
    with pytest.raises(jobspec.JobSpecMismatch, match="max_new_tokens"):
        enqueue(redis_url, [data], max_new_tokens=65)

    result = CliRunner().invoke(main, [
        "enqueue", str(data), "--job", "j", "--model", "smollm2", "--max-new-tokens", "64",
        "--temperature", "0.7", "--redis-url", redis_url,
    ])  # fmt: skip
    assert result.exit_code != 0
    assert "already exists with different settings" in result.output
    assert "temperature" in result.output


def test_bad_rows_go_to_the_input_dlq_and_good_rows_go_on(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    path = tmp_path / "mixed.jsonl"
    lines = [
        b'{"prompt": "good one"}',
        b'{"prompt": "broken json"',
        b'{"prompt": "bad bytes \xff\xfe"}',
        b'{"messages": [{"role": "assistant", "content": "no user here"}]}',
        b'{"messages": [{"role": "user", "content": "   "}]}',
        b'{"messages": "not a list"}',
        b'[1, 2, 3]',
        b'{"something": "else"}',
        b'{"prompt": "good two"}',
    ]  # fmt: skip
    path.write_bytes(b"\n".join(lines) + b"\n")

    stats = enqueue(redis_url, [path])

    assert stats.enqueued == 2 and stats.rejected == 7
    letters = {d.source["row"]: d for d in dlq.entries(r, "j", "input")}
    assert {row: d.reason for row, d in letters.items()} == {
        2: "invalid_json", 3: "undecodable", 4: "no_user_turn", 5: "empty_content",
        6: "wrong_type", 7: "not_an_object", 8: "unknown_shape",
    }  # fmt: skip
    assert all(d.source["file"] == str(path) and d.message for d in letters.values())
    # A rerun (after a crash, say) rewrites the same entries instead of adding more.
    r.delete(keys.job_cursors("j"))
    enqueue(redis_url, [path])
    assert dlq.count(r, "j", "input") == 7


def test_prompts_too_long_for_the_limit_or_the_context_are_dead_lettered(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "short"}, {"prompt": "long " * 200},
    ])  # fmt: skip
    stats = enqueue(redis_url, [path], max_prompt_tokens=100)
    assert (stats.enqueued, stats.rejected) == (1, 1)
    (letter,) = list(dlq.entries(r, "j", "input"))
    assert letter.reason == "prompt_too_long" and "allows 100" in letter.message
    # Accounted for: the id is in the job, so a rerun does not send it either.
    assert letter.prompt_id in job_ids(r, "j")

    stats = enqueue(redis_url, [path], job="ctx", context_length=300, max_new_tokens=250)
    assert stats.rejected == 1
    (letter,) = list(dlq.entries(r, "ctx", "input"))
    assert "context 300 - max_new_tokens 250" in letter.message


@pytest.mark.parametrize("thinking", [True, False])
def test_kimi_thinking_switch_reaches_the_prompt_ids(
    redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path, thinking: bool
) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", SHAPES[:2])
    enqueue(redis_url, [path], model=str(kimi_tokenizer_dir), trust_remote_code=True,
            thinking=thinking)  # fmt: skip
    spec = jobspec.load(r, "j")
    assert spec.chat_family == "kimi"
    assert spec.chat_template_kwargs == {"thinking": thinking}
    for prompt in queued_prompts(r):
        # ...<|im_middle|> 163601, <think> 163606 (, </think> 163607 when thinking is off)
        expected = [163601, 163606] if thinking else [163601, 163606, 163607]
        assert prompt["prompt_ids"][-len(expected) :] == expected


def test_a_rerun_resumes_from_the_cursor(redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", user_rows(20))
    first = enqueue(redis_url, [path], chunk_size=4, limit=10)
    assert first.enqueued == 10
    second = enqueue(redis_url, [path], chunk_size=4)
    assert second.rows_resumed == 10 and second.rows_read == 10 and second.enqueued == 10
    ids = [p["id"] for p in queued_prompts(r)]
    assert len(ids) == len(set(ids)) == 20


CODE_ROW = {"prompt": "Fix the bug:\n\ndef add(a, b):\n    return a - b\n"}


def test_a_prompt_reaches_the_server_as_written(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    padded = {"prompt": CODE_ROW["prompt"].rstrip("\n") + "  \r\n"}
    path = write_jsonl(tmp_path / "code.jsonl", [CODE_ROW, padded])
    stats = enqueue(redis_url, [path])

    assert (stats.enqueued, stats.duplicates) == (1, 1)  # one dedupe key for both rows
    (prompt,) = queued_prompts(r)
    assert prompt["messages"] == [{"role": "user", "content": CODE_ROW["prompt"]}]
    sent = smollm2_tokenizer.decode(prompt["prompt_ids"], skip_special_tokens=False)
    assert sent.endswith("    return a - b\n<|im_end|>\n<|im_start|>assistant\n")
    assert jobspec.load(r, "j").prompt_text == jobspec.PROMPT_TEXT_AS_WRITTEN


def test_an_older_job_keeps_rendering_stripped_text(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    # A spec stored before the rule existed has no prompt_text: it stripped each text.
    old = prepare_job(JobOptions(job="old", model="smollm2", max_new_tokens=64)).spec
    stored = {k: v for k, v in orjson.loads(old.to_json()).items() if k != "prompt_text"}
    r.set(keys.job_spec("old"), orjson.dumps(stored))
    r.sadd(keys.JOBS, "old")
    path = write_jsonl(tmp_path / "code.jsonl", [CODE_ROW])

    result = CliRunner().invoke(main, [
        "enqueue", str(path), "--job", "old", "--model", "smollm2", "--max-new-tokens", "64",
        "--redis-url", redis_url,
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    (prompt,) = queued_prompts(r, "old")
    assert prompt["messages"] == [{"role": "user", "content": CODE_ROW["prompt"].strip()}]
    assert prompt["prompt_ids"] == render_prompt_ids(smollm2_tokenizer, prompt["messages"], {})
    # The same id a new job gives the row: extending the old job stays idempotent.
    enqueue(redis_url, [path], job="new")
    (new,) = queued_prompts(r, "new")
    assert new["id"] == prompt["id"] and new["messages"][0]["content"] == CODE_ROW["prompt"]


def test_a_row_too_large_to_fit_is_refused_before_it_is_tokenized(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    # 5 MB of text: over the most SmolLM2's ~8K-token prompt limit can hold (~81 bytes a
    # token at most), so it is refused by its size; tokenizing it would take seconds.
    huge = "lorem ipsum " * 440_000
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "short"}, {"prompt": huge}])
    started = time.monotonic()
    stats = enqueue(redis_url, [path])
    assert (stats.enqueued, stats.rejected_by_reason) == (1, {"row_too_large": 1})
    assert time.monotonic() - started < 30
    (letter,) = list(dlq.entries(r, "j", "input"))
    counted = len(huge) + len("user")  # the text as written, and its role
    assert letter.reason == "row_too_large" and f"{counted:,} bytes" in letter.message
    assert len(letter.to_json()) < 10_000, "the DLQ keeps a snippet, not the row"
    assert letter.prompt_id in job_ids(r, "j")

    # An explicit bound, in plan and enqueue alike.
    rows = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "tiny"}, {"prompt": "x" * 2000}])
    args = ["--model", "smollm2", "--max-new-tokens", "64", "--max-row-bytes", "1000"]
    plan = CliRunner().invoke(main, ["plan", str(rows), *args, "--json"])
    assert plan.exit_code == 0, plan.output
    assert orjson.loads(plan.output)["rejected"] == {"row_too_large": 1}
    result = CliRunner().invoke(
        main, ["enqueue", str(rows), "--job", "k", *args, "--redis-url", redis_url]
    )
    assert result.exit_code == 0, result.output
    assert "rejected row_too_large: 1" in result.output
    assert "--max-row-bytes" in next(dlq.entries(r, "k", "input")).message


def test_an_empty_dataset_warns_that_the_job_has_nothing_to_generate(
    redis_url: str, tmp_path: Path
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    result = CliRunner().invoke(main, [
        "enqueue", str(empty), "--job", "e", "--model", "smollm2", "--max-new-tokens", "64",
        "--redis-url", redis_url,
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "warning: job e has no prompt to generate: the datasets hold no rows" in result.output
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"nothing": "usable"}])
    result = CliRunner().invoke(main, [
        "enqueue", str(bad), "--job", "e2", "--model", "smollm2", "--max-new-tokens", "64",
        "--redis-url", redis_url,
    ])  # fmt: skip
    assert "none of the 1 rows read became a prompt" in result.output
    full = write_jsonl(tmp_path / "full.jsonl", user_rows(2))
    result = CliRunner().invoke(main, [
        "enqueue", str(full), "--job", "e3", "--model", "smollm2", "--max-new-tokens", "64",
        "--redis-url", redis_url,
    ])  # fmt: skip
    assert "warning" not in result.output


def test_a_truncated_zst_enqueues_its_readable_rows_and_dead_letters_the_cut(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    # Varied text compresses into several zstd blocks; the cut falls inside a later one.
    rows = [{"prompt": f"Question {i}: {os.urandom(150).hex()}"} for i in range(1000)]
    data = zstandard.ZstdCompressor().compress(b"".join(orjson.dumps(x) + b"\n" for x in rows))
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) * 2 // 3])
    stats = enqueue(redis_url, [path])
    assert stats.enqueued > 300, "the rows of the whole blocks before the cut are enqueued"
    assert stats.rejected_by_reason == {"corrupt_file": 1}
    (letter,) = list(dlq.entries(r, "j", "input"))
    assert letter.source is not None and letter.source["row"] == stats.enqueued + 1
    assert "whole block" in letter.message
    queued = {p["messages"][0]["content"] for p in queued_prompts(r)}
    assert queued == {row["prompt"] for row in rows[: stats.enqueued]}
