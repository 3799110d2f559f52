"""Every Redis key and queue name regen uses, built in one place (like arq's constants).

Per-job keys hold ids and small records, except dead letters: prompt payloads are in Redis
while their chunk is waiting or in flight, as a result not yet in a shard, or in a DLQ
entry (which keeps what a requeue needs); see docs/design/limits.md, Memory bound.
"""

from __future__ import annotations

import re

PREFIX = "regen"
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# Set of job names.
JOBS = f"{PREFIX}:jobs"
# Pub/sub channel: a new job's name, published once its spec is stored, so that idle
# generate workers take its queue at once instead of at their next poll of JOBS.
NEW_JOBS_CHANNEL = f"{PREFIX}:jobs:new"
# Hash worker name -> heartbeat JSON.
WORKERS = f"{PREFIX}:workers"
# Hash job -> JSON {dir, host, worker}: where a tokenize worker writes the job's shards
# (read by verify and status).
TOKENIZE_OUTPUTS = f"{PREFIX}:tokenize:outputs"
# kombu's Redis transport keeps delivered, unacknowledged messages of every queue in
# this hash: delivery tag -> JSON [message, exchange, routing key]. Named by kombu
# (Channel.unacked_key); regen reads it, and removes a chunk's entry when it settles the
# delivery itself (consumers/generate/chunk_life/lease.py).
KOMBU_UNACKED = "unacked"
# ...and, in this sorted set, delivery tag -> delivery time (Channel.unacked_index_key):
# kombu's sweep restores a message whose score is older than the visibility timeout. A
# generate worker moves the scores of the chunks it holds to now: its leases.
KOMBU_UNACKED_INDEX = "unacked_index"
# ...and kombu's lock that one sweep at a time holds (Channel.unacked_mutex_key).
KOMBU_UNACKED_MUTEX = "unacked_mutex"

# Fields of `job_counters` kept by the scripts that write the bucketed indexes: ids in
# the job (publish script, input dead letters) and ids in the committed index, claimed
# or committed (the commit ledger's scripts).
IDS = "ids"
COMMITTED_INDEX = "committed_index"
# Fields of `job_counters` that the tokenize stage adds to as each shard is finalized.
COMMITTED_PROMPTS = "committed_prompts"
COMMITTED_OUTPUT_TOKENS = "committed_output_tokens"
COMMITTED_SHARD_BYTES = "committed_shard_bytes"
# Committed records with each quality flag (common/quality.py): this prefix + the flag.
COMMITTED_FLAG_PREFIX = "committed_flag:"
# Committed records by the SGLang version of their server: this prefix + the version.
COMMITTED_SERVER_VERSION_PREFIX = "committed_server_version:"

STAGES = ("input", "generate", "tokenize")


def check_job_name(job: str) -> str:
    if not JOB_NAME_RE.match(job):
        raise ValueError(
            f"invalid job name {job!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return job


def _job(job: str, suffix: str) -> str:
    return f"{PREFIX}:job:{job}:{suffix}"


def job_spec(job: str) -> str:
    """String: the job spec as JSON."""
    return _job(job, "spec")


def job_provenance(job: str) -> str:
    """String: what made the job, as JSON (common/provenance.py); set once."""
    return _job(job, "provenance")


def job_refusals(job: str) -> str:
    """Hash: worker -> why it refuses the job (its tokenizer differs:
    common/tokenizer_refusals.py)."""
    return _job(job, "refusals")


def job_ids(job: str, bucket: int) -> str:
    """Hash: one bucket of every prompt id ever enqueued in the job, stored id -> 1
    (common/ledger/id_buckets.py; the job spec's `id_buckets` says how many)."""
    return _job(job, f"ids:{bucket}")


def job_cursors(job: str) -> str:
    """Hash: dataset file fingerprint -> rows already resolved (resume point)."""
    return _job(job, "cursors")


def job_counters(job: str) -> str:
    """Hash: job counters: enqueued and requeued (producer, requeue), dlq_purged (purge),
    ids (ids in the job), committed_index (ids claimed or committed), committed_prompts,
    committed_output_tokens and committed_shard_bytes (shard finalize)."""
    return _job(job, "counters")


def job_chunks(job: str) -> str:
    """Hash: chunk id -> number of prompts, for every chunk ever published."""
    return _job(job, "chunks")


def chunk_attempts(job: str, chunk_id: str) -> str:
    """List: JSON {worker, time, status, error}, one per delivery of the chunk that
    started; the last one holds the chunk's lease (consumers/generate/chunk_life/lease.py)."""
    return _job(job, f"attempts:{chunk_id}")


def chunk_writes(job: str, chunk_id: str) -> str:
    """String: how many writes the chunk's current delivery made under its lease, set to
    0 when a delivery starts; a count lower than the worker's own means Redis lost some
    (restored from an older copy: consumers/generate/chunk_life/lease.py)."""
    return _job(job, f"writes:{chunk_id}")


def chunk_generated(job: str, chunk_id: str) -> str:
    """Set: prompt ids of a chunk whose results are already handed to the tokenize stage."""
    return _job(job, f"chunk:{chunk_id}:generated")


def conversation_answers(job: str, chunk_id: str, conversation_id: str) -> str:
    """Hash: turn -> JSON of the target's answer (its assistant message) for a
    conversation of a chunk, regenerated turn by turn (`--turns all`), written with each
    turn's hand-off: the checkpoint a redelivery of the chunk resumes the conversation
    from. Deleted with the hand-off of the last turn or when the conversation is
    dead-lettered (the dead letter holds the history), and it expires with the chunk's
    `generated` set: it exists only while its chunk is in the job's window. Per chunk, so
    a requeued turn (a new chunk) never touches the checkpoint of another."""
    return _job(job, f"chunk:{chunk_id}:conversation:{conversation_id}:answers")


def recovered_answers(job: str) -> str:
    """Hash: turn id -> JSON of its answer (the assistant message its record ends with),
    for committed turns of conversations Redis lost whole (`--turns all`): written by
    `regen recover` from the shards, read by the job's enqueue to resume each such
    conversation after its committed turns, which drops a conversation's fields once it
    is in a chunk again (producer/lost_turns.py). Expires: defaults.RECOVERED_ANSWERS_TTL_S."""
    return _job(job, "recovered_answers")


def results_stream(job: str) -> str:
    """Stream: one entry per generated result, consumed by the tokenize stage."""
    return _job(job, "results")


def committed(job: str, bucket: int) -> str:
    """Hash: one bucket of the exactly-once index, stored id -> shard that holds its
    record, or that claims it while the shard is pending (common/ledger/id_buckets.py; the
    shard as its number when it has a regular name, common/ledger/commit_ledger.py)."""
    return _job(job, f"committed:{bucket}")


def pending_shards(job: str) -> str:
    """Hash: shard name -> JSON of a shard being written (claims not yet final)."""
    return _job(job, "shards:pending")


def shards(job: str) -> str:
    """Hash: shard name -> JSON manifest row of a shard in place."""
    return _job(job, "shards")


def job_progress(job: str) -> str:
    """List: JSON [server time, committed prompts, committed output tokens] at each shard
    commit, newest first and capped: the samples `regen status` takes rates from."""
    return _job(job, "progress")


def shard_seq(job: str) -> str:
    """Counter: the next shard number of the job."""
    return _job(job, "shards:seq")


def job_epoch(job: str) -> str:
    """Integer: the generation of the job's commit ledger. Set to 1 at the job's first
    shard and raised by `regen recover`; each manifest line records the epoch it was
    written under, so a Redis older than the shards (a restored copy) shows."""
    return _job(job, "epoch")


def job_behind(job: str) -> str:
    """String: set by a tokenize worker that found Redis behind the job's shard folder,
    until the recovery it runs (consumers/tokenize/recover.py) deletes it. The job's follower
    (`regen enqueue --follow`) forgets no id and queues nothing while it is set."""
    return _job(job, "behind")


def job_recover_lock(job: str) -> str:
    """String with an expiry: the tokenize worker running the job's recovery holds it
    (consumers/tokenize/self_recovery.py), so that workers finding Redis behind at once
    run it once."""
    return _job(job, "recover:lock")


def job_publishing(job: str) -> str:
    """String with an expiry: set while a `regen enqueue` reads and publishes the job's
    rows (producer/publishing_mark.py), so its queue is not all that is left of it."""
    return _job(job, "publishing")


def job_paused(job: str) -> str:
    """String: set while the job is paused (`regen pause`), "paused" or "now"
    (common/job_pause.py); workers take none of its prompts."""
    return _job(job, "paused")


def job_follower(job: str) -> str:
    """String with an expiry: JSON of the job's live follower (`regen enqueue --follow`),
    renewed at each of its passes; `regen status` flags an unfinished job without one."""
    return _job(job, "follower")


def dlq(job: str, stage: str) -> str:
    """Hash: entry id -> JSON dead-letter entry of one stage."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    return _job(job, f"dlq:{stage}")


def dlq_purged(job: str) -> str:
    """Set: prompt ids whose dead letters were purged for good: their last place, so
    `regen verify` can tell them from lost ones."""
    return _job(job, "dlq:purged")


def generate_queue(job: str) -> str:
    """Default Celery queue (a Redis list of the same name) of a job's chunks."""
    return f"{PREFIX}.generate.{job}"


def job_of_queue(queue: str) -> str | None:
    """The job a default generate queue is named after (generate_queue's inverse)."""
    prefix = generate_queue("")
    job = queue[len(prefix) :] if queue.startswith(prefix) else ""
    return job if JOB_NAME_RE.match(job) else None


TOKENIZE_GROUP = "tokenize"
