"""What a generate worker's chunks share: its Redis client, engine runner, counters and
the leases it holds (one per process, handed to every chunk it runs)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from regen.common import defaults, jobspec, provenance, tokenizer_refusals
from regen.common.chunk_message import ChunkMessages
from regen.common.heartbeat import RateMeter
from regen.common.tokenizer import TokenizerMismatch
from regen.consumers.generate.chunk_life import DeliveryHooks, LeaseBook
from regen.consumers.generate.engine_loop import EngineRunner
from regen.consumers.generate.job_chat import JobChat, load_job_chat
from regen.consumers.generate.placement.answer_stats import AnswerStats
from regen.consumers.generate.placement.peers import PeerView


@dataclass
class ChunkContext:
    redis: redis.Redis
    runner: EngineRunner
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    max_attempts: int = defaults.MAX_CHUNK_ATTEMPTS
    # Output tokens and prompts handed off, for heartbeats and metrics.
    tokens: RateMeter = field(default_factory=RateMeter)
    prompts: RateMeter = field(default_factory=RateMeter)
    # Running answers handed over to faster servers, and the tokens they had decoded
    # (held_prompts.py): work that moved, not work lost.
    handed_over: RateMeter = field(default_factory=RateMeter)
    handed_over_tokens: RateMeter = field(default_factory=RateMeter)
    # The recent answers' lengths and latencies: this server's speed (answer_stats.py).
    answers: AnswerStats = field(default_factory=AnswerStats)
    # Prompts submitted to the engine and not finished; chunks being worked on; the
    # limit on chunks held that flow control sets (see flow_control.py).
    inflight: int = 0
    # Prompts deliveries hold that are not started (held_prompts.py): outstanding for
    # flow control, but in no engine, so free to go to another worker.
    waiting: int = 0
    chunks_held: int = 0
    chunk_limit: int = 0
    # How many more prompts the worker's engine starts now, given those it runs (its
    # free slots), and how it renders the chunks it gives the others back in
    # (chunk_life, unstarted.py). Set by the worker; without them a delivery starts all
    # its prompts at once.
    room: Callable[[int], int] | None = None
    messages: ChunkMessages | None = None
    # The idle slots of the other generate workers (peers.py): prompts waiting here go
    # back to the queue only for them. Set by the worker.
    peers: PeerView | None = None
    # Whether the worker leaves a queue's last prompts to faster servers now: a delivery
    # then starts none of its waiting prompts and gives them back (stand_down.py). Set
    # by the worker.
    leaving: Callable[[str], bool] = lambda queue: False
    # When a delivery last gave prompts back (time.monotonic()): flow control keeps no
    # slack a moment after, for the peers to take them (flow_control.HOLD_OFF_S).
    gave_back_at: float = float("-inf")
    # Set when the worker drains (SIGTERM, drain.py): every delivery moves its running
    # answers back to the queue and starts nothing more.
    draining: threading.Event = field(default_factory=threading.Event)
    # A job's pause as the worker last read it (job_pause.py): None, or PAUSED / NOW.
    pause: Callable[[str], str | None] = lambda job: None
    # Running answers stopped and given back from scratch (a drain or pause, where the
    # answer could not move with its tokens so far): their decode is thrown away.
    restarted: RateMeter = field(default_factory=RateMeter)
    # Called when the worker's slots fall idle with nothing waiting here, so that the
    # others learn it within a second, not at the next regular heartbeat (peers.py).
    on_idle_slots: Callable[[], None] = lambda: None
    # Subscribers to its deliveries' steps and ends: metrics, crash points (hooks.py).
    hooks: DeliveryHooks = field(default_factory=DeliveryHooks)
    _specs: dict[str, jobspec.JobSpec] = field(default_factory=dict)
    _model_sampling: dict[str, dict[str, Any] | None] = field(default_factory=dict)
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

    def has_idle_slots(self) -> bool:
        """Free slots and no prompt waiting here to take them."""
        return self.room is not None and not self.waiting and self.room(self.inflight) > 0

    def count_waiting(self, delta: int) -> None:
        with self._lock:
            self.waiting += delta

    @property
    def outstanding(self) -> int:
        """Prompts the worker holds: running, and waiting for a slot."""
        return self.inflight + self.waiting

    def reserve(self, wanted: int, at_least: int = 1) -> int:
        """Start up to `wanted` of a delivery's waiting prompts: count as many in flight
        as the engine has free slots (`room`), and at least `at_least` (a delivery
        starts one, so it makes progress); how many."""
        with self._lock:
            started = wanted
            if self.room is not None and self.messages is not None:
                started = min(wanted, max(at_least, self.room(self.inflight)))
            self.inflight += started
            self.waiting -= started
            return started

    def count_chunks(self, delta: int) -> None:
        with self._lock:
            self.chunks_held += delta

    def spec(self, job: str) -> jobspec.JobSpec:
        # A job's spec never changes once stored, so caching it for the process is safe.
        if job not in self._specs:
            self._specs[job] = jobspec.load(self.redis, job)
        return self._specs[job]

    def model_sampling(self, job: str) -> dict[str, Any] | None:
        """The sampling defaults the job's model sets in its generation_config.json,
        which the server applies where the job leaves a parameter unset (from the
        job's provenance); None where the job has none to say."""
        if job not in self._model_sampling:
            made_by = provenance.load(self.redis, job)
            self._model_sampling[job] = (
                None if made_by is None else made_by.get("model_sampling_defaults", {})
            )
        return self._model_sampling[job]

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
