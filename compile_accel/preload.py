"""Inductor's compiler imported in a background thread while the program sets up.

The first graph a process compiles or loads imports inductor's code generation (lowerings,
kernel templates, decompositions) and hashes Triton's sources for inductor's cache keys: most of
a warm start's load of the precompiled graphs (compile_accel.precompile), all of it in the first
step (benchmarks/results/h200_warm_start/README.md). None of it depends on the model, so
`start_preloading()` does it in a thread beside what a trainer does before its first step (reading
the weights, building the model and the optimizer).
The sd-scripts launcher starts it once the training script's flags ask for a compile, the
bench's child before it builds a compiled mode's model. `apply()` waits for it before compile_accel
touches inductor, so that compile_accel's own imports never run beside the preload's (an import
cycle between two threads can leave one a half-initialised module); a program that compiles
with torch.compile itself before apply() calls `wait_for_preload()` first.

The thread touches no GPU: Triton's source hash is its own (`triton_key`), not the one with
the GPU's target, which would initialise CUDA in this thread.

(Not started at apply(): with no set-up left to overlap, the thread runs beside the first step's
dynamo trace and slows it more than it saves.)
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("compile_accel")


class _Preload:
    """The process's one preload thread (PRELOAD), started at most once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None


PRELOAD = _Preload()


def preload_inductor() -> None:
    """Import inductor's compiler and hash Triton's sources, here (the compile workers do it
    first thing too). An error is left to the first compile, which raises it with its traceback."""
    try:
        import torch._inductor.compile_fx  # noqa: F401  (the lowerings and kernel templates come with it)
        from torch.utils._triton import has_triton_package

        if has_triton_package():
            from torch._inductor.runtime.triton_compat import triton_key

            triton_key()  # cached by Triton: inductor's cache keys read it from here on
    except Exception as error:
        logger.debug("preloading inductor failed: %s: %s", type(error).__name__, error)


def start_preloading() -> None:
    """Import inductor's compiler in a background thread (once per process). Call it where the
    program starts its set-up, under `if __name__ == "__main__":` (a spawned DataLoader worker
    runs the module's top level again)."""
    with PRELOAD.lock:
        if PRELOAD.thread is None:
            PRELOAD.thread = threading.Thread(target=preload_inductor, name="compile_accel-preload", daemon=True)
            PRELOAD.thread.start()


def wait_for_preload() -> None:
    """Return once the preload started by `start_preloading` is done (at once if none was)."""
    thread = PRELOAD.thread
    if thread is not None:
        thread.join()
