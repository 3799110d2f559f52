"""A tokenize worker whose results group vanishes under it (Redis restored from a copy
without it, a promoted replica, the stream deleted) creates the group again and goes on
in the same process: no supervisor needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from regen.common import jobspec, keys
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import committed_count, make_result, wait_for
from tests.support.redis_server import running_redis
from tests.support.tokenize_harness import push
from tests.tokenize.test_redis_restore import TokenizeWorker

JOB = "ng"


def consumers_of(r: redis.Redis, stream: str) -> list[Any]:
    try:
        return list(r.xinfo_consumers(stream, keys.TOKENIZE_GROUP))
    except redis.ResponseError:  # no group (yet)
        return []


def test_a_lost_group_is_created_again_by_the_running_worker(
    tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    with running_redis(tmp_path / "redis") as server:
        r = redis.Redis.from_url(server.url)
        spec = prepare_job(JobOptions(job=JOB, model="smollm2", max_new_tokens=64)).spec
        jobspec.save(r, spec)
        results = [make_result(smollm2_tokenizer, spec, i) for i in range(24)]
        stream = keys.results_stream(JOB)
        worker = TokenizeWorker(server.url, tmp_path / "out", tmp_path / "tokenize.log")
        try:
            push(r, results[:8])
            wait_for(lambda: committed_count(r, JOB) == 8 and not r.xlen(stream),
                     timeout=120, what="the first 8 committed")  # fmt: skip
            # The worker waits in XREADGROUP on the group it created; then the group goes.
            wait_for(lambda: consumers_of(r, stream), what="the worker in the group")
            r.delete(stream)
            push(r, results[8:16])  # new results on a stream with no group

            def committed_by_the_same_process(n: int) -> bool:
                assert worker.process.poll() is None, f"the worker exited:\n{worker.text()}"
                return committed_count(r, JOB) == n and not r.xlen(stream)

            wait_for(lambda: committed_by_the_same_process(16), timeout=120,
                     what="the new results committed")  # fmt: skip
            # The group alone goes (the stream stays): NOGROUP.
            wait_for(lambda: consumers_of(r, stream), what="the worker in the new group")
            push(r, results[16:20])
            r.xgroup_destroy(stream, keys.TOKENIZE_GROUP)
            push(r, results[20:])
            wait_for(lambda: committed_by_the_same_process(24), timeout=120,
                     what="the results after NOGROUP committed")  # fmt: skip
            assert "creating it again" in worker.text()
            assert "NOGROUP" in worker.text()
        finally:
            worker.stop()
        assert worker.process.returncode == 0, worker.text()
