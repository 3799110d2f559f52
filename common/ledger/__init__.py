"""Exactly-once state: what proves, in Redis, where each of a job's prompt ids is
(docs/design/exactly-once.md, Exactly-once commits and Accounting). A change to what "enqueued" or
"committed" means starts and ends here.

Each module, the keys it holds (common/keys.py) and who writes them:
- `job_ids.py`: the job's ids (`job_ids`, the `ids` counter), written by its
  `ADD_IDS_LUA` inside the producer's publish transaction (producer/publish.py) and by
  `JobIds.add`/`remove`; `reread_from_start` drops the enqueue cursors (`job_cursors`,
  which the publish transaction moves).
- `commit_ledger.py`: what is committed (`committed`, through `committed_index.py`),
  the shards pending and in place (`pending_shards`, `shards`), the job's progress,
  shard counter and epoch (`job_progress`, `shard_seq`, `job_epoch`) and the
  `committed_*` counters; `CommitLedger`'s scripts are their only writer, for the
  tokenize stage's writer and `regen recover`. A commit drops its ids' dead letters.
- `places.py`: where each id is (waiting, in flight, done, dead-lettered, purged), for
  `regen status`, `regen verify`, the job's follower and the tokenize stage's job end;
  it reads all of the above, the queues, kombu's `unacked`, the results stream and the
  DLQs, and writes only through `JobIds` (`forget_missing`).
- `id_buckets.py`: the bucketed hashes the job's ids and the committed index live in;
  `shard_names.py`: a shard's name and its number in the ledger.

A chunk's own marks (`chunk_generated`, `chunk_attempts`, `chunk_writes`) belong to the
generate stage's chunk life (consumers/generate/chunk_life/), which writes them during a
delivery; outside one, only common/conversation.py's `checkpoint_settled` marks a
chunk's settled turns generated (for `regen recover` and the job's enqueue).
Nothing in this package imports a stage: the producer, the stages and the operator
commands import it.
"""
