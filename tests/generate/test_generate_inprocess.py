"""The generate stage with `--engine sglang-engine`: real Celery workers whose in-process
engine is the offline `sglang.Engine` stand-in (put on their PYTHONPATH as `sglang`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from regen.common import dlq, keys
from tests.support.generate_harness import (
    PROMPTS,
    REPO,
    Worker,
    all_acked,
    all_generated,
    deaths_until_dead_lettered,
    enqueue_prompts,
    result_ids,
    results,
)
from tests.support.helpers import wait_for
from tests.support.sglang_standin.completer import Completer, load_tokenizer
from tests.support.sglang_standin.config import LengthDist
from tests.support.sglang_standin.offline_engine import CONFIG_ENV

pytestmark = pytest.mark.slow

SHORT = "lognormal:mean=30,sigma=0.5,min=2,max=200"


def standin_env(**knobs: Any) -> dict[str, str]:
    offline = REPO / "tests" / "support" / "sglang_standin" / "offline"
    return {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(offline)]),
        CONFIG_ENV: orjson.dumps({"output_len_dist": SHORT, **knobs}).decode(),
    }


def in_process_worker(url: str, tmp_path: Path, *args: str, **knobs: Any) -> Worker:
    return Worker(
        url, tmp_path, "--engine", "sglang-engine", "--jobs", "g", *args, env=standin_env(**knobs)
    )


def test_results_rejections_and_faults_end_to_end(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    long_prompt = "Please repeat: " + "words " * 400
    spec = enqueue_prompts(redis_url, tmp_path, [*PROMPTS, long_prompt])
    sglang_args = orjson.dumps({"context_length": 300}).decode()
    worker = in_process_worker(
        redis_url, tmp_path, "--sglang-args", sglang_args, fault=["503:3", "500:2"]
    )
    with worker:
        wait_for(
            lambda: all_acked(r, spec) and len(result_ids(r, "g")) == len(PROMPTS),
            timeout=180,
            what="every chunk done",
        )
        beats = [orjson.loads(v) for v in r.hgetall(keys.WORKERS).values()]
    assert worker.process.returncode == 0, worker.log()  # a warm shutdown closes the engine
    log = worker.log()
    assert "sglang-standin: shutdown" in log
    assert log.count("sglang-standin: fault 503") == 3
    assert log.count("sglang-standin: fault 500") == 2

    completer = Completer(
        load_tokenizer(), LengthDist.parse(SHORT), eos_id=None, think=False, seed=0
    )
    got = results(r, "g")
    assert len(got) == len(PROMPTS)
    for result in got:
        want = completer.complete(result.prompt_ids, spec.sampling)
        assert result.output_ids == want.output_ids
        assert result.text == want.text
        assert result.finish_reason == want.finish_reason
        assert result.server == "sglang-engine:smollm2"
    (letter,) = list(dlq.entries(r, "g", "generate"))
    assert letter.reason == "rejected_by_server"
    assert "longer than the model's context length (300 tokens)" in letter.message
    assert letter.payload["messages"][-1]["content"] == long_prompt  # as written
    assert any(b.get("engine_stats", {}).get("engine") == "sglang-engine" for b in beats)


def test_a_prompt_that_crashes_the_engine_is_dead_lettered_after_max_attempts(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    spec = enqueue_prompts(
        redis_url, tmp_path, ["POISON: this prompt kills the engine"], chunk_size=1
    )
    deaths = deaths_until_dead_lettered(
        r,
        "g",
        lambda: in_process_worker(redis_url, tmp_path, "--max-attempts", "3", poison="POISON"),
    )
    (letter,) = list(dlq.entries(r, "g", "generate"))
    assert letter.reason == "poison_chunk"
    assert deaths == 3 and len(letter.history) == 4
    wait_for(lambda: all_acked(r, spec), timeout=30, what="the poison chunk to be acked")
    assert not all_generated(r, spec)  # its prompt has no result, only the dead letter
