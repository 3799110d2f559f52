"""The producer queues each window's longest dataset answers first (producer/
longest_first.py), reading the answer where each row shape keeps it (producer/
answer_length.py), and a Redis rollback in the middle of a window is still seen."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import jobspec
from regen.producer.answer_length import dataset_answer_chars
from tests.producer.test_enqueue import enqueue, queued_prompts
from tests.producer.test_producer_rollback import RollbackDuringPublish
from tests.support.helpers import job_ids, queued_chunks, write_jsonl


def chat(question: str, answer: str | None) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


@pytest.mark.parametrize(
    ("row", "every_turn", "chars"),
    [
        (chat("q", "x" * 7), False, 7),
        (chat("q", None), False, None),
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "bb"},
                            {"from": "human", "value": "c"}, {"from": "gpt", "value": "ddd"}]},
         False, 3),  # --turns last: the trailing answer only
        ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "bb"},
                            {"from": "human", "value": "c"}, {"from": "gpt", "value": "ddd"}]},
         True, 5),  # --turns all: every answer it regenerates
        ({"messages": [{"role": "user", "content": "q"},
                       {"role": "assistant", "content": [{"type": "text", "text": "four"}]}]},
         False, 4),
        ({"instruction": "Translate", "input": "hi", "output": "hallo"}, False, 5),
        ({"prompt": "Why?", "response": "Because."}, False, 8),
        ({"question": "Why?"}, False, None),
        (["not", "a", "row"], False, None),
    ],
)  # fmt: skip
def test_the_dataset_answer_is_read_where_each_shape_keeps_it(
    row: object, every_turn: bool, chars: int | None
) -> None:
    assert dataset_answer_chars(row, every_turn=every_turn) == chars


def chunk_questions(r: redis.Redis) -> list[list[str]]:
    """The questions of each queued chunk, in the order workers take them."""
    spec = jobspec.load(r, "j")
    return [[p["messages"][-1]["content"] for p in chunk["prompts"]]
            for chunk in queued_chunks(r, spec.queue)]  # fmt: skip


def test_the_first_chunk_goes_at_once_and_the_rest_longest_answer_first(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    # Answer lengths that the file's order does not sort: 3, 10, 1, 8, ... chars.
    lengths = [(i * 7) % 11 + 1 for i in range(12)]
    rows = [chat(f"Question {i}", "x" * n) for i, n in enumerate(lengths)]
    rows.append(chat("Question without an answer", None))  # counts as a median one
    path = write_jsonl(tmp_path / "d.jsonl", rows)

    enqueue(redis_url, [path], chunk_size=3)

    chunks = chunk_questions(r)
    # The first window is one chunk, published at once: the file's first rows.
    assert sorted(chunks[0]) == ["Question 0", "Question 1", "Question 2"]
    rest = [q for chunk in chunks[1:] for q in chunk]
    by_length = {f"Question {i}": n for i, n in enumerate(lengths)}
    median = sorted(lengths[3:])[len(lengths[3:]) // 2 - 1 : len(lengths[3:]) // 2 + 1]
    by_length["Question without an answer"] = sum(median) / 2
    assert [by_length[q] for q in rest] == sorted((by_length[q] for q in rest), reverse=True)
    assert all(len(chunk) == 3 for chunk in chunks[:-1])


def test_order_window_zero_keeps_the_files_order(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    rows = [chat(f"Question {i}", "x" * (i % 5 + 1)) for i in range(9)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)

    enqueue(redis_url, [path], chunk_size=3, order_window=0)

    questions = [q for chunk in chunk_questions(r) for q in chunk]
    assert questions == [f"Question {i}" for i in range(9)]


def test_a_rollback_inside_a_window_is_seen_and_its_chunks_published_again(
    redis_url: str, r: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 2nd to 5th chunks are one window: the cursor moves with the 5th only. Redis
    copied after the 2nd and restored after the 3rd loses the 3rd, with the cursor
    where it was; the producer sees its 3rd chunk gone when it publishes the 4th."""
    rows = [chat(f"Question {i}", "x" * (i % 4 + 1)) for i in range(15)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    RollbackDuringPublish(r, monkeypatch, copy_after=2, restore_after=3)
    enqueue(redis_url, [path], chunk_size=3)
    queued = [prompt["id"] for prompt in queued_prompts(r)]
    assert len(queued) == 15 == len(set(queued)), "every prompt queued, once"
    assert job_ids(r, "j") == set(queued)
