"""The demo's closing words: where every prompt ended, and why."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from regen.common.jobspec import JobSpec
from regen.demo_report import example_record, outcome
from tests.ops.test_shards_inspect import make_record, write_shard


def test_the_outcome_names_each_flag_and_dead_letter_in_words() -> None:
    spec = JobSpec(
        name="demo", model="m", tokenizer="t", trust_remote_code=False, chat_family="chatml",
        tokenizer_fingerprint="-", sampling={"max_new_tokens": 128}, chat_template_kwargs={},
        system_prompt=None, chunk_size=8, max_prompt_tokens=None, context_length=None,
        queue="generate",
    )  # fmt: skip
    letters = {"input": Counter({"empty_content": 1}), "generate": Counter(), "tokenize": Counter()}
    lines = outcome(spec, 37, Counter({"truncated": 6}), letters)
    text = "\n".join(lines)
    assert lines[0].endswith("Done: every prompt is accounted for.[/]")
    assert "37 written as training records." in text
    assert "6 of them flagged truncated: the answer reached max_new_tokens (128 here)" in text
    assert "1 in the input dead-letter queue as empty_content: a row with an empty message" in text
    # A clean run says nothing of flags or dead letters.
    empty = {stage: Counter() for stage in letters}
    assert outcome(spec, 3, Counter(), empty)[1:] == ["  3 written as training records."]


def test_the_example_record_is_the_first_with_no_flag(tmp_path: Path) -> None:
    job = tmp_path / "job-a"
    looped = {**make_record("a"), "flags": ["repetition"]}
    cut = {**make_record("b", finish="length"), "flags": ["truncated"]}
    write_shard(job, 1, [looped, cut])
    assert example_record(job) == looped  # none without a flag: the first
    write_shard(job, 2, [make_record("c"), make_record("d")])
    assert example_record(job)["id"] == "c"  # type: ignore[index]
    assert example_record(tmp_path / "empty") is None
