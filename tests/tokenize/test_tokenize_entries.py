"""Unreadable results-stream entries: dead-lettered with their bytes, never a stopped stage."""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from regen.common import dlq, jobspec, keys
from regen.common.ledger.job_ids import JobIds
from regen.common.ledger.places import count_places
from regen.common.record import Reason
from regen.common.results import FIELD, GeneratedResult
from regen.consumers.tokenize.entries import (
    FIELD_TYPES,
    RAW_LIMIT,
    REQUIRED,
    Unreadable,
    read_entry,
)
from regen.ops.reconcile import reconcile
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import make_result, wait_for
from tests.tokenize.test_tokenize_stage import InProcess, options, settled, shard_ids


@pytest.fixture
def spec(r: redis.Redis) -> jobspec.JobSpec:
    prepared = prepare_job(JobOptions(job="t", model="smollm2", max_new_tokens=64))
    return jobspec.save(r, prepared.spec)


def _fields(result: GeneratedResult, **changes: Any) -> dict[str, Any]:
    return {**result.__dict__, **changes}


def _without(result: GeneratedResult, name: str) -> dict[str, Any]:
    fields = dict(result.__dict__)
    del fields[name]
    return fields


def _raw(payload: dict[str, Any]) -> bytes:
    text = payload["raw"]
    return base64.b64decode(text) if payload["encoding"] == "base64" else text.encode()


def test_each_field_of_a_result_has_a_checked_type() -> None:
    # A field added to GeneratedResult without a type here would go unchecked.
    assert set(FIELD_TYPES) == {f.name for f in dataclasses.fields(GeneratedResult)}
    required = {
        f.name
        for f in dataclasses.fields(GeneratedResult)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert required == REQUIRED


def test_a_newer_workers_result_is_read_without_its_unknown_fields(
    spec: jobspec.JobSpec, smollm2_tokenizer: Any
) -> None:
    result = make_result(smollm2_tokenizer, spec, 1)
    newer = {FIELD: orjson.dumps(_fields(result, added_later={"x": 1})), b"v": b"3"}
    assert read_entry(newer) == result


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"\xff\x00 not json", Reason.RESULT_NOT_JSON),
        (b"[1, 2]", Reason.RESULT_NOT_AN_OBJECT),
        (b'{"id": "abc", "job": "t"}', Reason.RESULT_MISSING_FIELDS),
    ],
)
def test_an_unreadable_value_names_its_reason(value: bytes, reason: Reason) -> None:
    read = read_entry({FIELD: value})
    assert isinstance(read, Unreadable) and read.reason == reason and read.raw == value


def test_wrong_types_are_refused_down_to_the_token_ids(
    spec: jobspec.JobSpec, smollm2_tokenizer: Any
) -> None:
    result = make_result(smollm2_tokenizer, spec, 1)
    for changes in ({"prompt_ids": "1 2 3"}, {"output_ids": [1, "2"]}, {"attempt": True},
                    {"messages": ["hi"]}, {"turn": 1.5}):  # fmt: skip
        read = read_entry({FIELD: orjson.dumps(_fields(result, **changes))})
        assert isinstance(read, Unreadable), changes
        assert read.reason == Reason.RESULT_WRONG_TYPE and read.prompt_id == result.id
        assert next(iter(changes)) in read.message


def test_bad_entries_go_to_the_dlq_and_the_stage_goes_on(
    r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(10)]
    JobIds(r, "t").add([res.id for res in results])
    cut = results[5].encode()
    huge = b"\x01garbage" * (RAW_LIMIT // 4)
    stream = keys.results_stream("t")
    entries: list[dict[Any, Any]] = [
        results[0].to_fields(),
        {FIELD: b"\xff\x00 not json"},  # no id to recover
        results[1].to_fields(),
        {FIELD: cut[: len(cut) // 2]},  # cut short: its id is still readable
        {FIELD: orjson.dumps(_without(results[6], "output_ids"))},
        {FIELD: orjson.dumps(_fields(results[7], prompt_ids="1 2 3"))},
        {b"x": b"a field this stage does not know"},
        {FIELD: orjson.dumps(_fields(results[8], added_later=[1])), b"v": b"3"},  # newer
        {FIELD: huge},
        {FIELD: b'["an", "array"]'},
        {FIELD: orjson.dumps({"id": "not-a-prompt-of-the-job", "job": "t"})},
        # Well-typed, yet no token id of any vocabulary: building its record raises.
        {FIELD: orjson.dumps(_fields(results[9], output_ids=[10**12, *results[9].output_ids[1:]]))},
        results[2].to_fields(),
        results[3].to_fields(),
        results[4].to_fields(),
    ]
    for fields in entries:
        r.xadd(stream, fields)
    worker = InProcess(r, options(out), "c1")
    with worker:
        wait_for(lambda: settled(r, "t", 6 + 9), timeout=30, what="every entry settled")
        assert worker.thread.is_alive()

    assert sorted(shard_ids(out / "t")) == sorted(res.id for res in [*results[:5], results[8]])
    letters = {letter.entry_id: letter for letter in dlq.entries(r, "t", "tokenize")}
    by_prompt = {
        pid: letters.pop(pid).reason
        for pid in [res.id for res in results[5:]]
        if pid != results[8].id
    }
    assert by_prompt == {
        results[5].id: Reason.RESULT_NOT_JSON,
        results[6].id: Reason.RESULT_MISSING_FIELDS,
        results[7].id: Reason.RESULT_WRONG_TYPE,
        results[9].id: Reason.MALFORMED_RESULT,
    }
    assert all(e.startswith("result:raw-") and not e[11:].count(":") for e in letters)
    reasons = sorted(letter.reason for letter in letters.values())
    assert reasons == sorted([Reason.RESULT_NOT_JSON, Reason.ENTRY_WITHOUT_RESULT,
                              Reason.RESULT_NOT_JSON, Reason.RESULT_NOT_AN_OBJECT,
                              Reason.RESULT_MISSING_FIELDS])  # fmt: skip
    kept = {_raw(letter.payload): letter.payload for letter in letters.values()}
    assert kept[huge[:RAW_LIMIT]]["truncated"] and kept[huge[:RAW_LIMIT]]["raw_bytes"] == len(huge)
    assert b"\xff\x00 not json" in kept
    assert not r.xlen(stream)
    assert r.xpending(stream, keys.TOKENIZE_GROUP)["pending"] == 0

    # Accounting: the prompts whose ids were readable are dead-lettered, the rest are
    # entries without a prompt; `regen verify` finds every enqueued id in one place.
    counts = count_places(r, spec)
    assert counts.done == 6 and counts.dead_lettered == 4 and counts.unplaced == 0
    assert sum(counts.other_dead_letters.values()) == 5
    report = reconcile(r, spec, out / "t")
    assert report.places["done"] == 6 and report.places["dead_lettered"] == 4
    assert report.ok, report.problems


def test_the_field_types_follow_the_result_dataclass() -> None:
    """A field GeneratedResult lets be None is read as None (and one it does not, not):
    the reader and the writer of results cannot drift apart."""
    import dataclasses
    import typing

    from regen.common.results import GeneratedResult
    from regen.consumers.tokenize.entries import FIELD_TYPES

    hints = typing.get_type_hints(GeneratedResult)
    fields = {f.name for f in dataclasses.fields(GeneratedResult)}
    assert set(FIELD_TYPES) == fields
    for name in fields:
        optional = type(None) in typing.get_args(hints[name])
        assert (type(None) in FIELD_TYPES[name]) == optional, name
