"""The collector settings of regen's long-running processes (common/gc_tuning.py)."""

from __future__ import annotations

import gc

from regen.common.gc_tuning import THROUGHPUT_THRESHOLDS, tune_for_throughput


def test_start_up_objects_are_frozen_and_collections_are_rarer() -> None:
    before = gc.get_threshold()
    # From CPython's defaults (an in-process `regen enqueue` in another test tunes too).
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    try:
        tune_for_throughput()
        assert gc.get_threshold() == THROUGHPUT_THRESHOLDS
        assert gc.get_freeze_count() > 0
        collected_before = gc.get_stats()[0]["collections"]
        garbage = [[] for _ in range(THROUGHPUT_THRESHOLDS[0] // 2)]  # half a batch
        del garbage
        assert gc.get_stats()[0]["collections"] == collected_before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
