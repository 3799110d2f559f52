"""A chunk lost in kombu's window (popped off its queue, never recorded in `unacked`, as
when Redis dies between popping it and answering; found by the chaos harness, single
seed 134): `regen verify` names its prompts missing and says how to fix it, and
`regen recover` plus the job's own enqueue queue exactly them again."""

from __future__ import annotations

import re
from pathlib import Path

import redis
from click.testing import CliRunner, Result

from regen.cli import main
from regen.common import jobspec
from regen.common.queues import queue_lists
from tests.producer.test_enqueue import enqueue, queued_prompts
from tests.support.helpers import decode_message, write_jsonl


def regen(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--redis-url", url])


def test_a_chunk_lost_between_pop_and_unacked_is_queued_again(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    rows = [{"prompt": f"Question {i}: what is {i} times {i}?"} for i in range(6)]
    dataset = write_jsonl(tmp_path / "q.jsonl", rows)
    enqueue(redis_url, [dataset], chunk_size=2)
    before = {p["id"] for p in queued_prompts(r)}
    (queue,) = [name for name in queue_lists(jobspec.load(r, "j").queue) if r.llen(name)]
    popped = decode_message(r.rpop(queue))  # the reply that never reached a worker
    lost = {p["id"] for p in popped["prompts"]}
    assert len(lost) == 2 and lost < before

    found = regen(redis_url, "verify", "--job", "j", "--no-shards")
    assert found.exit_code == 1, found.output
    assert re.search(r"missing +2\n", found.output), found.output
    assert "queued again by the job's `regen enqueue --follow`" in found.output
    assert "by hand: regen recover --job j" in found.output

    (tmp_path / "out" / "j").mkdir(parents=True)  # the tokenize worker's --out
    recovered = regen(redis_url, "recover", "--job", "j", "--out", str(tmp_path / "out"))
    assert recovered.exit_code == 0, recovered.output
    assert "2 id(s) in no place (their chunk lost) taken out of the job's ids" in recovered.output
    again = enqueue(redis_url, [dataset], chunk_size=2)
    assert (again.enqueued, again.duplicates) == (2, 4)
    assert {p["id"] for p in queued_prompts(r)} == before, "each prompt queued once"
    fixed = regen(redis_url, "verify", "--job", "j", "--no-shards")
    assert fixed.exit_code == 0, fixed.output

    # On a healthy job recover takes nothing out.
    healthy = regen(redis_url, "recover", "--job", "j", "--out", str(tmp_path / "out"))
    assert healthy.exit_code == 0 and "in no place" not in healthy.output, healthy.output
