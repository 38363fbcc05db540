"""Python's garbage collector after the first step.

Compiling leaves hundreds of thousands of long-lived Python objects (dynamo's and inductor's
caches, FX graphs, kernel wrappers), beside the trainer's own. Python's full collection walks
every tracked object, so each one that comes later takes about a step's time, at a step nobody
chooses (benchmarks/results/h200_step_after_wait/README.md). Freezing what is alive after the first
step, as servers do after their start-up, takes those objects out of every later collection: they
are still freed when their last reference goes, but a reference cycle through them is only
collected after `gc.unfreeze()`.
"""

from __future__ import annotations

import gc

from .api import Acceleration


def freeze_after_first_step(acceleration: Acceleration) -> int | None:
    """If `acceleration` compiled anything (here or in the compile workers): collect the garbage
    there is now, then freeze every object Python's collector tracks (`gc.freeze`), and return
    how many objects are frozen in all; None, the collector untouched, when it compiled nothing.
    For a trainer's loop, after its first step; a second call freezes what came since."""
    stats = acceleration.stats()
    if not (stats["unique_graphs"] or stats["worker_graphs_started"]):
        return None
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
