"""The end of a training run's first step: what the sd-scripts launcher and the bench both do
once its backward is done, in the one order that works."""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import compile_workers
from .api import Acceleration
from .compile_cache import RunCompileCache
from .gc_freeze import freeze_after_first_step


@dataclass
class FirstStepEnd:
    saved_bytes: int  # the run's compiled-graph cache file (0: not written, or no cache)
    frozen: int | None  # objects frozen out of the garbage collector's passes (None: nothing compiled)
    freeze_s: float


def end_first_step(acceleration: Acceleration, run_cache: RunCompileCache | None) -> FirstStepEnd:
    """After the first step (and after `compile_workers.wait_and_load` where the first step waits
    for the compile workers): save the run's compiled-graph cache while the worker pool is still
    up, since it precompiles the graphs for the next start; let the pool stop once its graphs are
    back; then freeze what compiling left out of the garbage collector's full passes."""
    saved = run_cache.save() if run_cache is not None else 0
    compile_workers.first_step_done()
    start = time.perf_counter()
    frozen = freeze_after_first_step(acceleration)
    return FirstStepEnd(saved, frozen, time.perf_counter() - start)
