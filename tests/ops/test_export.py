"""`regen shards export`: each format read back by the loader its trainer uses, the
selection options, and a 10K-record round trip with flat memory."""

from __future__ import annotations

import json
import random
import shutil
import sys
import tracemalloc
from numbers import Integral
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
from click.testing import CliRunner

from regen.cli_shards import shards_group
from regen.consumers.tokenize.shard_files import iter_records
from regen.ops import export_order
from regen.ops.export import (
    ExportError,
    ExportOptions,
    export,
    heldout_path,
)
from regen.ops.export_order import held_out, shuffle_key, sort_by_key
from tests.ops.test_shards_inspect import USER, make_record, write_shard
from tests.support.specforge_loader import specforge_prompts

datasets = pytest.importorskip("datasets")

Row = dict[str, Any]


def records(prefix: str, n: int, job: str, seed: int) -> list[Row]:
    """Records of varied lengths and random ids; every fifth with only its end-of-turn
    token generated (a record has at least that one)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        record = make_record(f"{prefix}{i}", prompt=rng.randint(2, 12), completion=i % 5 * 3 + 1)
        record["job"] = job
        record["input_ids"] = [rng.randrange(150_000) for _ in record["input_ids"]]
        out.append(record)
    return out


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """Two jobs: job-a in two shards, job-b in one with other sampling params."""
    out = tmp_path / "out"
    write_shard(out / "job-a", 1, records("a", 30, "job-a", seed=1))
    write_shard(out / "job-a", 2, records("b", 20, "job-a", seed=2))
    job_b = records("c", 25, "job-b", seed=3)
    for record in job_b:
        record["sampling"] = {"max_new_tokens": 32, "temperature": 0.6, "stop": ["END"]}
        record["chat_template_kwargs"] = {"thinking": False}
    write_shard(out / "job-b", 1, job_b)
    return out


def shard_records(job: Path) -> list[Row]:
    return [record for shard in sorted(job.glob("shard-*")) for record in iter_records(shard)]


def all_records(out_dir: Path) -> list[Row]:
    return shard_records(out_dir / "job-a") + shard_records(out_dir / "job-b")


# --- the trainers' loaders ---------------------------------------------------------------


def load_specforge(path: Path) -> list[Row]:
    """SpecForge's documented `data.prompts_path` contract: a plain JSONL file whose rows
    hold non-empty integer lists `input_ids` and `loss_mask` of equal length, the mask
    0/1; other keys ignored."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            assert isinstance(row, dict)
            ids, mask = row["input_ids"], row["loss_mask"]
            assert ids and len(ids) == len(mask)
            assert all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids)
            assert all(m in (0, 1) for m in mask)
            rows.append(row)
    return rows


def load_speculators(path: Path, cache: Path) -> Any:
    """As speculators' prepare_data.py reads `--data FILE.jsonl`: `datasets`' json loader,
    speculator-format when both `input_ids` and `loss_mask` are columns."""
    assert path.suffix in (".jsonl", ".json")
    dataset = datasets.load_dataset(
        "json", data_files=str(path), split="train", cache_dir=str(cache)
    )
    assert {"input_ids", "loss_mask"} <= set(dataset.column_names)
    for row in dataset:
        assert len(row["input_ids"]) == len(row["loss_mask"])
    return dataset


def ids_and_masks(rows: Any) -> list[tuple[str, list[int], list[int]]]:
    return [(row["id"], list(row["input_ids"]), list(row["loss_mask"])) for row in rows]


# --- formats -----------------------------------------------------------------------------


def test_specforge_rows_are_the_shards(out_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sf.jsonl"
    summary = export(out_dir, out, ExportOptions(format="specforge"))
    rows = load_specforge(out)
    assert ids_and_masks(rows) == ids_and_masks(all_records(out_dir))
    assert {key for row in rows for key in row} == {"id", "input_ids", "loss_mask"}
    # SpecForge's own reader trains on every record, whole.
    assert specforge_prompts(out) == [
        (record["input_ids"], record["loss_mask"]) for record in all_records(out_dir)
    ]
    assert (summary.written, summary.cut, summary.dropped.total()) == (75, 0, 0)
    assert not list(tmp_path.glob(".*.tmp"))


def test_speculators_rows_carry_the_metadata(out_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sp.jsonl"
    export(out_dir, out, ExportOptions(format="speculators"))
    dataset = load_speculators(out, tmp_path / "hf-cache")
    expected = all_records(out_dir)
    assert ids_and_masks(dataset) == ids_and_masks(expected)
    for row, record in zip(dataset, expected, strict=True):
        assert row["job"] == record["job"] and row["model"] == record["model"]
        assert row["seq_len"] == len(record["input_ids"])
        assert (row["prompt_tokens"], row["completion_tokens"], row["finish_reason"]) == (
            record["prompt_tokens"], record["completion_tokens"], record["finish_reason"],
        )  # fmt: skip
        # Merged jobs with other sampling keys still load: the params are JSON text.
        assert json.loads(row["sampling"]) == record["sampling"]
        assert json.loads(row["chat_template_kwargs"]) == record["chat_template_kwargs"]


def test_speculators_output_is_named_as_prepare_data_reads_it(
    out_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ExportError, match=r"\*\.jsonl"):
        export(out_dir, tmp_path / "sp.txt", ExportOptions(format="speculators"))
    assert not (tmp_path / "sp.txt").exists()


def test_hf_loads_with_load_from_disk(out_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    export(out_dir, out, ExportOptions(format="hf"))
    dataset = datasets.load_from_disk(str(out))
    expected = all_records(out_dir)
    assert ids_and_masks(dataset) == ids_and_masks(expected)
    assert dataset.features["input_ids"].feature.dtype == "int32"
    assert dataset.features["loss_mask"].feature.dtype == "int8"
    assert [json.loads(s) for s in dataset["sampling"]] == [r["sampling"] for r in expected]
    assert dataset["finish_reason"] == [r["finish_reason"] for r in expected]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "out"]  # no scratch left


def test_hf_has_a_dataset_card_with_provenance(out_dir: Path, tmp_path: Path) -> None:
    from collections import Counter

    from huggingface_hub import DatasetCard

    made_by = {"job": "job-a", "model": "kimi-k2.6", "regen_version": "0.1.0",
               "chat_template_sha256": "abc123",
               "effective_sampling": {"temperature": 1.0}}  # fmt: skip
    (out_dir / "job-a" / "provenance.json").write_bytes(orjson.dumps(made_by))
    flagged = records("z", 3, "job-a", seed=9)
    for record in flagged:
        record["flags"], record["finish_reason"] = ["truncated"], "length"
    write_shard(out_dir / "job-a", 3, flagged)
    out = tmp_path / "ds"
    letters = {"input": Counter(), "generate": Counter({"rejected_by_server": 2}),
               "tokenize": Counter()}  # fmt: skip
    export(out_dir, out, ExportOptions(format="hf", heldout=0.2), dead_letters=letters)

    card = DatasetCard.load(out / "README.md")
    assert card.data.dataset_info["splits"][0]["name"] == "train"
    written = datasets.load_from_disk(str(out))
    assert card.data.dataset_info["splits"][0]["num_examples"] == len(written) > 0
    assert [f["name"] for f in card.data.dataset_info["features"]] == written.column_names
    assert card.data.license == "unknown"  # the user's to fill
    text = card.text
    assert f"| records | {len(written):,} |" in text
    assert f"| flagged `truncated` (kept) | {written['flags'].count(['truncated'])} |" in text
    assert "| generate | `rejected_by_server` | 2 |" in text
    assert "| chat template sha256 | `abc123` |" in text and "kimi-k2.6" in text
    assert (out / "answer_lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The job's provenance, with the SGLang versions of its records' servers (the
    # manifests count them; these records name none).
    with_versions = {**made_by, "server_versions": {}}
    assert orjson.loads((out / "provenance.json").read_bytes()) == {"jobs": [with_versions]}
    # The header's config points at the same rows (what the Hub's viewer reads once the
    # folder is uploaded; datasets itself sends a save_to_disk folder to load_from_disk).
    (config,) = card.data.configs
    (files,) = config["data_files"]
    loaded = datasets.load_dataset("arrow", data_files=str(out / files["path"]), split="train")
    assert files["split"] == "train" and ids_and_masks(loaded) == ids_and_masks(written)
    # The held-out folder has its own card; a file export carries provenance beside it.
    heldout = DatasetCard.load(tmp_path / "ds.heldout" / "README.md")
    assert heldout.data.dataset_info["splits"][0]["num_examples"] == len(
        datasets.load_from_disk(str(tmp_path / "ds.heldout"))
    )
    export(out_dir, tmp_path / "sf.jsonl", ExportOptions(format="specforge"))
    sidecar = orjson.loads((tmp_path / "sf.jsonl.provenance.json").read_bytes())
    assert sidecar == {"jobs": [with_versions]}


def test_hf_with_every_record_dropped_loads_empty(out_dir: Path, tmp_path: Path) -> None:
    summary = export(out_dir, tmp_path / "ds", ExportOptions(format="hf", min_loss_tokens=99))
    assert (summary.written, summary.dropped["few_loss_tokens"]) == (0, 75)
    dataset = datasets.load_from_disk(str(tmp_path / "ds"))
    assert len(dataset) == 0 and "loss_mask" in dataset.column_names


def test_hf_refuses_an_existing_folder(out_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    with pytest.raises(ExportError, match="exists"):
        export(out_dir, tmp_path / "ds", ExportOptions(format="hf"))


def test_hf_without_datasets_names_the_extra(
    out_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    with pytest.raises(ExportError, match=r"regen\[export\]"):
        export(out_dir, tmp_path / "ds", ExportOptions(format="hf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_conversations(tmp_path: Path) -> None:
    job = tmp_path / "out" / "job-a"
    write_shard(job, 1, [make_record("a", reasoning="hm"), make_record("b")])
    write_shard(job, 2, [make_record("c")])
    out = tmp_path / "export.jsonl"
    assert export(job, out).written == 3
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert set(rows[0]) == {"id", "conversations"}
    assert rows[0]["conversations"] == [
        USER, {"role": "assistant", "content": "4", "reasoning_content": "hm"},
    ]  # fmt: skip
    assert rows[1]["conversations"][-1] == {"role": "assistant", "content": "4"}
    assert not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(ValueError, match="unknown export format"):
        ExportOptions(format="sharegpt")
    with pytest.raises(ExportError, match="no ids to cut"):
        ExportOptions(max_length=4, truncate=True)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "a*b",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]


def tool_call(call_id: str) -> Row:
    return {"id": call_id, "type": "function",
            "function": {"name": "multiply", "arguments": '{"a": 2}'}}  # fmt: skip


def test_conversations_keep_tool_calls_and_tools(tmp_path: Path) -> None:
    record = make_record("t")
    record["tools"] = TOOLS
    record["tool_results"] = "dataset"
    record["messages"] = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [tool_call("call_1")]},
        {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "multiply"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "hm",
         "tool_calls": [tool_call("call_2")]},
    ]  # fmt: skip
    job = tmp_path / "out" / "job-a"
    write_shard(job, 1, [record, make_record("plain")])
    out = tmp_path / "conv.jsonl"
    export(job, out)
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert rows[0] == {"id": "t", "tools": TOOLS, "conversations": record["messages"]}
    assert "tools" not in rows[1]  # a row without tools has no key for them


def test_a_row_with_nothing_to_train_on_is_dropped(tmp_path: Path) -> None:
    job = tmp_path / "out" / "job-a"
    write_shard(job, 1, [make_record("long-prompt", prompt=12, completion=3),
                         make_record("fits", prompt=3, completion=3)])  # fmt: skip
    out = tmp_path / "sf.jsonl"
    # Cut to 8 tokens, the first record is all prompt: a row with an all-zero mask.
    summary = export(job, out, ExportOptions(format="specforge", max_length=8, truncate=True))
    assert [row["id"] for row in load_specforge(out)] == ["fits"]
    assert dict(summary.dropped) == {"no_loss_tokens": 1} and summary.cut == 0
    assert "dropped 1 (no_loss_tokens 1)" in summary.line()


# --- options -----------------------------------------------------------------------------


def test_max_length_drops_by_default(out_dir: Path, tmp_path: Path) -> None:
    expected = [r for r in all_records(out_dir) if len(r["input_ids"]) <= 10]
    out = tmp_path / "sf.jsonl"
    summary = export(out_dir, out, ExportOptions(format="specforge", max_length=10))
    assert ids_and_masks(load_specforge(out)) == ids_and_masks(expected)
    assert dict(summary.dropped) == {"too_long": 75 - len(expected)}
    assert summary.cut == 0 and 0 < len(expected) < 75
    assert f"dropped {75 - len(expected)} (too_long {75 - len(expected)}); cut 0" in summary.line()


def test_max_length_truncate_cuts(out_dir: Path, tmp_path: Path) -> None:
    shards = all_records(out_dir)
    out = tmp_path / "sp.jsonl"
    options = ExportOptions(format="speculators", max_length=10, truncate=True)
    summary = export(out_dir, out, options)
    rows = list(load_speculators(out, tmp_path / "hf-cache"))
    # A prompt of 10 tokens or more is cut to no answer at all: nothing to train on.
    kept = [r for r in shards if sum(r["loss_mask"][:10])]
    assert ids_and_masks(rows) == [
        (r["id"], r["input_ids"][:10], r["loss_mask"][:10]) for r in kept
    ]
    long = [row for row, r in zip(rows, kept, strict=True) if len(r["input_ids"]) > 10]
    assert summary.cut == len(long) > 0
    assert dict(summary.dropped) == {"no_loss_tokens": len(shards) - len(kept)} != {}
    for row in long:
        assert row["seq_len"] == 10 == row["prompt_tokens"] + row["completion_tokens"]
        assert row["completion_tokens"] == sum(row["loss_mask"])
        assert row["finish_reason"] == "length"


def test_min_loss_tokens_counts_after_the_cut(out_dir: Path, tmp_path: Path) -> None:
    shards = all_records(out_dir)
    out = tmp_path / "sf.jsonl"
    options = ExportOptions(format="specforge", max_length=12, truncate=True, min_loss_tokens=3)
    summary = export(out_dir, out, options)
    kept = [r for r in shards if sum(r["loss_mask"][:12]) >= 3]
    assert [row["id"] for row in load_specforge(out)] == [r["id"] for r in kept]
    none = sum(not sum(r["loss_mask"][:12]) for r in shards)
    assert dict(summary.dropped) == {
        "no_loss_tokens": none, "few_loss_tokens": len(shards) - len(kept) - none,
    }  # fmt: skip
    assert none > 0
    assert summary.cut == sum(len(r["input_ids"]) > 12 for r in kept)


def test_shuffle_is_deterministic_by_seed(out_dir: Path, tmp_path: Path) -> None:
    def order(name: str, seed: int) -> list[str]:
        out = tmp_path / f"{name}.jsonl"
        export(out_dir, out, ExportOptions(format="specforge", seed=seed))
        return [row["id"] for row in load_specforge(out)]

    in_shards = [r["id"] for r in all_records(out_dir)]
    first, again, other = order("first", 7), order("again", 7), order("other", 8)
    assert first == again
    assert first != other and first != in_shards
    assert sorted(first) == sorted(other) == sorted(in_shards)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # scratch removed


def test_shuffle_order_does_not_depend_on_the_bucket_count(tmp_path: Path) -> None:
    items = [(shuffle_key(3, f"job\0id{i}"), {"n": i}) for i in range(500)]
    one = list(sort_by_key(iter(items), 1, tmp_path))
    seven = list(sort_by_key(iter(items), 7, tmp_path))
    assert one == seven == [payload for _, payload in sorted(items, key=lambda kv: kv[0])]
    assert list(tmp_path.iterdir()) == []


def test_split_holds_out_a_fraction_by_id(out_dir: Path, tmp_path: Path) -> None:
    ids = [r["id"] for r in all_records(out_dir)]
    expected = {i for i in ids if held_out(i, 0.3)}
    out = tmp_path / "sf.jsonl"
    summary = export(out_dir, out, ExportOptions(format="specforge", heldout=0.3, seed=1))
    train = {row["id"] for row in load_specforge(out)}
    test = {row["id"] for row in load_specforge(heldout_path(out))}
    assert heldout_path(out).name == "sf.heldout.jsonl"
    assert test == expected and train == set(ids) - expected
    assert (summary.written, summary.held_out) == (len(train), len(test))
    assert 0.15 < len(test) / len(ids) < 0.45
    # The same records are held out whatever the seed or format, and with --split-out.
    export(out_dir, tmp_path / "ds", ExportOptions(format="hf", heldout=0.3),
           heldout_out=tmp_path / "held")  # fmt: skip
    assert set(datasets.load_from_disk(str(tmp_path / "held"))["id"]) == expected
    with pytest.raises(ExportError, match="--split"):
        export(out_dir, out, ExportOptions(format="specforge"), heldout_out=tmp_path / "h")
    # About the fraction asked, over many ids.
    assert 2_800 < sum(held_out(f"id{i}", 0.3) for i in range(10_000)) < 3_200


def test_split_keeps_the_turns_of_a_conversation_together(tmp_path: Path) -> None:
    turns = records("t", 60, "job-t", seed=4)
    for index, record in enumerate(turns):  # 20 conversations of 3 turns
        record["conversation_id"], record["turn"] = f"conv{index // 3}", index % 3
    write_shard(tmp_path / "out" / "job-t", 1, turns)
    out = tmp_path / "sf.jsonl"
    export(tmp_path / "out", out, ExportOptions(format="specforge", heldout=0.5))
    sides = {row["id"]: side for side, path in ((0, out), (1, heldout_path(out)))
             for row in load_specforge(path)}  # fmt: skip
    by_conversation: dict[str, set[int]] = {}
    for record in turns:
        by_conversation.setdefault(record["conversation_id"], set()).add(sides[record["id"]])
    assert all(len(s) == 1 for s in by_conversation.values()), by_conversation
    assert {side for (side,) in by_conversation.values()} == {0, 1}


def test_jobs_merge_in_the_order_given(out_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "sf.jsonl"
    export(out_dir, out, ExportOptions(format="specforge", jobs=("job-b", "job-a")))
    expected = shard_records(out_dir / "job-b") + shard_records(out_dir / "job-a")
    assert ids_and_masks(load_specforge(out)) == ids_and_masks(expected)
    export(out_dir, out, ExportOptions(format="specforge", jobs=("job-b",)))
    assert [row["id"] for row in load_specforge(out)] == [r["id"] for r in expected[:25]]
    with pytest.raises(ExportError, match=r"no job job-z in .*; its jobs: job-a, job-b"):
        export(out_dir, out, ExportOptions(format="specforge", jobs=("job-z",)))


def test_cli_export_prints_a_summary(out_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "sf.jsonl"
    args = ["export", str(out_dir), "--format", "specforge", "--out", str(out),
            "--jobs", "job-a,job-b", "--max-length", "10", "--shuffle", "--seed", "3",
            "--split", "0.2", "--min-loss-tokens", "2"]  # fmt: skip
    result = runner.invoke(shards_group, args)
    assert result.exit_code == 0, result.output
    (line,) = result.output.splitlines()
    written = len(load_specforge(out))
    held = len(load_specforge(heldout_path(out)))
    assert line.startswith(f"wrote {written} records to {out}; {held} held out to ")
    assert "too_long" in line and "few_loss_tokens" in line and line.endswith("cut 0")

    bad = runner.invoke(shards_group, ["export", str(out_dir), "--format", "x", "--out", str(out)])
    assert bad.exit_code == 1 and "unknown export format 'x'" in bad.output
    bad = runner.invoke(shards_group, ["export", str(out_dir), "--out", str(out), "--truncate"])
    assert bad.exit_code == 1 and "--max-length" in bad.output


# --- an id in two shards ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["specforge", "hf"])
@pytest.mark.parametrize("seed", [None, 4])
def test_a_copied_folder_is_exported_once(
    out_dir: Path, tmp_path: Path, fmt: str, seed: int | None
) -> None:
    # A job folder copied beside itself (a backup put back under another name): its
    # records name the same job, so each is the same record twice.
    shutil.copytree(out_dir / "job-a", out_dir / "job-a.bak")
    out = tmp_path / ("ds" if fmt == "hf" else "sf.jsonl")
    summary = export(out_dir, out, ExportOptions(format=fmt, seed=seed))
    rows = datasets.load_from_disk(str(out)) if fmt == "hf" else load_specforge(out)
    expected = ids_and_masks(all_records(out_dir))
    assert sorted(ids_and_masks(rows)) == sorted(expected)  # each id once
    if seed is None:  # the first copy, in place: the export is the one without the copy
        assert ids_and_masks(rows) == expected
    assert summary.written == 75 and dict(summary.dropped) == {"duplicate_id": 50}
    assert summary.duplicates == [
        ("job-a/shard-000001.jsonl.zst", "job-a.bak/shard-000001.jsonl.zst", 30, "a0"),
        ("job-a/shard-000002.jsonl.zst", "job-a.bak/shard-000002.jsonl.zst", 20, "b0"),
    ]


def test_a_restored_shard_and_a_twice_written_row_are_exported_once(tmp_path: Path) -> None:
    job = tmp_path / "out" / "job-a"
    write_shard(job, 1, [make_record("a"), make_record("b"), make_record("a")])
    write_shard(job, 2, [make_record("c"), make_record("d")])
    shutil.copy(job / "shard-000002.jsonl.zst", job / "shard-000007.jsonl.zst")
    out = tmp_path / "sf.jsonl"
    summary = export(job, out, ExportOptions(format="specforge"))
    assert [row["id"] for row in load_specforge(out)] == ["a", "b", "c", "d"]
    assert dict(summary.dropped) == {"duplicate_id": 3}
    assert "duplicate_id 3" in summary.line()


def test_the_same_prompt_in_two_jobs_is_two_records(tmp_path: Path) -> None:
    # Prompt ids come from the prompt's content: two jobs over one dataset share them,
    # and each job's answer is its own record.
    write_shard(tmp_path / "out" / "job-a", 1, [make_record("a")])
    other = make_record("a")
    other["job"] = "job-b"
    write_shard(tmp_path / "out" / "job-b", 1, [other])
    out = tmp_path / "sf.jsonl"
    summary = export(tmp_path / "out", out, ExportOptions(format="specforge"))
    assert summary.written == 2 and not summary.dropped


def test_cli_export_warns_of_ids_in_two_shards(out_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(out_dir / "job-a", out_dir / "job-a.bak")
    out = tmp_path / "sf.jsonl"
    result = CliRunner().invoke(
        shards_group, ["export", str(out_dir), "--format", "specforge", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "30 ids of job-a/shard-000001.jsonl.zst also in job-a.bak/shard-000001" in result.output
    assert "duplicate_id 50" in result.output and len(load_specforge(out)) == 75


# --- scale -------------------------------------------------------------------------------


def write_big_job(out: Path, n: int, tokens: int) -> None:
    """`n` records of `tokens` random ids, in ten shards."""
    rng = random.Random(0)
    per_shard = n // 10
    for seq in range(10):
        shard = [make_record(f"r{seq}-{i}", prompt=tokens // 4, completion=tokens - tokens // 4)
                 for i in range(per_shard)]  # fmt: skip
        for record in shard:
            record["input_ids"] = [rng.randrange(150_000) for _ in range(tokens)]
        write_shard(out, seq + 1, shard)


def traced_peak(run: Any) -> int:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_10k_records_round_trip_with_flat_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = tmp_path / "out" / "job-a"
    write_big_job(job, 10_000, 384)
    expected = ids_and_masks(shard_records(job))
    sf, ds = tmp_path / "sf.jsonl", tmp_path / "ds"

    sf_peak = traced_peak(lambda: export(job, sf, ExportOptions(format="specforge")))
    assert ids_and_masks(load_specforge(sf)) == expected
    data_bytes = sf.stat().st_size  # ~30 MB; as Python lists the records take ~6x that
    # Buckets of 2 MB: the shuffle then spills and sorts ~15 of them, one at a time.
    monkeypatch.setattr(export_order, "BUCKET_BYTES", 2 << 20)
    # The first hf export imports its libraries (the card's matplotlib, pyarrow's
    # modules): a one-time cost of the process, not the export's memory, and already
    # paid or not depending on which tests ran before in this process.
    small = tmp_path / "small" / "job-a"
    write_big_job(small, 10, 8)
    export(small, tmp_path / "warm-up", ExportOptions(format="hf", seed=5))
    hf_peak = traced_peak(lambda: export(job, ds, ExportOptions(format="hf", seed=5)))
    loaded = ids_and_masks(datasets.load_from_disk(str(ds)))
    assert sorted(loaded) == sorted(expected) and loaded != expected

    assert sf_peak < data_bytes / 4, (sf_peak, data_bytes)
    assert hf_peak < data_bytes / 4, (hf_peak, data_bytes)
    # Arrow's own allocations (outside tracemalloc's view): the batches, never the data.
    assert pa.default_memory_pool().max_memory() < data_bytes / 4


def test_flagged_records_are_dropped_by_flag(tmp_path: Path) -> None:
    out = tmp_path / "out"
    flags = [[], ["empty"], ["truncated"], ["truncated", "repetition"], ["bad_tool_call"],
             ["thinking_only", "truncated"], []]  # fmt: skip
    rows = records("f", len(flags), "job-f", seed=5)
    for record, flagged in zip(rows, flags, strict=True):
        record["flags"] = flagged
    write_shard(out / "job-f", 1, rows)

    # By default every flag but `truncated` drops: truncated answers are still on-policy.
    summary = export(out, tmp_path / "sf.jsonl", ExportOptions(format="specforge"))
    assert [row["id"] for row in load_specforge(tmp_path / "sf.jsonl")] == ["f0", "f2", "f6"]
    assert dict(summary.dropped) == {"flagged": 4}
    assert dict(summary.flagged) == {"empty": 1, "repetition": 1, "bad_tool_call": 1,
                                     "thinking_only": 1}  # fmt: skip
    assert "dropped 4 (flagged 4); dropped by flag: bad_tool_call 1, empty 1, " in summary.line()

    result = CliRunner().invoke(
        shards_group,
        ["export", str(out), "--format", "specforge", "--out", str(tmp_path / "t.jsonl"),
         "--drop", "truncated"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [row["id"] for row in load_specforge(tmp_path / "t.jsonl")] == ["f0", "f1", "f4", "f6"]
    assert "dropped by flag: truncated 3" in result.output
    result = CliRunner().invoke(
        shards_group,
        ["export", str(out), "--format", "specforge", "--out", str(tmp_path / "n.jsonl"),
         "--drop", "none"],
    )  # fmt: skip
    assert len(load_specforge(tmp_path / "n.jsonl")) == len(flags)
    result = CliRunner().invoke(
        shards_group,
        ["export", str(out), "--out", str(tmp_path / "x.jsonl"), "--drop", "loops"],
    )
    assert result.exit_code != 0 and "unknown quality flag loops" in result.output
