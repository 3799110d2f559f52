"""The cyclic garbage collector's settings for regen's long-running processes.

CPython frees most objects by reference counting; the cyclic collector runs on top,
every 700 new container objects by default, and each run walks every young object still
alive. A generate worker keeps hundreds of prompts in flight, each with its request,
task, future and response objects alive across many such runs, so with the defaults
about a fifth of the worker's CPU went to the collector (bench/cpu_per_prompt.py,
measured with gc.callbacks), nearly all of it finding nothing to free. Collecting every
50,000 objects instead lets most of them die of reference counting before a run sees
them; freezing what start-up made (modules, the tokenizer, the engine) keeps it out of
every later full collection. Garbage in cycles is still collected, in larger batches.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# (young objects between collections, young collections per middle one, middle per full)
THROUGHPUT_THRESHOLDS = (50_000, 20, 20)


def tune_for_throughput() -> None:
    """Call once start-up is done: collect, freeze what is left, collect less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THROUGHPUT_THRESHOLDS)
    log.debug(
        "gc: %d start-up objects frozen, thresholds %s", gc.get_freeze_count(), gc.get_threshold()
    )
