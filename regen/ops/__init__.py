"""What only the operator commands use: `regen status` (status_snapshot, accounting),
`regen verify` (reconcile, reconcile_shards, locate), `regen shards` (shards_inspect) and
`regen dlq requeue` (requeue). The stages never import from here; these modules read the
stages' stored state through the modules that own it (the commit ledger, the shard files).
"""
