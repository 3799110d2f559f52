"""A generate worker never exits 0 because of a fault (issue #20, bug 5).

After a lost Redis connection Celery closes the consumer's channel; a chunk still running
on a thread then finishes, and its ack or reject runs on that closed channel. kombu failed
there with AttributeError (no connection to build a client from), which Celery took for
an unrecoverable error and stopped the worker, and the worker then exited 0 (Celery's
`app.start` drops the worker's exit code), so a supervisor restarting on failure left it
down.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis
from kombu import Connection, Queue

from regen.common import dlq
from regen.consumers.generate.kombu_screen import screening_transport
from regen.consumers.generate.poison import PoisonFilter
from tests.support.generate_harness import (
    Worker,
    all_generated,
    chunks_held_by,
    enqueue_prompts,
    enqueued_ids,
    result_ids,
)
from tests.support.helpers import wait_for
from tests.support.redis_server import running_redis
from tests.support.sglang_standin.process import REPO_ROOT, run_standin


def test_a_reject_on_a_channel_closed_by_a_lost_connection_is_a_connection_error(
    redis_url: str, r: redis.Redis
) -> None:
    transport = screening_transport(PoisonFilter(r, "w"))
    with Connection(redis_url, transport=transport) as connection:
        channel = connection.channel()
        queue = Queue("q", channel=channel)
        queue.declare()
        connection.Producer(channel).publish({"chunk": 1}, routing_key="q")
        message = queue.get(no_ack=False)
        assert message is not None and r.hlen("unacked") == 1
        # What Celery does on a lost connection, with held chunks left held
        # (chunk_life.LeaseKeepingConsumer): close the channel, restoring nothing.
        channel.do_restore = False
        channel.close()
        # The chunk's reject, as Celery's event loop runs it: kombu's connection errors
        # are logged; anything else stopped the worker (AttributeError before).
        message.reject_log_error(logging.getLogger("test"), connection.connection_errors, True)
    # The delivery stays in kombu's unacked hash, for the restore sweep to bring back.
    assert r.hlen("unacked") == 1 and r.llen("q") == 0


# A worker whose consumer fails at start as any unexpected error would fail it.
FAILING_WORKER = """
import sys
from celery import Celery, bootsteps
from regen.consumers.generate.worker import run_celery_worker

class Broken(bootsteps.StartStopStep):
    def start(self, consumer):
        raise RuntimeError("a fault inside the consumer")

app = Celery("faulty", broker=sys.argv[1])
app.steps["consumer"].add(Broken)
sys.exit(run_celery_worker(app, ["worker", "--pool", "threads", "--concurrency", "1",
                                 "--without-mingle", "--without-gossip", "-Q", "faulty"]))
"""


def test_a_worker_stopped_by_an_unrecoverable_error_exits_non_zero(
    redis_url: str, tmp_path: Path
) -> None:
    script = tmp_path / "faulty_worker.py"
    script.write_text(textwrap.dedent(FAILING_WORKER))
    done = subprocess.run(
        [sys.executable, str(script), redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert "Unrecoverable error: RuntimeError('a fault inside the consumer')" in done.stderr
    assert done.returncode == 1, done.stderr[-2000:]


@pytest.mark.slow
def test_chunks_that_end_while_redis_is_down_stop_no_worker(tmp_path: Path) -> None:
    """Answers of ~3 s, Redis killed while chunks run and kept down past the lease (3 s),
    so their hand-offs give up and the chunks are rejected on the channel the lost
    connection closed. The worker goes on, and every prompt is generated once."""
    prompts = [f"Question {i} about rivers" for i in range(8)]
    with (
        running_redis(tmp_path / "redis") as redis_server,
        run_standin(decode_tokens_per_s=10, output_len_dist="fixed:n=30") as server,
    ):
        r = redis.Redis.from_url(redis_server.url)
        spec = enqueue_prompts(redis_server.url, tmp_path, prompts, chunk_size=2)
        worker = Worker(redis_server.url, tmp_path, "--engine", "sglang", "--server",
                        server.url, "--jobs", "g", "--concurrency", "2",
                        env={"REGEN_VISIBILITY_TIMEOUT": "3"})  # fmt: skip
        with worker:
            wait_for(lambda: bool(chunks_held_by(r, "g", worker.name)), timeout=120,
                     what="a chunk held")  # fmt: skip
            redis_server.kill()  # SIGKILL; restarted on the same AOF and port
            # Past the answers and the lease: the chunks' hand-offs give up meanwhile.
            wait_for(lambda: "Redis unreachable" in worker.log(), timeout=30,
                     what="a hand-off retrying")  # fmt: skip
            wait_for(lambda: "failed; returning it to the queue" in worker.log(), timeout=30,
                     what="a chunk given back while Redis is down")  # fmt: skip
            redis_server.start()
            wait_for(lambda: worker.process.poll() is not None or all_generated(r, spec),
                     timeout=180, what="the job to finish")  # fmt: skip
            assert worker.process.poll() is None, worker.log()[-5000:]
        assert "Couldn't reject" in worker.log() or "Couldn't ack" in worker.log()
        assert "Unrecoverable" not in worker.log()
        assert result_ids(r, "g") == enqueued_ids(r, "g")
        assert dlq.count(r, "g", "generate") == 0
