"""Whole compiles in worker processes, while the step runs the graphs uncompiled.

Cold, a first step is dynamo's trace, then per graph AOTAutograd's joint trace and min-cut
partition and inductor's code generation, one graph after another in the training process while
the step waits.

With `CompileConfig.compile_workers = N`, the training process only traces: each graph dynamo
hands to the region's backend goes, with fake stand-ins for its inputs, to one of N worker
processes, which compile it as this process would (AOTAutograd and inductor, under the same
settings) into inductor's and AOTAutograd's caches. Until it is back, the graph runs as traced,
in eager PyTorch (under a non-reentrant checkpoint where a budget replaced the block's own
checkpointing, so that it saves no more than the block did; a checkpoint traced inside it runs as
one too, graphs._eager_checkpoint). At its first call after the worker
is done, the graph is compiled here, from those caches (AOTAutograd cache hit: seconds, no
tracing), and runs compiled from then on. So the first step does not wait for AOTAutograd or
inductor, and the graphs of every block class compile at the same time. A trainer that wants
every step after the first compiled calls `wait_and_load` at the end of the first step instead:
that step then waits for the slowest graph.

Each worker gets ready as it starts (`worker.get_ready`: inductor imported, its kernel-compile pool
started), so that the pool is best started before the model's set-up (`start`; the sd-scripts
launcher does at the flags' parse); `stop` ends it where nothing will compile after all.

A graph already in the caches (a restart) is not handed over: it loads here as without
workers. A graph the caches cannot hold (AOTAutograd bypasses them: torch logs why), or whose
compile in the worker failed, compiles here at its first call after, with a warning.

The package, imported in this order: `packing` (a graph as bytes, and its compile from them),
`worker` (what runs in a worker), `pool` (the workers' pool, POOL), `graphs` (the graphs handed
over, HANDED_OVER), `handing_over` (the ways a graph is handed over).
"""

from __future__ import annotations

from .graphs import (
    HANDED_OVER,
    GraphState,
    WorkerGraph,
    compiling,
    graphs_switched,
    hold_switches,
    pending,
    run_uncompiled,
    step_started,
    wait,
    wait_and_load,
    wait_refusal,
)
from .handing_over import (
    MISSES_BEFORE_COLD,
    SUPPORTED,
    UNSUPPORTED_WHY,
    TracedGraph,
    WorkerPrecompiled,
    compile_in_workers,
    hand_over,
    pack_traced,
    precompile_in_workers,
    run_here,
    run_in_worker,
)
from .pool import POOL, SPAWNED_POOL, WorkersExited
from .worker import WorkerCompile


def start(count: int) -> None:
    """Start the pool of `count` compile workers now, so that it is up by the first step (a later
    count is ignored; more than the CPU cores is that many, with a warning)."""
    POOL.start(count)


def stop() -> None:
    """Stop the pool now, if one runs (a run that compiles nothing after all: the sd-scripts
    launcher falling back to eager after it started the workers)."""
    POOL.stop()


def running() -> bool:
    """Whether the worker pool is up: from `start` or the first graph handed over until no job is
    out, nobody keeps it (`keep_running`) and the first step is done."""
    return POOL.running()


def first_step_done() -> None:
    """Say that the training's first step is done (the launcher and the bench do): the pool stops
    now if no job is out (and nobody keeps it), else as soon as the last one is back, freeing the
    GPU memory its workers hold. A graph after that (new input shapes) starts a new pool."""
    POOL.first_step_done()


def keep_running(holder: object, kept: bool) -> None:
    """While kept for some holder (held weakly), the pool does not stop when nothing is out in it
    (auto keeps it between its partitions' return and the next step's hand-over of a candidate's
    graphs: a new pool takes seconds to start)."""
    POOL.keep_running(holder, kept)


__all__ = [
    "HANDED_OVER",
    "MISSES_BEFORE_COLD",
    "POOL",
    "SPAWNED_POOL",
    "SUPPORTED",
    "UNSUPPORTED_WHY",
    "GraphState",
    "TracedGraph",
    "WorkerCompile",
    "WorkerGraph",
    "WorkerPrecompiled",
    "WorkersExited",
    "compile_in_workers",
    "compiling",
    "first_step_done",
    "graphs_switched",
    "hand_over",
    "hold_switches",
    "keep_running",
    "pack_traced",
    "pending",
    "precompile_in_workers",
    "run_here",
    "run_in_worker",
    "run_uncompiled",
    "running",
    "start",
    "step_started",
    "stop",
    "wait",
    "wait_and_load",
    "wait_refusal",
]
