"""Python's cyclic garbage collector, tuned once in each process that reads and stages records:
every engine's (the Spark driver and the Spark Python workers that run its batches' tasks, the
continuous engine, the direct replay).

A batch allocates a few objects per record that live until it commits (the record's tuple, its
stage line, its transaction group): hundreds of thousands a second. At Python's default
thresholds (700, 10, 10) a collection ran every few hundred records, and each full one walked
every object in memory: on the continuous engine 8 % of a ``per_key`` mirror's time through a
backlog and 12 % of a ``whole`` one's (``bench/cdc_throughput.py``, two runs each way). Nothing
the stream makes depends on the collector but for the reference cycles it leaves behind, which
:data:`THRESHOLDS` still reach.
"""

from __future__ import annotations

import gc

THRESHOLDS = (100_000, 50, 1000)  # generations 0, 1 and 2

_tuned = False


def tune() -> None:
    """Once per process (later calls do nothing): collects, freezes what the process made so far
    (its modules, the pipeline's spec), which no full collection then walks again, and sets
    :data:`THRESHOLDS`."""
    global _tuned
    if _tuned:
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    _tuned = True
