"""`regen worker generate`: a real Celery worker that drives one engine.

One worker per GPU host (or per group of SGLang servers). It runs chunks on a thread pool
sized so the engine stays at its in-flight target across chunk boundaries, follows new
jobs as they are enqueued, and consumes only while its engine passes its health checks,
from the first one on (a dead server is not a bad prompt: its chunks wait in the queue for
a healthy worker). Messages on its queues that are not chunks go to the DLQ (poison.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, bootsteps, signals

from regen.common import connection, defaults, gc_tuning, job_pause, jobspec, settings
from regen.common.celery_app import make_app
from regen.common.chunk_message import ChunkMessages
from regen.common.heartbeat import Heartbeat, worker_name
from regen.consumers.generate import kombu_screen
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import LeaseKeepingConsumer
from regen.consumers.generate.drain import Drain, stop_celery_worker
from regen.consumers.generate.engine_loop import EngineRunner
from regen.consumers.generate.engines import EngineOptions, make_engine
from regen.consumers.generate.metrics import generate_metrics
from regen.consumers.generate.new_jobs import NewJobs
from regen.consumers.generate.placement.flow_control import keeps_slack, make_flow_control, slack
from regen.consumers.generate.placement.idle_beat import IdleBeat
from regen.consumers.generate.placement.peers import PeerView
from regen.consumers.generate.placement.stand_down import StandDown
from regen.consumers.generate.poison import PoisonFilter
from regen.consumers.generate.tasks import register

log = logging.getLogger("regen.generate")

WATCH_INTERVAL_S = 2.0
# How often the consumer's loop applies the watcher's queue set: a set comparison, no
# I/O, so a new job's queue is taken within this of the watcher seeing the job.
GATE_INTERVAL_S = 0.2


@dataclass
class WorkerOptions:
    redis_url: str | None
    engine: str
    engine_options: EngineOptions
    jobs: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    # Chunks run at once; 0 = derived from the engine's capacity and the chunk size.
    concurrency: int = defaults.CONCURRENCY
    max_attempts: int = defaults.MAX_CHUNK_ATTEMPTS
    loglevel: str = defaults.LOGLEVEL
    # Serve Prometheus metrics on this port; None: no metrics endpoint.
    metrics_port: int | None = None
    # Longest from the first SIGTERM to the exit (drain.py).
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S


class QueueState:
    """What the worker should consume, computed off the event loop by the watcher."""

    def __init__(self, queues: set[str]) -> None:
        self._lock = threading.Lock()
        self._queues = set(queues)
        # Unhealthy until the engine passes a health check: a worker pointed at a dead
        # server must not take a chunk and sit on it until the give-back.
        self.healthy = False
        self.checked = False
        # Paused jobs with their mode, and their queues (`regen pause`: job_pause.py).
        self._paused: dict[str, str] = {}
        self._paused_queues: set[str] = set()

    def set_queues(self, queues: set[str]) -> None:
        with self._lock:
            self._queues = set(queues)

    def set_paused(self, paused: dict[str, str], queues: set[str]) -> None:
        with self._lock:
            self._paused, self._paused_queues = dict(paused), set(queues)

    def pause(self, job: str) -> str | None:
        """The job's pause as last read (job_pause.PAUSED or NOW), or None."""
        with self._lock:
            return self._paused.get(job)

    def paused(self) -> list[str]:
        with self._lock:
            return sorted(self._paused)

    def wanted(self) -> set[str]:
        """The queues to consume: none while the engine is unhealthy, and never a paused
        job's (a queue several jobs share stops while any of them is paused)."""
        with self._lock:
            return self._queues - self._paused_queues if self.healthy else set()


def make_queue_gate(consumed: Callable[[], set[str]]) -> type[bootsteps.StartStopStep]:
    class QueueGate(bootsteps.StartStopStep):
        """Adds and cancels queues on the consumer's own loop (kombu is not thread-safe)."""

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, consumer: Any) -> None:
            consumer.timer.call_repeatedly(GATE_INTERVAL_S, self.apply, (consumer,))

        def apply(self, consumer: Any) -> None:
            active = {q.name for q in consumer.task_consumer.queues}
            wanted = consumed()
            for queue in sorted(wanted - active):
                log.info("consuming %s", queue)
                consumer.add_task_queue(queue)
            for queue in sorted(active - wanted):
                log.warning("not consuming %s (engine unhealthy, job gone or paused, or its "
                            "end left to faster servers)", queue)  # fmt: skip
                consumer.cancel_task_queue(queue)

    return QueueGate


class Watcher(threading.Thread):
    """Polls engine health and the job registry; never touches the Celery consumer."""

    def __init__(self, options: WorkerOptions, ctx: ChunkContext, state: QueueState) -> None:
        super().__init__(name="regen-watcher", daemon=True)
        self._options = options
        self._ctx = ctx
        self._state = state
        self._stop_event = threading.Event()
        # A worker that finds its jobs itself wakes at a new job (new_jobs.py).
        self._new_jobs = NewJobs(ctx.redis) if self._discovers else None

    @property
    def _discovers(self) -> bool:
        return not self._options.jobs and not self._options.queues

    def run(self) -> None:
        if self._new_jobs is not None:
            self._new_jobs.subscribe()  # before the first read of the job registry
        # The first check at once: no chunk is taken before it passes.
        try:
            while True:
                try:
                    self.poll()
                except Exception:
                    log.exception("watcher poll failed")
                if self._new_jobs is not None:
                    self._new_jobs.wait(WATCH_INTERVAL_S, self._stop_event)
                elif self._stop_event.wait(WATCH_INTERVAL_S):
                    return
                if self._stop_event.is_set():
                    return
        finally:
            if self._new_jobs is not None:
                self._new_jobs.close()

    def poll(self) -> None:
        healthy = self._ctx.runner.call(self._ctx.runner.engine.health(), timeout=60)
        state = self._state
        if not state.checked:
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "engine is %s",
                "healthy: taking chunks" if healthy else "UNHEALTHY: no chunks until it passes",
            )
        elif healthy != state.healthy:
            log.warning("engine is %s", "healthy again" if healthy else "UNHEALTHY")
        state.healthy, state.checked = healthy, True
        if self._discovers:
            self._state.set_queues(discover_queues(self._ctx, self._options))
        self._read_pauses()

    def _read_pauses(self) -> None:
        ctx = self._ctx
        paused = job_pause.paused_now(ctx.redis)
        before = set(self._state.paused())
        for job in sorted(set(paused) - before):
            log.warning("job %s is paused%s: taking none of its prompts", job,
                        " (now: its running answers go back to the queue)"
                        if paused[job] == job_pause.NOW else "")  # fmt: skip
        for job in sorted(before - set(paused)):
            log.info("job %s is resumed", job)
        self._state.set_paused(paused, {ctx.spec(job).queue for job in paused})

    def stop(self) -> None:
        self._stop_event.set()


def discover_queues(ctx: ChunkContext, options: WorkerOptions) -> set[str]:
    """Queues of the jobs this worker can serve: all jobs, or those of its --model."""
    queues = set()
    for job in jobspec.list_jobs(ctx.redis):
        spec = ctx.spec(job)
        model = options.engine_options.model
        if model is None or spec.model == model:
            queues.add(spec.queue)
    return queues


def _resolve(options: WorkerOptions, ctx_redis: Any) -> tuple[list[jobspec.JobSpec], set[str]]:
    specs = [jobspec.load(ctx_redis, job) for job in options.jobs]
    queues = set(options.queues) | {spec.queue for spec in specs}
    return specs, queues


def run_worker(options: WorkerOptions) -> None:
    url = connection.resolve_url(options.redis_url)
    r = connection.client(url)
    specs, queues = _resolve(options, r)
    engine_options = options.engine_options
    if engine_options.model is None and options.engine in ("local", "sglang-engine"):
        # An in-process engine holds one model: take it from the jobs it will serve.
        served = specs or [jobspec.load(r, job) for job in jobspec.list_jobs(r)]
        models = {spec.model for spec in served}
        if len(models) != 1:
            raise SystemExit(
                f"--engine {options.engine} serves one model; the jobs use "
                f"{sorted(models) or 'none yet'}: pass --model (and --jobs)"
            )
        engine_options = EngineOptions(**{**engine_options.__dict__, "model": models.pop()})
        options.engine_options = engine_options
    engine = make_engine(options.engine, engine_options)
    runner = EngineRunner(engine)
    name = worker_name("generate")
    ctx = ChunkContext(redis=r, runner=runner, worker=name, max_attempts=options.max_attempts)
    state = QueueState(queues)
    if not queues:
        state.set_queues(discover_queues(ctx, options))
    ctx.pause = state.pause
    drain = Drain(ctx.draining, options.drain_timeout_s, lambda: _holds_nothing(ctx),
                  stop_celery_worker)  # fmt: skip
    signals.worker_ready.connect(drain.install, weak=False)
    # Threads bound the chunks held (they only wait on the engine, so they are cheap);
    # flow control sets how many are held within that, starting from two.
    concurrency = options.concurrency or defaults.MAX_CHUNKS_HELD
    initial_chunks = min(concurrency, 2)

    app: Celery = make_app(url)
    kombu_screen.install(app, PoisonFilter(r, name), ctx.leases)
    # A lost connection leaves held chunks held (their leases decide): chunk_life.
    app.conf.worker_consumer = f"{LeaseKeepingConsumer.__module__}:{LeaseKeepingConsumer.__name__}"
    register(app, ctx)
    # A delivery starts what its engine has free slots for; the rest waits in it, or
    # goes back to the queue for other workers' idle slots (held_prompts.py).
    ctx.room = lambda running: engine.capacity() - running
    ctx.messages = ChunkMessages(app)
    ctx.peers = PeerView(r, name)
    peers = ctx.peers
    # At a job's end, the queues it leaves to faster servers (stand_down.py).
    stand_down = StandDown(r, peers, ctx.answers, state.wanted,
                           lambda job: ctx.spec(job).chunk_size)  # fmt: skip
    ctx.leaving = stand_down.leaves

    def consumed() -> set[str]:
        if ctx.draining.is_set():
            return set()  # the drain takes no more chunks (drain.py)
        return state.wanted() - stand_down.left()

    app.steps["consumer"].add(make_queue_gate(consumed))
    chunk_size = max([spec.chunk_size for spec in specs] or [defaults.CHUNK_SIZE])

    def peers_idle() -> bool:
        return any(peers.idle_slots(q) > 0 for q in consumed())

    app.steps["consumer"].add(
        make_flow_control(
            ctx, engine.capacity, initial=initial_chunks, ceiling=concurrency,
            chunk_size=chunk_size, peers_idle=peers_idle,
        )
    )  # fmt: skip
    watcher = Watcher(options, ctx, state)
    # Each beat renews the leases of the chunks held: at least four beats per lease.
    configured = settings.current()
    heartbeat = Heartbeat(
        r,
        name,
        lambda: _snapshot(options, ctx, state, stand_down, concurrency, peers_idle),
        interval_s=min(configured.heartbeat_interval_s, configured.visibility_timeout_s / 4),
        renew=ctx.leases.renew,
    )
    ctx.on_idle_slots = heartbeat.wake
    idle_beat = IdleBeat(
        lambda: (idle_slots(ctx, state), short(ctx, state, peers_idle())), heartbeat.wake
    )
    metrics = None
    if options.metrics_port is not None:
        metrics = generate_metrics(name, url, ctx, lambda: state.healthy)
        metrics.serve(options.metrics_port)
    watcher.start()
    heartbeat.start()
    idle_beat.start()
    stand_down.start()
    log.info(
        "generate worker %s: engine %s, %d chunks at once, Redis %s",
        name,
        options.engine,
        concurrency,
        connection.redact(url),
    )
    gc_tuning.tune_for_throughput()
    try:
        exit_code = run_celery_worker(
            app,
            [
                "worker",
                "--pool",
                "threads",
                "--concurrency",
                str(concurrency),
                # Queues come and go through QueueGate; start on a placeholder-free set.
                "--queues",
                ",".join(sorted(state.wanted())) or "regen.idle",
                "--hostname",
                name,
                "--loglevel",
                options.loglevel,
                "--without-mingle",
                "--without-gossip",
            ],
        )
    finally:
        drain.exited()
        signals.worker_ready.disconnect(drain.install)
        watcher.stop()
        stand_down.stop()
        idle_beat.stop()
        heartbeat.stop()
        if metrics is not None:
            metrics.close()
        runner.close()
        ctx.messages.close()
    if exit_code:
        raise SystemExit(exit_code)


def run_celery_worker(app: Celery, argv: list[str]) -> int:
    """Run `celery worker` with `argv` in this process; the worker's exit code.

    A worker stopped by an unrecoverable error must not exit 0: its supervisor
    (compose's `restart: on-failure`, systemd) would leave it down. Celery sets the code
    on the worker (1 after "Unrecoverable error"), but `app.start` returns None whatever
    it is (click hands the code back rather than raising it, and `app.start` drops it),
    so it is read off the worker itself.
    """
    workers: list[Any] = []

    def remember(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
        workers.append(instance)

    signals.celeryd_init.connect(remember, weak=False)
    try:
        app.start(argv)
    finally:
        signals.celeryd_init.disconnect(remember)
    if not workers:  # never built (bad arguments): Celery said why
        return 1
    return int(workers[0].exitcode or 0)


def _holds_nothing(ctx: ChunkContext) -> bool:
    """No delivery runs and Celery holds no chunk for one to start (a drain's end)."""
    from celery.worker import state as celery_state

    return ctx.chunks_held == 0 and not celery_state.reserved_requests


def idle_slots(ctx: ChunkContext, state: QueueState) -> int:
    """Slots no prompt held here will fill (none while the engine is unhealthy or the
    worker drains: peers must not give prompts back for it)."""
    if not state.healthy or ctx.draining.is_set():
        return 0
    return max(0, ctx.runner.engine.capacity() - ctx.outstanding)


def short(ctx: ChunkContext, state: QueueState, peers_idle: bool) -> int:
    """Prompts the worker would take now: its idle slots and the slack its flow control
    keeps waiting (flow_control.py; none while a peer is idle or just after a give-back).
    Peers give their waiting prompts beyond their own slack for it (peers.py)."""
    if not state.healthy or ctx.draining.is_set():
        return 0
    capacity = ctx.runner.engine.capacity()
    kept = keeps_slack(ctx, peers_idle, time.monotonic())
    spare = slack(capacity, ctx.prompts.rate()) if kept else 0
    return max(0, capacity + spare - ctx.outstanding)


def _snapshot(
    options: WorkerOptions,
    ctx: ChunkContext,
    state: QueueState,
    stand_down: StandDown,
    concurrency: int,
    peers_idle: Callable[[], bool],
) -> dict[str, Any]:
    stats = ctx.runner.engine.stats()
    return {
        "kind": "generate",
        "engine": options.engine,
        "healthy": state.healthy,
        "draining": ctx.draining.is_set(),
        "paused_jobs": state.paused(),
        # Without the queues it leaves to faster servers: no peer gives prompts back
        # for its idle slots there. `regen status` counts it apart on those.
        "queues": [] if ctx.draining.is_set() else sorted(state.wanted() - stand_down.left()),
        "left_to_faster": sorted(stand_down.left()),
        "concurrency": concurrency,
        "chunks_held": ctx.chunks_held,
        "leases_held": ctx.leases.held,
        "chunk_limit": ctx.chunk_limit,
        "engine_stats": stats,
        "inflight": ctx.inflight,
        # Read by the other generate workers (peers.py): they give their unstarted
        # prompts back to the queue while this worker has slots idle.
        # Its own waiting prompts take its free slots first.
        "idle_slots": idle_slots(ctx, state),
        "short": short(ctx, state, peers_idle()),
        # Read by slower peers (stand_down.py): how fast this server finishes a job's end.
        "slots": ctx.runner.engine.capacity() if state.healthy and not ctx.draining.is_set() else 0,
        "decode_tps": ctx.answers.decode_tps(),
        "tokens_per_s": ctx.tokens.rate(),
        "tokens_total": ctx.tokens.total,
    }
