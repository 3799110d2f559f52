"""Poison messages and health-gated consumption: real generate workers against a real Redis.

A message on a generate queue that is not a chunk for that queue must end in the job's
generate DLQ, raw and with a reason, and the worker must go on; a worker whose engine has
not passed a health check must hold no chunk.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from click.testing import CliRunner, Result

from regen.cli_dlq import dlq_group
from regen.common import dlq, keys
from regen.common.celery_app import CHUNK_CONTENT_TYPE, GENERATE_TASK, make_app
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.ledger.places import count_places
from regen.consumers.generate import poison
from tests.support.generate_harness import PROMPTS, Worker, all_generated, enqueue_prompts
from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import (
    StandinHandle,
    free_port,
    run_standin,
    start_standin,
)


def push_poison(url: str, r: redis.Redis, queue: str, other_queue: str) -> dict[str, str]:
    """Push one message of each poison shape onto `queue`; entry id -> expected reason."""
    r.rpush(queue, b"not json {")
    r.rpush(queue, b'{"hello": "world"}')
    app = make_app(url)
    app.send_task(GENERATE_TASK, args=[{"job": "g", "chunk": "c0"}], queue=queue, task_id="half")
    app.send_task("regen.no_such_task", args=[1], queue=queue, task_id="stranger")
    # A real chunk of another job (copied off its own queue, which no worker here serves).
    other_chunk = r.lindex(other_queue, 0)
    assert other_chunk is not None
    r.rpush(queue, other_chunk)
    other_id = orjson.loads(other_chunk)["headers"]["id"]
    return {
        "half": "malformed_chunk",
        "stranger": "unknown_task",
        other_id: "wrong_queue",
        "not json {": "not_json",
        '{"hello": "world"}': "not_a_task_message",
    }


def republish_as_kombu_json(url: str, r: redis.Redis, queue: str) -> None:
    """Put a chunk of `queue` back as kombu's "application/json" message."""
    raw = r.rpop(queue)
    assert isinstance(raw, bytes)
    envelope = orjson.loads(raw)
    assert envelope["content-type"] == CHUNK_CONTENT_TYPE
    args, _kwargs, _embed = orjson.loads(base64.b64decode(envelope["body"]))
    make_app(url).send_task(
        GENERATE_TASK, args=args, queue=queue, task_id=envelope["headers"]["id"], serializer="json"
    )


@pytest.mark.slow
def test_garbage_on_the_queue_is_dead_lettered_and_the_worker_finishes_the_job(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS)
    republish_as_kombu_json(redis_url, r, spec.queue)  # as earlier versions enqueued it
    other = enqueue_prompts(redis_url, tmp_path, PROMPTS[:2], job="h")
    expected = push_poison(redis_url, r, spec.queue, other.queue)
    with (
        run_standin() as server,
        Worker(redis_url, tmp_path, "--engine", "sglang", "--server", server.url, "--jobs", "g")
        as worker,
    ):  # fmt: skip

        def settled() -> bool:
            assert worker.process.poll() is None, f"the worker stopped:\n{worker.log()[-3000:]}"
            return all_generated(r, spec) and dlq.count(r, "g", "generate") == len(expected)

        wait_for(settled, timeout=180, what="the job generated and the poison dead-lettered")
    letters = list(dlq.entries(r, "g", "generate"))
    by_key = {_key(letter): letter for letter in letters}
    assert {key: letter.reason for key, letter in by_key.items()} == expected
    for letter in letters:
        assert letter.prompt_id is None and letter.entry_id.startswith("task:")
        assert letter.payload["queue"] == spec.queue and letter.payload["raw"]
    assert r.llen(other.queue) == 1, "the other job's own chunk is untouched"
    counts = count_places(r, spec)
    assert counts.unplaced == 0 and counts.dead_lettered == 0 and counts.done == 0
    assert sum(counts.other_dead_letters.values()) == len(expected)


def _key(letter: dlq.DeadLetter) -> str:
    """A dead letter's task id, or its raw text for a message that has none."""
    task_id = letter.entry_id.removeprefix("task:")
    return letter.payload["raw"] if task_id.startswith("raw-") else task_id


@pytest.mark.slow
def test_a_worker_with_a_dead_server_holds_no_chunk_until_a_live_one_is_there(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS)
    queued = r.llen(spec.queue)
    port = free_port()
    # (queue length, kombu's unacked messages), each taken while the server was down.
    looks: list[tuple[int, int]] = []

    def down_after_look(server: StandinHandle | None = None) -> bool:
        look = (r.llen(spec.queue), r.hlen(keys.KOMBU_UNACKED))
        if server is not None and server_is_up(server):
            return False
        looks.append(look)  # the server was down after this look, so also during it
        return True

    dead = f"http://127.0.0.1:{port}"
    args = ("--engine", "sglang", "--server", dead, "--jobs", "g")
    with Worker(redis_url, tmp_path, *args) as worker:
        # Consuming as far as Celery is concerned, and told its engine is down (today's
        # worker took a chunk at start, before its first health check).
        wait_for(
            lambda: down_after_look() and "ready." in worker.log() and "UNHEALTHY" in worker.log(),
            timeout=120,
            what="the worker to start and find its server down",
        )
        server = start_standin(port=port)
        try:
            # A stand-in takes seconds to serve: the worker keeps looking at a dead server.
            wait_for(lambda: not down_after_look(server), timeout=120, what="the server up")
            assert set(looks) == {(queued, 0)}, (
                f"chunks held with the server down: {sorted(set(looks))}"
            )
            wait_for(lambda: all_generated(r, spec), timeout=180, what="the job once served")
        finally:
            server.close()
        assert worker.process.poll() is None


def server_is_up(server: StandinHandle) -> bool:
    try:
        return server.get("/health").status_code == 200
    except httpx.TransportError:
        return False


# --- the filter itself, without a worker ------------------------------------------------


def chunk_message(
    r: redis.Redis, url: str, queue: str, payload: object, serializer: str | None = None
) -> bytes:
    """A message exactly as Celery and kombu put it on a queue (taken back off it)."""
    make_app(url).send_task(
        GENERATE_TASK, args=[payload], queue=queue, task_id="t1", serializer=serializer
    )
    raw = r.rpop(queue)
    assert isinstance(raw, bytes)
    return raw


def reshaped(raw: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    envelope = orjson.loads(raw)
    change(envelope)
    return orjson.dumps(envelope)


def test_the_filter_passes_chunks_and_names_what_is_wrong_with_the_rest(
    redis_url: str, r: redis.Redis
) -> None:
    queue = keys.generate_queue("g")
    chunk = Chunk("g", "c1", [ChunkPrompt("p1", [1, 2, 3], [{"role": "user"}], {})])
    good = chunk_message(r, redis_url, queue, chunk.to_payload())
    queue_of = {"g": queue, "h": keys.generate_queue("h")}.get
    bad_ids = {**chunk.to_payload(), "prompts": [{**asdict(chunk.prompts[0]), "prompt_ids": "x"}]}
    shapes = {
        b"\xff\xfe binary": "not_json",
        b"[1, 2": "not_json",
        b"[1, 2]": "not_a_task_message",
        reshaped(good, lambda m: m.update(body="%%% not base64")): "not_a_task_message",
        reshaped(good, lambda m: m.update({"content-type": "application/x-python-serialize"})):
            "not_a_task_message",
        reshaped(good, lambda m: m["headers"].update(eta="not a date")): "not_a_task_message",
        reshaped(good, lambda m: m["properties"].pop("delivery_info")): "not_a_task_message",
        reshaped(good, lambda m: m["headers"].update(task="celery.ping")): "unknown_task",
        chunk_message(r, redis_url, queue, {"job": 7, "chunk": "c", "prompts": []}):
            "malformed_chunk",
        chunk_message(r, redis_url, queue, bad_ids): "malformed_chunk",
        chunk_message(r, redis_url, queue, [chunk.to_payload()]): "malformed_chunk",
        chunk_message(r, redis_url, queue, {**chunk.to_payload(), "job": "h"}): "wrong_queue",
        chunk_message(r, redis_url, queue, {**chunk.to_payload(), "job": "gone"}): "wrong_queue",
    }  # fmt: skip
    assert poison.inspect(good, queue, queue_of) is None
    verdicts = {raw: poison.inspect(raw, queue, queue_of) for raw in shapes}
    assert {raw: v.reason if v else None for raw, v in verdicts.items()} == shapes
    # Past the envelope, the task id names the entry.
    task_ids = {v.task_id for v in verdicts.values() if v and not v.reason.startswith("not_")}
    assert task_ids == {"t1"}


def test_the_screen_judges_json_beyond_the_standard_as_kombu_does(
    redis_url: str, r: redis.Redis
) -> None:
    """The screen decodes with orjson, which refuses NaN and reads an integer past 64
    bits as a float; kombu's json module reads both, so kombu's verdict stands for a
    message in kombu's JSON. regen's own content type is read with orjson, as Celery
    reads it."""
    queue = keys.generate_queue("g")
    prompt = ChunkPrompt("p1", [1, 2**70], [{"role": "user"}], {})
    payload = {**Chunk("g", "c1", [prompt]).to_payload(), "sampling": {"x": float("nan")}}
    queue_of = {"g": queue}.get
    legacy = chunk_message(r, redis_url, queue, payload, serializer="json")
    assert orjson.loads(legacy)["content-type"] == "application/json"
    assert poison.inspect(legacy, queue, queue_of) is None
    # An object kombu's hook cannot turn into a value fails kombu's decoding: poison.
    typed = {"__type__": "no-such-type", "__value__": 1}
    bad = Chunk("g", "c1", [ChunkPrompt("p1", [1], [typed], {})]).to_payload()
    verdict = poison.inspect(chunk_message(r, redis_url, queue, bad, "json"), queue, queue_of)
    assert verdict is not None and verdict.reason == "not_a_task_message"
    # The same NaN in regen's own content type: orjson, which Celery decodes it with,
    # refuses it, so it is poison there.
    plain = Chunk("g", "c1", [ChunkPrompt("p1", [1], [{"role": "user"}], {})]).to_payload()
    ours = chunk_message(r, redis_url, queue, plain)
    assert orjson.loads(ours)["content-type"] == CHUNK_CONTENT_TYPE
    assert poison.inspect(ours, queue, queue_of) is None
    nan_body = base64.b64encode(b'[[{"job": NaN}], {}, {}]').decode()
    verdict = poison.inspect(reshaped(ours, lambda m: m.update(body=nan_body)), queue, queue_of)
    assert verdict is not None and verdict.reason == "not_a_task_message"


def test_a_poison_message_is_dead_lettered_once_raw_and_bounded(r: redis.Redis) -> None:
    screen = poison.PoisonFilter(r, "gpu-host:1")
    queue = keys.generate_queue("g")
    big = b"\x00garbage" * 100_000
    for _ in range(2):  # the same message twice: one entry
        assert not screen.admit(queue, big)
        assert not screen.admit(queue, b"not json {")
    letters = {letter.payload["raw"][:8]: letter for letter in dlq.entries(r, "g", "generate")}
    assert len(letters) == 2
    small = letters["not json"]
    assert small.payload == {
        "queue": queue, "raw": "not json {", "encoding": "utf-8", "raw_bytes": 10,
        "truncated": False,
    }  # fmt: skip
    large = next(letter for key, letter in letters.items() if key != "not json")
    assert large.payload["truncated"] and large.payload["raw_bytes"] == len(big)
    assert len(large.payload["raw"]) == poison.RAW_LIMIT


def test_requeue_refuses_poison_and_purge_removes_it(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(redis_url, tmp_path, PROMPTS[:4])
    screen = poison.PoisonFilter(r, "gpu-host:1")
    assert not screen.admit(spec.queue, b"not json {")
    listed = cli(redis_url, "list", "--job", "g", "--stage", "generate")
    assert "not_json" in listed.output and "1 entries" in listed.output
    requeued = cli(redis_url, "requeue", "--all", "--job", "g")
    assert "no prompt to requeue" in requeued.output and requeued.exit_code == 0
    assert dlq.count(r, "g", "generate") == 1
    counts = count_places(r, spec)
    assert counts.unplaced == 0 and counts.other_dead_letters == {"not_json": 1}
    assert cli(redis_url, "purge", "--all", "--job", "g", "--yes").exit_code == 0
    assert dlq.count(r, "g", "generate") == 0
    assert count_places(r, spec).unplaced == 0


def cli(url: str, *args: str) -> Result:
    return CliRunner().invoke(dlq_group, [*args, "--redis-url", url], catch_exceptions=False)
