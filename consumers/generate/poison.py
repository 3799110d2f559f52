"""Poison messages: what on a generate queue is not a chunk for that queue.

A generate queue is a Redis list anyone with the Redis URL can push to. kombu pops a
message (BRPOP) and decodes it on the worker's consumer loop, before Celery or regen see
it: a message that is not JSON, or not a kombu envelope, raises there and stops the
worker, and the message, already popped, is gone. Celery drops more shapes on its own
way (an unknown task, a body it cannot decode, a bad ETA: logged, then acked or
rejected). So every message is inspected here as raw bytes, against the queue it came
from, before kombu decodes it (`kombu_screen.py` wires this in); one that fails is moved to the
generate DLQ of the job its queue serves, with a reason, and never delivered.

Not to be confused with a poison *chunk* (`poison_chunk`, chunk_runner.py): a valid
chunk whose prompts kill each worker that runs them.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import redis
from kombu.utils.json import loads as kombu_loads

from regen.common import dlq, jobspec, keys
from regen.common.celery_app import CHUNK_CONTENT_TYPE, GENERATE_TASK
from regen.common.chunk import Chunk
from regen.consumers.generate.reasons import Reason

log = logging.getLogger("regen.generate")

# Bytes of a poison message kept in its dead letter: enough to see what it was, while a
# flood of large messages cannot fill Redis with copies.
RAW_LIMIT = 64 * 1024
# A longer task id (Celery's are 36 characters, regen's chunk ids 17) is not used as an
# entry id: the hash of the message is.
TASK_ID_LIMIT = 128


@dataclass(frozen=True)
class Verdict:
    """Why a message is poison, and its task id when it has one."""

    reason: Reason
    message: str
    task_id: str | None = None


Loads = Callable[[bytes | str], Any]


def inspect(raw: bytes, queue: str, queue_of: Callable[[str], str | None]) -> Verdict | None:
    """None when `raw`, popped from `queue`, is a chunk that kombu and Celery will deliver
    to regen's task; else why not. `queue_of(job)` is the job's queue (None: no such job).

    A message that passes with orjson's decoding passes with kombu's own JSON loader, so
    also decodes there: orjson refuses whatever the json module refuses, and kombu's hook
    (which turns objects with a `__type__` key into values, or raises) is kept for text
    that has one. The values differ only past the standard (orjson refuses NaN and lone
    surrogates, reads an integer past 64 bits as a float), so a message refused that way
    is judged again, with kombu's loader, for the verdict kombu would give. orjson is
    several times faster, and every chunk is screened once per delivery. A body of
    regen's own content type (celery_app.CHUNK_CONTENT_TYPE) is read with orjson alone,
    as Celery reads it.
    """
    verdict = _inspect(raw, queue, queue_of, _fast_loads)
    return verdict and _inspect(raw, queue, queue_of, _kombu_loads)


def _fast_loads(text: bytes | str) -> Any:
    if isinstance(text, str) or b"__type__" in text:  # str: a body not in base64, rare
        return kombu_loads(text)
    return orjson.loads(text)


def _kombu_loads(text: bytes | str) -> Any:
    return kombu_loads(text)  # bytes: decoded as UTF-8 first


def _inspect(
    raw: bytes, queue: str, queue_of: Callable[[str], str | None], loads: Loads
) -> Verdict | None:
    try:
        envelope = loads(raw)
    except Exception as exc:  # untrusted bytes: any failure to decode is the verdict
        return Verdict(Reason.NOT_JSON, f"not JSON: {exc}")
    try:
        headers, body = _unwrap(envelope, loads)
    except Exception as exc:  # as above: kombu's JSON hooks raise more than ValueError
        return Verdict(Reason.NOT_A_TASK_MESSAGE, f"not a Celery task message: {exc!r}")
    task_id = headers["id"]
    if headers["task"] != GENERATE_TASK:
        return Verdict(
            Reason.UNKNOWN_TASK, f"task {headers['task']!r} is not {GENERATE_TASK}", task_id
        )
    try:
        chunk = Chunk.from_payload(_single_argument(body))
    except Exception as exc:  # as above: the body is anything kombu's JSON can decode
        return Verdict(Reason.MALFORMED_CHUNK, str(exc), task_id)
    home = queue_of(chunk.job)
    if home != queue:
        where = f"its queue is {home}" if home else "no such job"
        return Verdict(
            Reason.WRONG_QUEUE, f"a chunk of job {chunk.job!r} ({where}) on {queue}", task_id
        )
    return None


def _unwrap(envelope: Any, loads: Loads) -> tuple[dict[str, Any], Any]:
    """The headers and decoded body of a Celery (protocol 2) message in a kombu Redis
    envelope, checking every field that kombu or Celery would otherwise fail on."""
    properties = envelope["properties"]
    delivery = properties["delivery_info"]
    if not isinstance(properties["delivery_tag"], str):
        raise TypeError("delivery_tag is not a string")
    if not isinstance(delivery["exchange"], str) or not isinstance(delivery["routing_key"], str):
        raise TypeError("delivery_info has no exchange and routing key")
    content_type = envelope.get("content-type")
    if content_type == CHUNK_CONTENT_TYPE:
        loads = orjson.loads  # what Celery decodes these bodies with
    elif content_type != "application/json":
        raise ValueError(f"content type {content_type!r} is not JSON")
    headers = envelope["headers"]
    if not isinstance(headers["task"], str) or not isinstance(headers["id"], str):
        raise TypeError("headers name no task and id")
    if headers.get("eta") is not None or headers.get("expires") is not None:
        raise ValueError("a chunk is never scheduled (eta) or expiring (expires)")
    body = envelope["body"]
    encoding = properties.get("body_encoding")
    if encoding == "base64":
        body = base64.b64decode(body, validate=True)
    elif encoding is not None:
        raise ValueError(f"unknown body encoding {encoding!r}")
    return headers, loads(body)


def _single_argument(body: Any) -> dict[str, Any]:
    args, kwargs, _embed = body
    if not isinstance(args, list) or len(args) != 1 or kwargs:
        raise ValueError("the task's arguments are not one chunk payload")
    payload: dict[str, Any] = args[0]
    return payload


def entry_id(raw: bytes, verdict: Verdict) -> str:
    """Stable per message, so dead-lettering it twice overwrites: its task id, else a hash
    of its bytes (`task:` marks an entry without a prompt; see common/ledger/places.py)."""
    if verdict.task_id and len(verdict.task_id) <= TASK_ID_LIMIT:
        return f"task:{verdict.task_id}"
    return f"task:raw-{hashlib.blake2b(raw, digest_size=8).hexdigest()}"


def dead_letter(raw: bytes, queue: str, job: str, verdict: Verdict, worker: str) -> dlq.DeadLetter:
    """The entry of a poison message: the message itself, raw and bounded, and the queue."""
    kept = raw[:RAW_LIMIT]
    try:
        text, encoding = kept.decode(), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(kept).decode(), "base64"
    return dlq.DeadLetter(
        entry_id=entry_id(raw, verdict),
        job=job,
        stage="generate",
        reason=verdict.reason,
        message=verdict.message[:2000],
        payload={
            "queue": queue,
            "raw": text,
            "encoding": encoding,
            "raw_bytes": len(raw),
            "truncated": len(raw) > RAW_LIMIT,
        },
        worker=worker,
    )


class PoisonFilter:
    """Lets chunks through and moves everything else on a queue to its job's DLQ."""

    def __init__(self, r: redis.Redis, worker: str) -> None:
        self._redis = r
        self._worker = worker
        self._specs: dict[str, jobspec.JobSpec | None] = {}

    def admit(self, queue: str, raw: bytes) -> bool:
        """True to deliver the message; False once it is dead-lettered (or put back)."""
        try:
            verdict = inspect(raw, queue, self._queue_of)
            if verdict is None:
                return True
            letter = dead_letter(raw, queue, self._job_of(queue), verdict, self._worker)
            dlq.put(self._redis, letter)
        except redis.RedisError:
            log.exception("could not screen a message from %s; putting it back", queue)
            self._put_back(queue, raw)
            return False
        log.error(
            "poison message on %s dead-lettered as %s (job %s, %s): %s",
            queue, letter.entry_id, letter.job, verdict.reason, verdict.message,
        )  # fmt: skip
        return False

    def _put_back(self, queue: str, raw: bytes) -> None:
        """Back at the tail of its queue, where BRPOP took it from: popped, but neither
        delivered nor dead-lettered."""
        try:
            self._redis.rpush(queue, raw)
        except redis.RedisError:
            log.exception("LOST a message from %s (Redis refused it back): %r", queue, raw[:500])

    def _spec(self, job: str) -> jobspec.JobSpec | None:
        # Specs never change once stored; a job created later is looked up again.
        if self._specs.get(job) is None:
            try:
                self._specs[job] = jobspec.load(self._redis, job)
            except jobspec.JobSpecError:
                self._specs[job] = None
        return self._specs[job]

    def _queue_of(self, job: str) -> str | None:
        spec = self._spec(job) if keys.JOB_NAME_RE.match(job) else None
        return spec.queue if spec else None

    def _job_of(self, queue: str) -> str:
        """The job a queue serves: by its name (`regen.generate.JOB`), else the first job
        whose spec names it, else `unknown`."""
        job = keys.job_of_queue(queue)
        if job is not None:
            return job
        for name in jobspec.list_jobs(self._redis):
            if self._queue_of(name) == queue:
                return name
        return "unknown"
