"""What only the operator commands use: `regen status` (status_snapshot reads a job,
status_view draws it), `regen verify` (reconcile, reconcile_shards), `regen shards`
(shards_inspect, exports) and `regen dlq requeue` (requeue). No stage imports from here
(tests/contracts/test_layout.py); these modules read exactly-once state through
common/ledger/ and the shard files through the tokenize stage's face
(consumers/tokenize/operator_view.py).
"""
