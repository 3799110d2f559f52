"""Every default regen uses, documented once (like rq's defaults.py).

CLI options fall back to a `REGEN_*` environment variable, then to the value here.
"""

from __future__ import annotations

import os


def env_float(name: str, default: float) -> float:
    """A number from the environment (tests shorten timeouts this way), else `default`."""
    raw = os.environ.get(name)
    return float(raw) if raw else default


# --- where state lives -------------------------------------------------------------
# State folder for the embedded Redis, caches and logs (env: REGEN_HOME).
HOME = ".regen"
# Port of the embedded Redis on 127.0.0.1 (env: REGEN_EMBEDDED_PORT). Not 6379, so it
# never collides with a Redis the machine already runs.
EMBEDDED_REDIS_PORT = 6399
# Where the tokenizer worker writes shards (env: REGEN_OUT).
OUT_DIR = "regen-out"

# --- the job -----------------------------------------------------------------------
# Prompts per chunk, the unit of work on the generate queue. 64 keeps a chunk's run
# time in minutes on a busy server while a 900K-prompt job stays at ~14K chunks.
CHUNK_SIZE = 64
# SGLang's own default is 128 tokens, which silently truncates answers: regen always
# sends an explicit value.
MAX_NEW_TOKENS = 4096
# Producer backpressure: enqueueing blocks while the job has more than this many chunks
# waiting (queued, plus results not yet written to shards, in chunk units).
HIGH_WATER_CHUNKS = 256

# --- delivery ----------------------------------------------------------------------
# The lease on a delivered chunk (kombu's visibility timeout): its worker renews it with
# every heartbeat, so a live worker keeps a chunk however long it runs, and a dead
# worker's chunks are restored once this much has passed since its last heartbeat. Every
# process on one Redis must use the same value (env: REGEN_VISIBILITY_TIMEOUT); see
# docs/design.md, Delivery protocol.
VISIBILITY_TIMEOUT_S = 100
# How often kombu sweeps for unacked messages past the lease (interval x throttle
# seconds; env: REGEN_RESTORE_INTERVAL, REGEN_RESTORE_THROTTLE). A dead worker's chunks
# are back on the queue within lease + sweep = 110 s of its last heartbeat.
UNACKED_RESTORE_INTERVAL_S = 10
UNACKED_RESTORE_THROTTLE = 1
# A chunk's attempts and settled prompts are kept this long after its last renewal, so
# a redelivery still finds which prompts are done; then they expire (flat memory).
CHUNK_STATE_TTL_S = 8 * 3600
# Most chunks a generate worker holds at once (its threads); within that, flow control
# holds as many as keep its engine full (consumers/generate/flow.py).
MAX_CHUNKS_HELD = 64
# A chunk delivered more times than this (its worker died each time) is dead-lettered.
MAX_CHUNK_ATTEMPTS = 3

# --- generation --------------------------------------------------------------------
# Requests kept in flight per SGLang server; peers use 64 to 512.
MAX_INFLIGHT_PER_SERVER = 256
# Batch size of the local transformers engine: its KV cache lives in this process (a
# batch of 256 x 4K tokens would need ~50 GB on CPU even for SmolLM2).
LOCAL_BATCH_SIZE = 16
# Per-request timeout: long, because a 32K-token thinking answer can take many minutes.
REQUEST_TIMEOUT_S = 3600.0

# --- heartbeats --------------------------------------------------------------------
# A worker whose last heartbeat is older than this is reported stale (and its temporary
# shard files may be removed): env REGEN_HEARTBEAT_STALE_S.
HEARTBEAT_STALE_S = env_float("REGEN_HEARTBEAT_STALE_S", 60.0)
# Beats come several times per stale period, so a live worker never looks stale.
HEARTBEAT_INTERVAL_S = min(10.0, HEARTBEAT_STALE_S / 4)

# --- shards ------------------------------------------------------------------------
# A tokenize consumer's claim on a shard's ids lasts this long before another consumer
# may resolve it (env REGEN_SHARD_LEASE_S); the owner renames only with half of it left.
SHARD_LEASE_S = env_float("REGEN_SHARD_LEASE_S", 120.0)
