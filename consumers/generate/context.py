"""What a generate worker's chunks share: its Redis client, engine runner, counters and
the leases it holds (one per process, handed to every chunk it runs)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from regen.common import defaults, jobspec, tokenizer_refusals
from regen.common.chunk_message import ChunkMessages
from regen.common.heartbeat import RateMeter
from regen.common.tokenizer import TokenizerMismatch
from regen.consumers.generate.chunk_life import LeaseBook
from regen.consumers.generate.engine_loop import EngineRunner
from regen.consumers.generate.job_chat import JobChat, load_job_chat


@dataclass
class ChunkContext:
    redis: redis.Redis
    runner: EngineRunner
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    max_attempts: int = defaults.MAX_CHUNK_ATTEMPTS
    # Output tokens and prompts handed off, for heartbeats and metrics.
    tokens: RateMeter = field(default_factory=RateMeter)
    prompts: RateMeter = field(default_factory=RateMeter)
    # Prompts submitted to the engine and not finished; chunks being worked on; the
    # limit on chunks held that flow control sets (see flow_control.py).
    inflight: int = 0
    chunks_held: int = 0
    chunk_limit: int = 0
    # How many more prompts the worker can start soon, given its outstanding ones
    # (flow_control.startable_soon over its engine), and how it renders the chunks it
    # gives the others back in (chunk_life, unstarted.py). Set by the worker; without
    # them a delivery holds all its prompts.
    room: Callable[[int], int] | None = None
    messages: ChunkMessages | None = None
    # Whether another generate worker on a queue has idle slots (peers.py): prompts
    # waiting here go back to the queue only then. Set by the worker.
    peer_idle: Callable[[str], bool] | None = None
    _specs: dict[str, jobspec.JobSpec] = field(default_factory=dict)
    _chats: dict[str, JobChat] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _chat_lock: threading.Lock = field(default_factory=threading.Lock)
    # The leases of the chunks held, renewed by the worker's heartbeat.
    leases: LeaseBook = field(init=False)

    def __post_init__(self) -> None:
        self.leases = LeaseBook(self.redis)

    def count_inflight(self, delta: int) -> None:
        with self._lock:
            self.inflight += delta

    def reserve(self, wanted: int, at_least: int = 1) -> int:
        """Count up to `wanted` prompts in flight: as many as the worker can start soon
        (`room`), and at least `at_least` (a delivery starts one, so it makes progress);
        how many."""
        with self._lock:
            held = wanted
            if self.room is not None and self.messages is not None:
                held = min(wanted, max(at_least, self.room(self.inflight)))
            self.inflight += held
            return held

    def count_chunks(self, delta: int) -> None:
        with self._lock:
            self.chunks_held += delta

    def spec(self, job: str) -> jobspec.JobSpec:
        # A job's spec never changes once stored, so caching it for the process is safe.
        if job not in self._specs:
            self._specs[job] = jobspec.load(self.redis, job)
        return self._specs[job]

    def chat(self, job: str) -> JobChat:
        """The job's tokenizer and template, loaded on first use (`--turns all` jobs)."""
        with self._chat_lock:
            if job not in self._chats:
                try:
                    self._chats[job] = load_job_chat(self.spec(job))
                except TokenizerMismatch as exc:
                    tokenizer_refusals.record(self.redis, job, self.worker, str(exc))
                    raise
            return self._chats[job]
