"""Throughput and memory of the tokenize stage alone, in one process (not a test).

Feeds realistic results (2K-token completions) onto a job's results stream in a real
Redis and runs one TokenizeConsumer on them: checks, drift check, zstd shards, commits.
Prints records/s and record tokens/s, and the process's memory over the run, with the
drift check on and off side by side.

Target: one process keeps up with 20x the output of an 8-GPU Kimi K2.6 server
(20K output tokens/s), i.e. 400K tokens/s.

    python bench/tokenize_stage.py [--records 6000] [--completion-tokens 2048]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen.common import jobspec, keys
from regen.common.ledger.commit_ledger import CommitLedger
from regen.consumers.tokenize.consumer import TokenizeConsumer, TokenizeOptions
from regen.consumers.tokenize.job_writer import ShardPolicy
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import make_result
from tests.support.redis_server import running_redis

FEED_BATCH = 200
MAX_BACKLOG = 2000


def long_answer(tokens: int, tok: object, seed: int) -> str:
    words = [f"word{(seed * 31 + i) % 997}" for i in range(tokens)]
    text = " ".join(words)
    ids = tok.encode(text, add_special_tokens=False)[:tokens]  # type: ignore[attr-defined]
    return tok.decode(ids)  # type: ignore[attr-defined,no-any-return]


def run(records: int, completion_tokens: int, drift: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp_name, running_redis(Path(tmp_name) / "r") as srv:
        r = redis.Redis.from_url(srv.url)
        prepared = prepare_job(JobOptions(job="bench", model="smollm2", max_new_tokens=4096))
        spec = jobspec.save(r, prepared.spec)
        tok = prepared.tokenizer
        templates = [
            make_result(tok, spec, i, long_answer(completion_tokens, tok, i)) for i in range(20)
        ]
        options = TokenizeOptions(
            out_dir=Path(tmp_name) / "out",
            drift_check=drift,
            min_free_bytes=0,
            block_ms=50,
            policy=ShardPolicy(idle_s=0.5),
        )
        consumer = TokenizeConsumer(r, options, "bench")
        stop = threading.Event()
        thread = threading.Thread(target=consumer.run, args=(stop,))
        process = psutil.Process()
        rss = [process.memory_info().rss]
        started = time.monotonic()
        thread.start()
        for start in range(0, records, FEED_BATCH):
            while r.xlen(keys.results_stream("bench")) > MAX_BACKLOG:
                rss.append(process.memory_info().rss)
                time.sleep(0.05)
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(start + FEED_BATCH, records)):
                result = replace(templates[i % len(templates)], id=f"bench{i:08d}")
                pipe.xadd(keys.results_stream("bench"), result.to_fields())
            pipe.execute()
        ledger = CommitLedger(r, "bench")
        committed, claimed = ledger.count()
        while committed < records or claimed:  # until all are in shards in place
            rss.append(process.memory_info().rss)
            time.sleep(0.05)
            committed, claimed = ledger.count()
        elapsed = time.monotonic() - started
        stop.set()
        thread.join()
        writer = consumer.state.writers["bench"]
        return {
            "records_per_s": records / elapsed,
            "tokens_per_s": writer.counters.tokens / elapsed,
            "rss_start_mb": rss[0] / 2**20,
            "rss_peak_mb": max(rss) / 2**20,
            "rss_end_mb": rss[-1] / 2**20,
            "shards": writer.counters.shards,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=6000)
    parser.add_argument("--completion-tokens", type=int, default=2048)
    args = parser.parse_args()
    print(f"{args.records} records of {args.completion_tokens} completion tokens, one process")
    print("drift check | records/s | tokens/s  | vs 400K target | RSS start/peak/end MB")
    for drift in (True, False):
        m = run(args.records, args.completion_tokens, drift)
        print(
            f"{'on ' if drift else 'off'}         | {m['records_per_s']:9.0f} | "
            f"{m['tokens_per_s']:9.0f} | {m['tokens_per_s'] / 400_000:13.2f}x | "
            f"{m['rss_start_mb']:.0f}/{m['rss_peak_mb']:.0f}/{m['rss_end_mb']:.0f}"
        )


if __name__ == "__main__":
    main()
