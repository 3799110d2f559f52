"""Cache-aware turns end to end: a real generate worker runs a `--turns all` job over two
SGLang stand-ins, each with its own prefix cache. Every later turn of a conversation
goes to the server of its earlier turns while that server is up, the prefix-cache hit
rate the worker reports is the servers' own count, and a conversation whose server is
killed goes on on the other one with nothing lost."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner

from regen.cli_status import status
from regen.common import dlq, keys
from regen.common.jobspec import JobSpec
from regen.common.results import GeneratedResult
from regen.consumers.generate.engine import server_rid
from tests.generate.test_turns_stage import ANSWER, enqueue
from tests.ops.test_metrics import scrape, value
from tests.producer.test_turns import conversation_row
from tests.support.generate_harness import Worker, all_generated, results
from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import StandinHandle, free_port, start_standin

pytestmark = pytest.mark.slow

CONVERSATIONS = 8


def rows(turns: int) -> list[dict[str, Any]]:
    """CONVERSATIONS conversations of `turns` turns, each its own (distinct ids)."""
    out = []
    for i in range(CONVERSATIONS):
        users = [{"role": "user", "content": f"Chat {i}, question {k}?"} for k in range(turns)]
        row = conversation_row(*(f"DATASET {i}.{k}" for k in range(turns)), users=users)
        out.append({**row, "id": f"conv-{i}"})
    return out


def two_standins(kimi_dir: Path, **options: Any) -> Iterator[tuple[StandinHandle, StandinHandle]]:
    handles = [
        start_standin(tokenizer=str(kimi_dir), trust_remote_code=True, think=True,
                      output_len_dist=ANSWER, **options)
        for _ in range(2)
    ]  # fmt: skip
    try:
        for handle in handles:
            handle.wait_ready()
        yield handles[0], handles[1]
    finally:
        for handle in handles:
            handle.close()


@pytest.fixture
def standins(kimi_tokenizer_dir: Path) -> Iterator[tuple[StandinHandle, StandinHandle]]:
    yield from two_standins(kimi_tokenizer_dir)


@pytest.fixture
def slow_standins(kimi_tokenizer_dir: Path) -> Iterator[tuple[StandinHandle, StandinHandle]]:
    # ~1 s a turn (60-token answers), so a kill lands between a conversation's turns.
    yield from two_standins(kimi_tokenizer_dir, decode_tokens_per_s=60)


@dataclass
class Setup:
    url: str
    r: redis.Redis
    tmp_path: Path
    kimi_dir: Path

    def enqueue(self, job: str, turns: int) -> JobSpec:
        return enqueue(self.url, self.tmp_path, self.kimi_dir, job, rows=rows(turns)).spec

    def worker(self, *servers: StandinHandle, metrics_port: int) -> Worker:
        server_args = [arg for server in servers for arg in ("--server", server.url)]
        return Worker(self.url, self.tmp_path, "--engine", "sglang", *server_args,
                      "--metrics-port", str(metrics_port),
                      env={"REGEN_HEARTBEAT_STALE_S": "4"})  # a heartbeat a second  # fmt: skip


@pytest.fixture
def setup(redis_url: str, r: redis.Redis, tmp_path: Path, kimi_tokenizer_dir: Path) -> Setup:
    return Setup(redis_url, r, tmp_path, kimi_tokenizer_dir)


def conversations(r: redis.Redis, job: str) -> dict[str, list[GeneratedResult]]:
    """Each conversation's results in turn order."""
    by_conversation: dict[str, list[GeneratedResult]] = defaultdict(list)
    for res in results(r, job):
        assert res.conversation_id is not None
        by_conversation[res.conversation_id].append(res)
    return {
        cid: sorted(turns, key=lambda res: res.turn or 0) for cid, turns in by_conversation.items()
    }


def served_by(*servers: StandinHandle) -> dict[str, str]:
    """rid -> the URL of the stand-in that says it completed it."""
    return {entry["rid"]: server.url for server in servers for entry in server.served()}


def heartbeat_servers(r: redis.Redis, name: str) -> dict[str, dict[str, Any]]:
    raw = r.hget(keys.WORKERS, name)
    beat = orjson.loads(raw) if raw else {}
    return {s["url"]: s for s in (beat.get("engine_stats") or {}).get("servers", [])}


def test_each_conversation_stays_on_one_server_and_its_hit_rate_is_the_servers_count(
    setup: Setup, standins: tuple[StandinHandle, StandinHandle]
) -> None:
    r, turns, port = setup.r, 3, free_port()
    spec = setup.enqueue("a", turns)
    with setup.worker(*standins, metrics_port=port) as generate:
        wait_for(lambda: all_generated(r, spec), timeout=180, what="every turn generated")
        truth = {s.url: s.stats() for s in standins}

        def reported_equals_truth() -> bool:
            beat = heartbeat_servers(r, generate.name)
            return all(
                url in beat
                and (beat[url]["prompt_tokens"], beat[url]["cached_tokens"])
                == (stats["prompt_tokens_total"], stats["cached_tokens_total"])
                for url, stats in truth.items()
            )

        wait_for(reported_equals_truth, timeout=30, what="the heartbeat to count every turn")
        beat = heartbeat_servers(r, generate.name)
        samples = scrape(port)
        shown = CliRunner().invoke(status, ["--redis-url", setup.url])
        witness = served_by(*standins)
    assert dlq.count(r, "a", "generate") == 0
    by_conversation = conversations(r, "a")
    assert len(by_conversation) == CONVERSATIONS
    homes = set()
    for cid, done in by_conversation.items():
        assert [res.turn for res in done] == list(range(turns)), cid
        servers = {res.server for res in done}
        # The servers' own word: each turn's rid was completed where the result says.
        sent = (server_rid(f"{res.chunk}-{res.id}-{res.attempt}") for res in done)
        assert servers == {witness[rid] for rid in sent}
        assert len(servers) == 1, f"conversation {cid} went to {servers}"
        homes |= servers
        for earlier, later in pairwise(done):
            # Its whole earlier prompt was still cached there (bar the last token, which
            # SGLang always computes).
            assert later.cached_tokens is not None
            assert later.cached_tokens >= len(earlier.prompt_ids) - 1, cid
    assert homes == {s.url for s in standins}, "first turns spread by load over both servers"

    for url, stats in truth.items():
        cached, prompt = stats["cached_tokens_total"], stats["prompt_tokens_total"]
        assert cached > 0
        assert beat[url]["cache_hit_rate"] == pytest.approx(cached / prompt)
        assert value(samples, "regen_sglang_server_cached_tokens_total", server=url) == cached
        assert value(samples, "regen_sglang_server_prompt_tokens_total", server=url) == prompt
        assert value(samples, "regen_sglang_server_cache_hit_rate", server=url) == pytest.approx(
            cached / prompt
        )
        assert f"cache {cached / prompt:.0%}" in shown.output, shown.output
    later_turns = CONVERSATIONS * (turns - 1)
    assert value(samples, "regen_sglang_affinity_requests_total", outcome="kept") == later_turns
    assert value(samples, "regen_sglang_affinity_requests_total", outcome="moved") == 0


def test_a_conversation_whose_server_dies_goes_on_on_the_other_with_nothing_lost(
    setup: Setup, slow_standins: tuple[StandinHandle, StandinHandle]
) -> None:
    r, turns = setup.r, 4
    spec = setup.enqueue("b", turns)
    survivor, doomed = slow_standins
    with setup.worker(survivor, doomed, metrics_port=free_port()):
        # Every first turn is back: each conversation has its server and turns to go.
        wait_for(lambda: len(results(r, "b")) >= CONVERSATIONS, timeout=180,
                 what="the first turns")  # fmt: skip
        doomed.kill()
        wait_for(lambda: all_generated(r, spec), timeout=240, what="every turn generated")
    assert dlq.count(r, "b", "generate") == 0
    by_conversation = conversations(r, "b")
    assert sum(map(len, by_conversation.values())) == CONVERSATIONS * turns == len(results(r, "b"))
    moved = 0
    for cid, done in by_conversation.items():
        assert [res.turn for res in done] == list(range(turns)), cid
        servers = [res.server for res in done]
        # The doomed server's turns, if any, come first; once it died, the conversation
        # went on on the survivor and stayed there.
        first_on_survivor = servers.index(survivor.url) if survivor.url in servers else turns
        assert servers[first_on_survivor:] == [survivor.url] * (turns - first_on_survivor), cid
        moved += 0 < first_on_survivor < turns
    assert moved > 0, "no conversation was on the killed server between its turns"
