"""Redis bytes per prompt after a job completes, and the run's prompts/s (not a test).

Enqueues N prompts and completes them against a zero-latency path, in one process: the
stages are driven in-process, but every Redis write is the real one. Chunks go out
through the producer's publish script (ChunkPublisher); each is delivered as kombu does
(popped off its queue into `unacked`), its attempt started and its results handed off
under its lease (LeaseBook, one hand-off MULTI per chunk holding each prompt's XADD and
`generated` mark), and it is acked by the lease's `finish`; the results are read off the
stream by the tokenize group and committed through the real CommitLedger (claim, then
finalize) in tiny shards (no files are written: only the Redis side is measured).

Prints used_memory after minus before divided by N, and the bytes of each key family.

    python bench/redis_footprint.py [--prompts 1000000] [--chunk-size 64] [--held N]

`--held 34` gives back what a worker with 32 free slots (and its slack) cannot start
of every 64-prompt chunk, the worst case of "Only what can start soon" (docs/design/placement.md).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.common import jobspec, keys
from regen.common.celery_app import make_app
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.chunk_message import ChunkMessages
from regen.common.jobspec import JobSpec
from regen.common.ledger import id_buckets
from regen.common.ledger.commit_ledger import CommitLedger
from regen.common.ledger.shard_names import shard_name
from regen.common.results import GeneratedResult
from regen.consumers.generate.chunk_life import LeaseBook, give_back_unstarted, mark_generated
from regen.consumers.tokenize.shard_files import ShardInfo
from regen.producer.publish import ChunkPublisher
from tests.support.redis_server import running_redis

JOB = "bench"
WORKER = "bench-worker"
SHARD_ROWS = 1000  # tiny shards: the per-shard keys count as much as they can
# A per-key family: the job's key with chunk ids, bucket numbers and shard names folded.
_FOLD = re.compile(r"(?<=:)(c[0-9a-f]{16}|[0-9]+)(?=:|$)")


def make_spec(prompts: int, chunk_size: int) -> JobSpec:
    return JobSpec(
        name=JOB,
        model="bench",
        tokenizer="bench",
        trust_remote_code=False,
        chat_family="chatml",
        tokenizer_fingerprint="0" * 16,
        sampling={"max_new_tokens": 16},
        chat_template_kwargs={},
        system_prompt=None,
        chunk_size=chunk_size,
        max_prompt_tokens=None,
        context_length=None,
        queue=keys.generate_queue(JOB),
        id_buckets=id_buckets.bucket_count(prompts),
    )


def prompt_id(i: int) -> str:
    """Ids as the producer makes them: 16 hex digits of a blake2b digest."""
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=8).hexdigest()


def publish(publisher: ChunkPublisher, first: int, size: int) -> None:
    prompts = [
        ChunkPrompt(
            id=prompt_id(i),
            prompt_ids=[1, 2, 3],
            messages=[{"role": "user", "content": f"q{i}"}],
            source={"file": "bench.jsonl", "row": i, "id": None},
        )
        for i in range(first, first + size)
    ]
    ids = [p.id for p in prompts]
    chunk = Chunk(JOB, Chunk.make_id(JOB, ids), prompts)
    outcome = publisher.publish(chunk.chunk_id, chunk.to_payload(), ids, {"bench": first + size})
    assert outcome.published, outcome


def deliver(r: redis.Redis, queue: str) -> tuple[Chunk, str]:
    """kombu's delivery: the message leaves the queue for `unacked` and its index."""
    raw = r.rpop(queue)
    assert raw is not None, "the queue ran dry"
    message = orjson.loads(raw)
    tag = message["properties"]["delivery_tag"]
    info = message["properties"]["delivery_info"]
    pipe = r.pipeline()
    pipe.hset(
        keys.KOMBU_UNACKED, tag, orjson.dumps([message, info["exchange"], info["routing_key"]])
    )
    pipe.zadd(keys.KOMBU_UNACKED_INDEX, {tag: time.time()})
    pipe.execute()
    body = orjson.loads(base64.b64decode(message["body"]))
    return Chunk.from_payload(body[0][0]), tag


def generate(
    r: redis.Redis,
    book: LeaseBook,
    chunk: Chunk,
    tag: str,
    held: int | None,
    messages: ChunkMessages,
) -> None:
    """Every prompt handed off under the chunk's lease, then the chunk acked. With
    `held`, a delivery of a larger chunk first gives the rest back to the queue, as a
    worker with that many free slots does (chunk_life/unstarted.py)."""
    lease, _ = book.start(JOB, chunk.chunk_id, tag, WORKER)
    if held is not None and len(chunk.prompts) > held:
        queue = keys.generate_queue(JOB)
        give_back_unstarted(r, messages, queue, lease, chunk, chunk.prompts[held:])
        chunk = Chunk(chunk.job, chunk.chunk_id, chunk.prompts[:held], chunk.sampling)
    fields = [
        GeneratedResult(
            id=p.id, job=JOB, chunk=chunk.chunk_id, prompt_ids=p.prompt_ids,
            messages=p.messages, source=p.source, output_ids=[7, 8], text="ok",
            finish_reason={"type": "stop"}, prompt_tokens=3, completion_tokens=2,
            cached_tokens=0, latency_s=0.0, server="zero-latency", worker=WORKER,
            attempt=lease.attempt,
        ).to_fields()
        for p in chunk.prompts
    ]  # fmt: skip

    def fill(pipe: redis.client.Pipeline) -> None:
        for prompt, entry in zip(chunk.prompts, fields, strict=True):
            pipe.xadd(keys.results_stream(JOB), entry)  # type: ignore[arg-type]
            mark_generated(pipe, chunk, prompt.id)

    lease.write(r, fill)
    lease.finish(r, WORKER)
    book.release(lease)


def commit(r: redis.Redis, ledger: CommitLedger, backlog: int) -> int:
    """Read up to SHARD_ROWS results as the tokenize group and commit them as one shard;
    returns how many were committed."""
    reply = r.xreadgroup(
        keys.TOKENIZE_GROUP, WORKER, {keys.results_stream(JOB): ">"}, count=min(SHARD_ROWS, backlog)
    )
    entries = reply[0][1] if reply else []
    if not entries:
        return 0
    entry_ids = [e[0].decode() for e in entries]
    ids = [orjson.loads(e[1][b"r"])["id"] for e in entries]
    shard = shard_name(ledger.next_shard_seq())
    taken, _ = ledger.claim(shard, WORKER, ids)
    assert not taken, taken
    info = ShardInfo(shard, len(ids), 3 * len(ids), 2 * len(ids), 100 * len(ids), 40 * len(ids),
                     "0" * 64, time.time(), ledger.epoch())  # fmt: skip
    assert ledger.finalize(shard, info.to_json(), entry_ids, ids)
    return len(ids)


def key_families(r: redis.Redis) -> Counter[str]:
    """Bytes of every key but the spec, by family (MEMORY USAGE, every element counted)."""
    families: Counter[str] = Counter()
    for key in r.scan_iter(count=1000):
        name = key.decode()
        if name == keys.job_spec(JOB):
            continue
        families[_FOLD.sub("N", name)] += int(r.memory_usage(key, samples=0) or 0)
    return families


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def run(prompts: int, chunk_size: int, held: int | None = None) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_redis(Path(tmp) / "redis", "--appendonly", "no") as server,
    ):
        r = redis.Redis.from_url(server.url)
        spec = jobspec.save(r, make_spec(prompts, chunk_size))
        r.xgroup_create(keys.results_stream(JOB), keys.TOKENIZE_GROUP, id="0", mkstream=True)
        ledger = CommitLedger(r, JOB)
        ledger.start_epoch()
        publisher = ChunkPublisher(make_app(server.url), r, spec)
        messages = ChunkMessages(make_app(server.url))
        book = LeaseBook(r)
        before = used_memory(r)
        started = time.monotonic()
        committed = 0
        for first in range(0, prompts, chunk_size):
            publish(publisher, first, min(chunk_size, prompts - first))
            while r.llen(keys.generate_queue(JOB)):  # the chunk, and what it gave back
                generate(r, book, *deliver(r, keys.generate_queue(JOB)), held, messages)
            backlog = first + chunk_size - committed
            if backlog >= SHARD_ROWS:
                committed += commit(r, ledger, backlog)
        while committed < prompts:
            committed += commit(r, ledger, prompts - committed)
        elapsed = time.monotonic() - started
        publisher.close()
        messages.close()
        assert ledger.count() == (prompts, 0)
        after = used_memory(r)
        return {"bytes": after - before, "seconds": elapsed, "families": key_families(r)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument(
        "--held", type=int, help="each delivery holds this many, gives back the rest"
    )
    args = parser.parse_args()
    m = run(args.prompts, args.chunk_size, args.held)
    n = args.prompts
    held = f", each delivery holding {args.held}" if args.held else ""
    print(f"{n:,} prompts in chunks of {args.chunk_size}{held}, shards of {SHARD_ROWS}")
    print(f"used_memory after - before: {m['bytes'] / n:.1f} bytes per prompt (target <= 100)")
    print(f"prompts/s, enqueue to committed, one process: {n / m['seconds']:,.0f}")
    print("key family                                  bytes/prompt")
    for family, size in m["families"].most_common():
        print(f"{family:<43} {size / n:12.2f}")


if __name__ == "__main__":
    main()
