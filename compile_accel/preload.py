"""Inductor's compiler imported in a background thread while the program sets up.

The first graph a process compiles or loads imports inductor's code generation (lowerings,
kernel templates, decompositions) and hashes Triton's sources for inductor's cache keys: in a
warm start of sd-scripts' Lumina 2 on an H200, most of the 3.0 s it took to load the
precompiled graphs (compile_accel.precompile; benchmarks/results/h200_warm_start/), all of it
in the first step. None of it depends on the model, so `start_preloading()` does it in a
thread beside what a trainer does before its first step (reading the weights, building the
model and the optimizer). The sd-scripts launcher starts it once the script's own imports are
done, the bench's child before it builds the model; `apply()` waits for it first
(`wait_for_preload`), so that no two threads import inductor's modules at once (an import
cycle between two threads can leave one a half-initialised module).

(A thread started at apply() was tried before: with no set-up left to overlap, it ran beside
the first step's dynamo trace and slowed it more than it saved.)
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("compile_accel")

_thread: threading.Thread | None = None


def _preload() -> None:
    try:
        import torch._inductor.compile_fx  # noqa: F401  (the lowerings and kernel templates come with it)
        from torch.utils import _triton

        hash_triton = getattr(_triton, "triton_hash_with_backend", None)  # cached by torch
        if hash_triton is not None and _triton.has_triton():
            hash_triton()
    except Exception as error:  # the first compile imports it again and raises with its traceback
        logger.debug("preloading inductor failed: %s: %s", type(error).__name__, error)


def start_preloading() -> None:
    """Import inductor's compiler in a background thread (once per process)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_preload, name="compile_accel-preload", daemon=True)
        _thread.start()


def wait_for_preload() -> None:
    """Return once the preload started by `start_preloading` is done (at once if none was)."""
    if _thread is not None:
        _thread.join()
