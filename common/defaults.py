"""Every default regen uses, documented once (like rq's defaults.py).

CLI options fall back to a `REGEN_*` environment variable, then to the value here; so do
the settings common.settings reads from the environment.
"""

from __future__ import annotations

# --- where state lives -------------------------------------------------------------
# State folder for the embedded Redis, caches and logs (env: REGEN_HOME).
HOME = ".regen"
# Port of the embedded Redis on 127.0.0.1 (env: REGEN_EMBEDDED_PORT). Not 6379, so it
# never collides with a Redis the machine already runs.
EMBEDDED_REDIS_PORT = 6399
# The name a Redis Sentinel deployment knows the primary by (env:
# REGEN_REDIS_SENTINEL_MASTER): no default, since a sentinel:// URL with a guessed name
# would follow the wrong primary; such a URL without it is an error (common/connection.py).
REDIS_SENTINEL_MASTER: str | None = None
# The sentinels' own password (`requirepass` in sentinel.conf; env:
# REGEN_REDIS_SENTINEL_PASSWORD), when they ask for one; the primary's is in the URL.
REDIS_SENTINEL_PASSWORD: str | None = None
# Where the tokenizer worker writes shards (env: REGEN_OUT).
OUT_DIR = "regen-out"

# --- the job -----------------------------------------------------------------------
# Prompts per chunk, the unit of work on the generate queue. 64 keeps a chunk's run
# time in minutes on a busy server while a 900K-prompt job stays at ~14K chunks.
CHUNK_SIZE = 64
# Ids a new job's Redis indexes are sized for (`--expected-prompts`; common/ledger/id_buckets.py):
# they stay compact up to ~2-4x this; a far smaller job has up to one bucket (~100 bytes
# of key overhead) per id in each index.
EXPECTED_PROMPTS = 1_000_000
# SGLang's own default is 128 tokens, which silently truncates answers: regen always
# sends an explicit value.
MAX_NEW_TOKENS = 4096
# Producer backpressure: enqueueing blocks while the job has more than this many chunks
# waiting (queued, plus results not yet written to shards, in chunk units).
HIGH_WATER_CHUNKS = 256
# The producer orders the prompts of each window of this many rows longest dataset
# answer first (producer/longest_first.py; `--order-window`, 0 keeps the file's order):
# a few rounds of a large fleet's slots, and seconds of rendering; a job stopped
# half-way has answered a fair half.
ORDER_WINDOW = 8192

# --- planning (`regen plan`) -------------------------------------------------------
# Prompts tokenized; a 10,000-prompt sample puts the mean within ~1% for ordinary length
# spreads and takes seconds.
PLAN_SAMPLE = 10_000
PLAN_SEED = 0
# Output tokens per second per server when none is given: the figure of the 900K-prompt
# example in the plan issue, a busy SGLang server on a large MoE model. A guess: measure
# yours (`sglang:gen_throughput` under load) and pass it.
PLAN_TOKENS_PER_S = 800.0
# Servers sharing the job.
PLAN_SERVERS = 1

# --- delivery ----------------------------------------------------------------------
# The lease on a delivered chunk (kombu's visibility timeout): its worker renews it with
# every heartbeat, so a live worker keeps a chunk however long it runs, and a dead
# worker's chunks are restored once this much has passed since its last heartbeat. Every
# process on one Redis must use the same value (env: REGEN_VISIBILITY_TIMEOUT); see
# docs/design/delivery.md, Delivery protocol.
VISIBILITY_TIMEOUT_S = 100
# How often kombu sweeps for unacked messages past the lease (interval x throttle
# seconds; env: REGEN_RESTORE_INTERVAL, REGEN_RESTORE_THROTTLE). A dead worker's chunks
# are back on the queue within lease + sweep = 110 s of its last heartbeat.
UNACKED_RESTORE_INTERVAL_S = 10
UNACKED_RESTORE_THROTTLE = 1
# A sweep holds kombu's restore lock (`unacked_mutex`) for a few milliseconds; a worker
# killed inside one leaves the lock until it expires, and no process restores anything
# until then. kombu's 300 s would hold a dead worker's chunks for three leases; this
# bounds the stall. A lock that expires mid-sweep is harmless: each restore is a
# transaction on `unacked` that moves a message once.
UNACKED_MUTEX_EXPIRE_S = 10
# A chunk's attempts and settled prompts are kept this long after its last renewal, so
# a redelivery still finds which prompts are done; then they expire (flat memory).
CHUNK_STATE_TTL_S = 8 * 3600
# The answers `regen recover` saves of committed turns whose conversation Redis lost
# (`keys.recovered_answers`) wait this long for the job's enqueue to resume those
# conversations: long, since the operator runs that enqueue when they can, and a
# conversation whose answers expired first cannot resume (its open turns are
# dead-lettered `history_lost`); not forever, since an enqueue never run again would
# leave them in Redis for good.
RECOVERED_ANSWERS_TTL_S = 7 * 24 * 3600
# Most chunks a generate worker holds at once (its threads); within that, flow control
# holds as many as keep its engine full (consumers/generate/placement/flow_control.py).
MAX_CHUNKS_HELD = 64
# A chunk delivered more times than this (its worker died each time) is dead-lettered.
MAX_CHUNK_ATTEMPTS = 3
# Results a generate worker hands off in one script (one Redis round trip), at most.
HAND_OFF_BATCH = 64
# The prompts of a chunk a generate worker cannot start soon go back to the queue in
# chunks of at most this many (chunk_life/unstarted.py): small enough that a worker
# with a few free slots takes one whole, large enough to keep messages few.
GIVEN_BACK_CHUNK_SIZE = 8

# --- the generate worker -----------------------------------------------------------
# Engine of `regen worker generate`: SGLang servers over HTTP.
ENGINE = "sglang"
# Chunks a generate worker runs at once; 0: as many as keep its engine full (flow
# control, within MAX_CHUNKS_HELD).
CONCURRENCY = 0
# Log level of the worker (Celery's).
LOGLEVEL = "INFO"

# How long a generate worker's drain may take from the first SIGTERM (or SIGINT) to its
# exit (`--drain-timeout`; consumers/generate/drain.py). Slurm's KillWait and Kubernetes'
# terminationGracePeriodSeconds send SIGKILL 30 s after the SIGTERM: the drain's own
# steps take about a second (an abort ends a request after one decode step; a give-back
# is one Redis script per delivery), so 20 s leaves ten for Celery's exit and the
# engine's close before the kill. A drain still running then exits 1: the chunks left
# come back to the queue when their leases end, as after a crash.
DRAIN_TIMEOUT_S = 20.0

# --- generation --------------------------------------------------------------------
# Requests kept in flight per SGLang server with a fixed `--max-inflight N`, and where
# `--max-inflight auto` (the default for --engine sglang) starts and falls back to when a
# server has no /metrics; peers use 64 to 512.
MAX_INFLIGHT_PER_SERVER = 256
# `--max-inflight auto` never keeps more than this in flight on one server
# (--max-inflight-cap): SGLang servers run up to a few thousand requests at once.
MAX_INFLIGHT_CAP = 2048
# How often `--max-inflight auto` reads each server's /metrics; a server without usable
# metrics is asked again this much less often.
ADMISSION_POLL_S = 1.0
ADMISSION_FALLBACK_POLL_S = 30.0
# Batch size of the local transformers engine: its KV cache lives in this process (a
# batch of 256 x 4K tokens would need ~50 GB on CPU even for SmolLM2).
LOCAL_BATCH_SIZE = 16
# Device of the local engine: "auto" is CUDA when there is one, else the CPU.
DEVICE = "auto"
# Tensor parallelism of the in-process SGLang engine (GPUs per model copy).
TP_SIZE = 1
# Per-request timeout: long, because a 32K-token thinking answer can take many minutes.
REQUEST_TIMEOUT_S = 3600.0
# Conversations (`--turns all`) whose last server a generate worker remembers, to send
# their next turn there: 4x the 4,096 a worker runs at once with the default chunks
# (MAX_CHUNKS_HELD x CHUNK_SIZE), at ~200 bytes each; the least recently used go first.
AFFINITY_KEYS = 16_384

# --- the tokenize worker -----------------------------------------------------------
# A shard is closed and committed at the first of: this many records, this many
# uncompressed bytes (a few hundred MB suits training loaders' shuffling buffers), this
# age (it bounds how long results wait unacknowledged), or this long without a result.
SHARD_MAX_ROWS = 100_000
SHARD_MAX_BYTES = 256 * 1024**2
# zstd level of the shards (and of `regen plan`'s estimate of their size): 3, zstd's
# default, compresses a record's JSON ~3-4x at hundreds of MB/s.
SHARD_ZSTD_LEVEL = 3
SHARD_MAX_AGE_S = 300.0
SHARD_IDLE_S = 10.0
# Answers cut at max_new_tokens: "keep" them (flagged `truncated`: every token is still
# the target's own, and the export decides), "drop" them (ids noted), or "dlq".
ON_TRUNCATED = "keep"
# Compare each record with a re-render of the chat template.
DRIFT_CHECK = True
# The stage pauses (no crash, no partial file) while the shard disk has less free.
MIN_FREE_BYTES = 2048 * 1024**2
# Results another consumer has held this long are taken over: longer than any live
# consumer keeps a shard open.
CLAIM_IDLE_S = 900.0

# --- status (`regen status`) ------------------------------------------------------
# Rates and the ETA are measured over about this much recent time (--window).
STATUS_RATE_WINDOW_S = 600.0

# --- job-wide metrics (`regen metrics serve`) ---------------------------------------
# Redis is read at most this often, however many Prometheus servers scrape.
JOB_METRICS_REFRESH_S = 15.0
# The port it serves /metrics on (the workers' ports in compose.yaml are 9100 and 9101).
JOB_METRICS_PORT = 9102

# --- the demo (`regen demo`) -------------------------------------------------------
DEMO_ENGINE = "local"
DEMO_MODEL = "smollm2"
DEMO_MAX_NEW_TOKENS = 320
# No temperature or top_p: the demo samples as the model's generation_config says (for
# SmolLM2 it sets none: temperature 1, top_p 1). The model card's example, temperature
# 0.2 and top_p 0.9, looped: on the bundled prompts 7 of 39 answers ended in a loop
# (flagged repetition, the first record among them), against none at the model's own.
# The demo fails when its job is not done by then.
DEMO_TIMEOUT_S = 1800.0

# --- heartbeats --------------------------------------------------------------------
# A worker whose last heartbeat is older than this is reported stale (and its temporary
# shard files may be removed): env REGEN_HEARTBEAT_STALE_S.
HEARTBEAT_STALE_AFTER_S = 60.0
# Longest between two beats; shorter when the stale age is short (a quarter of it).
HEARTBEAT_INTERVAL_MAX_S = 10.0

# --- shards ------------------------------------------------------------------------
# A tokenize consumer's claim on a shard's ids lasts this long before another consumer
# may resolve it (env REGEN_SHARD_LEASE_S); the owner renames only with half of it left.
SHARD_CLAIM_S = 120.0

# --- healing (`regen enqueue --follow`, the tokenize stage's own recovery) -----------
# The follower looks at its job this often (env REGEN_FOLLOW_POLL_S): a pass is one
# O(window) count (common/ledger/places.py), so every 30 s costs Redis little, and a lost
# chunk is queued again within poll + grace + poll, about 3 minutes: "a few minutes",
# against answers of 1-8 minutes and jobs of weeks.
FOLLOW_POLL_S = 30.0
# Ids in no place are queued again only when two readings this far apart both find them
# there (env REGEN_FOLLOW_GRACE_S). A chunk kombu is delivering is in no place for one
# round trip (plus the generate worker's screen, well under a second); 90 s is far above
# that and above a Redis restart or Sentinel failover (4 s measured), while a worker
# stopped longer (SIGSTOP, a VM paused) has its chunk queued again: when it wakes, the
# chunk lease and the commit ledger keep its prompts' answers once
# (docs/design/exactly-once.md, Healing).
FOLLOW_GRACE_S = 90.0
# A tokenize worker's lock on a job's recovery expires this long after its last renewal
# (renewed at a third of it while recovery runs): a worker killed mid-recovery lets
# another take it over within a minute; recovery is safe to run again.
RECOVER_LOCK_TTL_S = 60.0
