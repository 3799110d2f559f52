"""`regen dlq`: inspect, purge, export and requeue dead letters against a real Redis.

Requeue tests check where every entry ends up: in the DLQ or queued (a chunk on the
generate queue, a result on the results stream), never both and never neither, also when
the command dies between its steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner, Result

from regen.cli_dlq import dlq_group
from regen.common import crashpoints, dlq, jobspec, keys
from regen.common.chat_family import render_prompt_ids
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.record import Reason as TokenizeReason
from regen.common.results import GeneratedResult
from regen.consumers.generate.reasons import Reason as GenerateReason
from regen.consumers.tokenize.shard_files import iter_records, shard_paths
from regen.ops.requeue import CRASHPOINT
from regen.producer.rows import Reason as InputReason
from regen.producer.spec import JobOptions, PreparedJob, prepare_job
from tests.support.generate_harness import Worker, all_acked, enqueue_prompts, results
from tests.support.helpers import make_result, queued_chunks, wait_for
from tests.support.sglang_standin.process import run_standin
from tests.support.tokenize_harness import InProcess, options, push, settled

REPO = Path(__file__).resolve().parents[2]
JOB = "d"


@pytest.fixture(scope="module")
def prepared() -> PreparedJob:
    return prepare_job(JobOptions(job=JOB, model="smollm2", max_new_tokens=64, chunk_size=2))


@pytest.fixture
def spec(r: redis.Redis, prepared: PreparedJob) -> jobspec.JobSpec:
    return jobspec.save(r, prepared.spec)


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(dlq_group, [*args, "--redis-url", url], catch_exceptions=False)


def generate_letter(i: int) -> dlq.DeadLetter:
    return dlq.DeadLetter(
        entry_id=f"p{i:02d}", job=JOB, stage="generate", reason="rejected_by_server",
        message=f"too long {i}", prompt_id=f"p{i:02d}", source={"file": "f.jsonl", "row": i},
        payload={"chunk": "c-orig", "prompt_ids": [1, 2, i], "sampling": {},
                 "messages": [{"role": "user", "content": f"question {i}"}]},
        worker="gpu-host:42", time=1_700_000_000.0 + i,
    )  # fmt: skip


def tokenize_letter(result: GeneratedResult, reason: str = "truncated") -> dlq.DeadLetter:
    return dlq.DeadLetter(
        entry_id=result.id, job=JOB, stage="tokenize", reason=reason, message="cut",
        prompt_id=result.id, source=result.source, worker="tok-host:7",
        payload={"result": result.__dict__} if reason != "truncated_dropped" else {},
    )  # fmt: skip


def input_letters() -> list[dlq.DeadLetter]:
    bad_row = dlq.DeadLetter(
        entry_id="row:0123456789abcdef", job=JOB, stage="input", reason="bad_json",
        message="not JSON", source={"file": "f.jsonl", "row": 7}, payload={"row": "{oops"},
    )  # fmt: skip
    too_long = dlq.DeadLetter(
        entry_id="plong", job=JOB, stage="input", reason="prompt_too_long",
        message="prompt is 9999 tokens", prompt_id="plong", source={"file": "f.jsonl", "row": 8},
        payload={"messages": [{"role": "user", "content": "x " * 50}], "prompt_tokens": 9999},
    )  # fmt: skip
    return [bad_row, too_long]


def plant(r: redis.Redis, letters: list[dlq.DeadLetter]) -> None:
    for letter in letters:
        dlq.put(r, letter)


def dlq_ids(r: redis.Redis, stage: str) -> set[str]:
    return {letter.entry_id for letter in dlq.entries(r, JOB, stage)}


def queued_prompts(r: redis.Redis, spec: jobspec.JobSpec) -> list[dict[str, Any]]:
    return [p for chunk in queued_chunks(r, spec.queue) for p in chunk["prompts"]]


def assert_each_in_one_place(r: redis.Redis, spec: jobspec.JobSpec, ids: set[str]) -> None:
    queued = [p["id"] for p in queued_prompts(r, spec)]
    in_dlq = dlq_ids(r, "generate")
    assert len(queued) == len(set(queued)), "a prompt queued twice"
    assert not in_dlq & set(queued), "in the DLQ and queued both"
    assert in_dlq | set(queued) == ids, "lost between the DLQ and the queue"


# --- list, show, export, purge ---------------------------------------------------------


def test_reason_codes_are_the_strings_stored_in_redis(r: redis.Redis) -> None:
    # Stored entries and `regen dlq --reason` name these: renaming one orphans them.
    assert [code.value for code in InputReason] == [
        "invalid_json", "undecodable", "corrupt_file", "not_an_object", "unknown_shape",
        "wrong_type", "unsupported_role", "unsupported_content", "empty_content",
        "no_user_turn", "bad_order", "bad_tools", "bad_tool_call", "bad_tool_arguments",
        "tool_without_call", "template_error", "prompt_too_long", "row_too_large",
        "history_lost", "blocked",
    ]  # fmt: skip
    assert [code.value for code in GenerateReason] == [
        "rejected_by_server", "poison_chunk", "not_json", "not_a_task_message",
        "unknown_task", "malformed_chunk", "wrong_queue", "template_error",
        "prompt_too_long", "tool_call_diverged", "blocked",
    ]  # fmt: skip
    assert [code.value for code in TokenizeReason] == [
        "aborted", "unknown_finish_reason", "count_mismatch", "stop_mismatch",
        "end_inside_answer", "over_budget", "text_mismatch", "truncated",
        "truncated_dropped", "unexpected_thinking", "missing_thinking",
        "unclosed_thinking", "render_failed",
        "entry_without_result", "result_not_json", "result_not_an_object",
        "result_missing_fields", "result_wrong_type", "malformed_result",
    ]  # fmt: skip
    letter = dataclasses.replace(generate_letter(1), reason=GenerateReason.POISON_CHUNK)
    plant(r, [letter])
    (stored,) = dlq.entries(r, JOB, "generate")
    assert type(stored.reason) is str and stored.reason == "poison_chunk"
    assert f"{GenerateReason.POISON_CHUNK}" == str(GenerateReason.POISON_CHUNK) == "poison_chunk"


def test_list_show_and_filters(redis_url: str, r: redis.Redis, spec: Any, prepared: Any) -> None:
    truncated = make_result(prepared.tokenizer, spec, 1)
    plant(r, [generate_letter(1), generate_letter(2), tokenize_letter(truncated), *input_letters()])

    listed = cli(redis_url, "list", "--json")
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {row["entry_id"] for row in rows} == {"p01", "p02", truncated.id, "row:0123456789abcdef",
                                                 "plong"}  # fmt: skip
    assert all("payload" not in row for row in rows)
    row = next(row for row in rows if row["entry_id"] == "p01")
    assert row["worker"] == "gpu-host:42" and row["attempts"] == 1 and row["job"] == JOB
    assert row["message"] == "too long 1" and row["source"] == {"file": "f.jsonl", "row": 1}

    only = cli(redis_url, "list", "--json", "--stage", "input", "--reason", "bad_json")
    assert [json.loads(line)["entry_id"] for line in only.stdout.splitlines()] == [
        "row:0123456789abcdef"
    ]
    table = cli(redis_url, "list", "--job", JOB)
    assert "5 entries: bad_json 1, prompt_too_long 1, rejected_by_server 2, truncated 1" in (
        table.stdout
    )
    assert "rejected_by_server" in table.stdout.splitlines()[1]
    assert cli(redis_url, "list", "--job", "nothing-here").stdout.startswith("0 entries")

    shown = cli(redis_url, "show", "p01")
    assert json.loads(shown.stdout) == orjson.loads(generate_letter(1).to_json())
    assert '"prompt_ids": [1,2,1]' in shown.stdout  # token ids stay on one line
    missing = CliRunner().invoke(dlq_group, ["show", "nope", "--redis-url", redis_url])
    assert missing.exit_code == 1 and "no dead letter 'nope'" in missing.output


def test_export_and_purge(redis_url: str, r: redis.Redis, spec: Any, tmp_path: Path) -> None:
    plant(r, [generate_letter(i) for i in range(3)] + input_letters())
    out = tmp_path / "dlq.jsonl"
    cli(redis_url, "export", str(out), "--stage", "generate")
    exported = [dlq.DeadLetter.from_json(line) for line in out.read_bytes().splitlines()]
    assert sorted(exported, key=lambda x: x.entry_id) == [generate_letter(i) for i in range(3)]

    dry = CliRunner().invoke(dlq_group, ["purge", "--all", "--stage", "input",
                                         "--redis-url", redis_url])  # fmt: skip
    assert dry.exit_code == 1 and "would purge 2 entries" in dry.output
    assert dlq.count(r, JOB, "input") == 2
    assert (
        "purged 2 entries" in cli(redis_url, "purge", "--all", "--stage", "input", "--yes").stdout
    )
    by_id = CliRunner().invoke(
        dlq_group, ["purge", "p01", "gone", "--yes", "--redis-url", redis_url]
    )
    assert by_id.exit_code == 1 and "not in the DLQ: gone" in by_id.output
    assert dlq_ids(r, "generate") == {"p00", "p02"} and dlq.count(r, JOB, "input") == 0
    assert r.hget(keys.job_counters(JOB), "dlq_purged") == b"3"


# --- requeue without workers ------------------------------------------------------------


def test_requeue_makes_new_chunks_with_the_override(
    redis_url: str, r: redis.Redis, spec: Any
) -> None:
    plant(r, [generate_letter(i) for i in range(5)])
    done = cli(redis_url, "requeue", "--all", "--set", "max_new_tokens=16", "--set", "stop=END")
    assert "requeued 5 prompt(s) in 3 new chunk(s)" in done.stdout
    chunks = queued_chunks(r, spec.queue)
    assert sorted(len(c["prompts"]) for c in chunks) == [1, 2, 2]  # the job's chunk size
    assert all(c["sampling"] == {"max_new_tokens": 16, "stop": "END"} for c in chunks)
    assert {c["chunk"] for c in chunks}.isdisjoint({"c-orig"})
    assert {p["id"] for p in queued_prompts(r, spec)} == {f"p{i:02d}" for i in range(5)}
    assert queued_prompts(r, spec)[0]["prompt_ids"][:2] == [1, 2]
    assert dlq.count(r, JOB, "generate") == 0
    assert r.hlen(keys.job_chunks(JOB)) == 3
    assert r.hget(keys.job_counters(JOB), "requeued") == b"5"


def test_bad_overrides_and_unrequeueable_entries_are_refused(
    redis_url: str, r: redis.Redis, spec: Any, prepared: Any
) -> None:
    dropped = make_result(prepared.tokenizer, spec, 3)
    plant(r, [generate_letter(1), tokenize_letter(dropped, "truncated_dropped"), *input_letters()])
    runner = CliRunner()
    unknown = runner.invoke(dlq_group, ["requeue", "--all", "--set", "temprature=0.5",
                                        "--redis-url", redis_url])  # fmt: skip
    assert (
        unknown.exit_code == 2 and "'temprature' is not an SGLang sampling param" in unknown.output
    )
    zero = runner.invoke(dlq_group, ["requeue", "--all", "--set", "max_new_tokens=0",
                                     "--redis-url", redis_url])  # fmt: skip
    assert zero.exit_code == 1 and "max_new_tokens must be a positive integer" in zero.output
    assert dlq.count(r, JOB, "generate") == 1 and not queued_chunks(r, spec.queue)

    refused = runner.invoke(dlq_group, ["requeue", dropped.id, "row:0123456789abcdef",
                                        "--redis-url", redis_url])  # fmt: skip
    assert refused.exit_code == 1
    assert "nothing to re-check or regenerate" in refused.output
    assert "fix the row, enqueue the file again" in refused.output
    assert dlq.count(r, JOB, "tokenize") == 1 and dlq.count(r, JOB, "input") == 2


def test_input_entries_too_long_are_requeued_once_they_fit(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    fits_later, never = "Please repeat: " + "words " * 60, "Please repeat: " + "words " * 200
    spec = enqueue_prompts(redis_url, tmp_path, ["Short question?", fits_later, never],
                           job=JOB, max_new_tokens=150, context_length=200)  # fmt: skip
    assert dlq.count(r, JOB, "input") == 2
    args = ["requeue", "--all", "--stage", "input", "--set", "max_new_tokens=100"]
    done = CliRunner().invoke(dlq_group, [*args, "--redis-url", redis_url])
    assert "requeued 1 prompt(s)" in done.output and "still too long" in done.output
    (chunk,) = [c for c in queued_chunks(r, spec.queue) if c["sampling"]]
    (prompt,) = chunk["prompts"]
    assert prompt["messages"][-1]["content"] == fits_later  # as written
    kwargs = spec.chat_template_kwargs
    assert prompt["prompt_ids"] == render_prompt_ids(smollm2_tokenizer, prompt["messages"], kwargs)
    (left,) = list(dlq.entries(r, JOB, "input"))
    assert left.payload["messages"][-1]["content"] == never  # as written


def test_tokenize_entries_can_be_generated_again(
    redis_url: str, r: redis.Redis, spec: Any, prepared: Any
) -> None:
    result = dataclasses.replace(make_result(prepared.tokenizer, spec, 4),
                                 sampling={"max_new_tokens": 64, "temperature": 0.0})  # fmt: skip
    plant(r, [tokenize_letter(result)])
    cli(redis_url, "requeue", result.id, "--regenerate", "--set", "max_new_tokens=256")
    (chunk,) = queued_chunks(r, spec.queue)
    assert chunk["sampling"] == {"max_new_tokens": 256, "temperature": 0.0}
    assert chunk["prompts"][0]["prompt_ids"] == result.prompt_ids
    assert dlq.count(r, JOB, "tokenize") == 0


# --- kill safety ------------------------------------------------------------------------


def test_a_requeue_stopped_between_chunks_loses_and_duplicates_nothing(
    redis_url: str, r: redis.Redis, spec: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = {f"p{i:02d}" for i in range(9)}
    plant(r, [generate_letter(i) for i in range(9)])
    steps = []

    def fail_on_third(name: str) -> None:
        steps.append(name)
        if len(steps) == 3:
            raise RuntimeError("stopped between two Redis steps")

    monkeypatch.setattr(crashpoints, "hit", fail_on_third)
    stopped = CliRunner().invoke(dlq_group, ["requeue", "--all", "--redis-url", redis_url])
    assert isinstance(stopped.exception, RuntimeError)
    assert len(queued_prompts(r, spec)) == 6 and dlq.count(r, JOB, "generate") == 3
    assert_each_in_one_place(r, spec, ids)

    monkeypatch.undo()
    cli(redis_url, "requeue", "--all")
    assert_each_in_one_place(r, spec, ids)
    assert dlq.count(r, JOB, "generate") == 0


@pytest.mark.slow
def test_a_requeue_killed_by_sigkill_loses_and_duplicates_nothing(
    redis_url: str, r: redis.Redis, spec: Any
) -> None:
    ids = {f"p{i:02d}" for i in range(9)}
    plant(r, [generate_letter(i) for i in range(9)])
    env = {**os.environ, "PYTHONPATH": str(REPO), "REGEN_CRASHPOINT": CRASHPOINT}
    killed = subprocess.run(
        [sys.executable, "-c", "from regen.cli_dlq import dlq_group; dlq_group()",
         "requeue", "--all", "--redis-url", redis_url],
        env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert len(queued_prompts(r, spec)) == 2  # the first chunk, then the kill
    assert_each_in_one_place(r, spec, ids)
    cli(redis_url, "requeue", "--all")
    assert_each_in_one_place(r, spec, ids)
    assert dlq.count(r, JOB, "generate") == 0


# --- requeue end to end -----------------------------------------------------------------


def test_a_truncated_result_requeued_to_a_keeping_tokenizer_ends_in_a_shard(
    redis_url: str, r: redis.Redis, spec: Any, prepared: Any, tmp_path: Path
) -> None:
    good = make_result(prepared.tokenizer, spec, 1)
    cut = make_result(prepared.tokenizer, spec, 2)
    cut = dataclasses.replace(cut, finish_reason={"type": "length", "length": 64})
    push(r, [good, cut])
    out = tmp_path / "out"
    with InProcess(r, options(out, on_truncated="dlq"), "c1"):
        wait_for(lambda: settled(r, JOB, 2), what="the cut result dead-lettered")
    assert dlq_ids(r, "tokenize") == {cut.id}

    assert "1 result(s) back to the tokenize stage" in cli(redis_url, "requeue", cut.id).stdout
    assert dlq.count(r, JOB, "tokenize") == 0 and r.xlen(keys.results_stream(JOB)) == 1
    with InProcess(r, options(out, on_truncated="keep"), "c2"):
        wait_for(lambda: settled(r, JOB, 2) and CommitLedger(r, JOB).owner_of([cut.id]) != [None],
                 what="the requeued result committed")  # fmt: skip
    records = {rec["id"]: rec for shard in shard_paths(out / JOB) for rec in iter_records(shard)}
    assert set(records) == {good.id, cut.id}
    assert records[cut.id]["finish_reason"] == "length"
    assert dlq.count(r, JOB, "tokenize") == 0


@pytest.mark.slow
def test_a_rejected_prompt_requeued_with_a_smaller_max_new_tokens_ends_in_a_shard(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    # 134 prompt tokens: over a 160-token context with 48 new tokens, inside it with 16.
    long_prompt = "Please repeat: " + "words " * 100
    prompts = [f"Tell me fact number {i} about the moon." for i in range(3)] + [long_prompt]
    spec = enqueue_prompts(redis_url, tmp_path, prompts, job="g", max_new_tokens=48)
    with run_standin(context_length=160, output_len_dist="fixed:n=6") as server, Worker(
        redis_url, tmp_path, "--engine", "sglang", "--server", server.url, "--jobs", "g"
    ):  # fmt: skip
        wait_for(lambda: dlq.count(r, "g", "generate") == 1 and len(results(r, "g")) == 3
                 and all_acked(r, spec), timeout=120, what="the long prompt rejected")  # fmt: skip
        (letter,) = list(dlq.entries(r, "g", "generate"))
        # Still too long with 40 new tokens: it comes back, remembering what it ran with.
        cli(redis_url, "requeue", letter.entry_id, "--set", "max_new_tokens=40")
        wait_for(lambda: dlq.count(r, "g", "generate") == 1 and all_acked(r, spec),
                 timeout=120, what="the prompt rejected again")  # fmt: skip
        (again,) = list(dlq.entries(r, "g", "generate"))
        assert again.payload["sampling"] == {"max_new_tokens": 40}
        assert again.payload["chunk"] != letter.payload["chunk"]
        requeued = cli(redis_url, "requeue", letter.entry_id, "--set", "max_new_tokens=16")
        assert "requeued 1 prompt(s) in 1 new chunk(s)" in requeued.stdout
        assert dlq.count(r, "g", "generate") == 0
        wait_for(lambda: len(results(r, "g")) == 4 and all_acked(r, spec), timeout=120,
                 what="the requeued prompt generated")  # fmt: skip
    generated = {res.id for res in results(r, "g")}
    out = tmp_path / "out"
    with InProcess(r, options(out), "c1"):
        wait_for(lambda: settled(r, "g", 4), timeout=120, what="all four in shards")
    records = {rec["id"]: rec for shard in shard_paths(out / "g") for rec in iter_records(shard)}
    assert letter.entry_id in generated and set(records) == generated
    assert records[letter.entry_id]["sampling"]["max_new_tokens"] == 16
    assert records[letter.entry_id]["messages"][0]["content"] == long_prompt  # as written
    others = [rec for pid, rec in records.items() if pid != letter.entry_id]
    assert all(rec["sampling"]["max_new_tokens"] == 48 for rec in others)
    assert sum(dlq.count(r, "g", stage) for stage in keys.STAGES) == 0
