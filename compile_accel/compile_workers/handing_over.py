"""Handing graphs to the compile workers: a region's graph at its compile (`compile_in_workers`),
one torch's aot_compile precompiles (`precompile_in_workers`), and a graph auto traced once and
compiles at each candidate budget (`TracedGraph`: `run_in_worker`, `hand_over`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch

from ..checkpointing import keep_saved_tensors
from ..dynamo_settings import HAS_EAGER_BACKWARD_KNOB
from ..stats import Stats, warn
from .graphs import WorkerGraph, compile_packed_here
from .packing import GraphPickler, job, pack_graph, runtime_state
from .pool import POOL, WorkersExited, compiles_here
from .worker import cache_env, compile_in_worker, compile_job, precompile_in_worker

try:  # torch >= 2.8
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache, should_use_local_autograd_cache
except ImportError:
    AOTAutogradCache = None

logger = logging.getLogger("compile_accel")

# A worker writes AOTAutograd's cache entry only once it compiled the backward too: it needs
# AOTAutograd's knob for compiling the backward with the forward.
SUPPORTED = GraphPickler is not None and hasattr(AOTAutogradCache, "try_load") and HAS_EAGER_BACKWARD_KNOB
UNSUPPORTED_WHY = "needs torch's graph pickler and AOTAutograd's cache (torch >= 2.8)"
# A graph's look-up in the caches before its hand-over costs the step AOTAutograd's cache key.
# After this many misses in a row (a cold cache) graphs go to the workers without it, where one the
# caches hold is a quick hit, until a graph is found in them again: a cold first step spends less
# than half as long in AOTAutograd (benchmarks/results/h200_first_step_timeline/README.md).
MISSES_BEFORE_COLD = 4


class _NotCached(BaseException):
    """AOTAutograd's cache has no entry for the graph (raised instead of compiling it; not an
    Exception, which torch's cache lookup would take for a failure and compile anyway)."""


@contextlib.contextmanager
def _only_from_cache() -> Iterator[None]:
    """Inside: a compile whose graph AOTAutograd's cache does not hold raises _NotCached."""
    try_load = AOTAutogradCache.try_load

    def load_or_raise(*args: Any, **kwargs: Any) -> Any:
        loaded = try_load(*args, **kwargs)
        # (torch 2.13 returns the compiled function with AOTAutograd's config, earlier ones alone.)
        if (loaded[0] if isinstance(loaded, tuple) else loaded) is None:
            raise _NotCached
        return loaded

    with mock.patch.object(AOTAutogradCache, "try_load", staticmethod(load_or_raise)):
        yield


class WorkerPrecompiled:
    """A graph that torch's aot_compile handed to the compile workers (`precompile_in_workers`):
    it serializes as what the worker returns, waiting for it, and loads as torch's own bundled
    graphs do. It does not run here."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    @classmethod
    def serialize_compile_artifacts(cls, fn: WorkerPrecompiled) -> bytes:
        POOL.wait_all([fn.future])  # (a pool whose process is gone fails it: the graph is left out)
        return fn.future.result()

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Any:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

        return BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(data)

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError("a graph precompiled in a compile worker runs once saved and loaded")


def precompile_in_workers(gm: torch.fx.GraphModule, example_inputs: list[Any], compiler: Callable) -> WorkerPrecompiled:
    """What the precompile backend returns for `gm` (inside torch's aot_compile, whose settings
    the worker compiles under): the graph handed to a worker. RuntimeError for a graph that
    cannot go (symbolic shapes, a tensor subclass that is no traceable wrapper, an op the pickler refuses)."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    SerializableCallable.register(WorkerPrecompiled)  # what aot_compile takes
    with keep_saved_tensors():
        packed = pack_graph(gm, example_inputs)
    if isinstance(packed, str):
        raise RuntimeError(f"cannot hand the graph to a compile worker: {packed}")
    return WorkerPrecompiled(POOL.submit(precompile_in_worker, job(packed, compiler), cache_env()))


@dataclass
class TracedGraph:
    """A graph dynamo traced, packed for a worker at its trace (`pack_traced`): auto's traced
    step (compile_accel.saved_bytes) runs it uncompiled while a worker partitions it at every
    candidate (`run_in_worker`), and the budget auto then picks compiles it in a worker
    (`hand_over`) without dynamo tracing it again."""

    gm: torch.fx.GraphModule
    packed: bytes
    state: dict[str, Any]  # grad mode, autocast, ... at the trace
    label: str


def pack_traced(gm: torch.fx.GraphModule, example_inputs: list[Any], label: str) -> TracedGraph | None:
    """`gm` packed as it is now, before anything compiles it (None: it cannot go to a worker)."""
    if not should_use_local_autograd_cache():
        return None
    with keep_saved_tensors():
        packed = pack_graph(gm, example_inputs)
    return None if isinstance(packed, str) else TracedGraph(gm, packed, runtime_state(), label)


def _submitted(work: Callable, graph: TracedGraph, compiler: Callable) -> concurrent.futures.Future:
    """`work` (a worker's function) on a traced graph's compile job, under the settings in force
    now; a future holding the error where no pool could take it."""
    try:
        return POOL.submit(work, job(graph.packed, compiler, graph.state), cache_env())
    except Exception as error:  # a setting that does not pickle; no pool could start
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(error)
        return future


def run_in_worker(graph: TracedGraph, compiler: Callable) -> concurrent.futures.Future:
    """What `compiler` returns for a traced graph (picklable), from a worker."""
    return _submitted(compile_job, graph, compiler)


def run_here(graph: TracedGraph, compiler: Callable) -> Any:
    """What `compiler` returns for a traced graph, in this process as a worker would run it (from
    its packed form, under the state of its trace)."""
    return compile_packed_here(graph.packed, compiler, graph.state)


def hand_over(
    graph: TracedGraph, compiler: Callable, compile_here: Callable, stats: Stats, cuda_graphs: bool
) -> WorkerGraph:
    """A traced graph's compile under the settings in force now, handed to a worker; the graph
    runs uncompiled under a checkpoint until it is back (arguments as `compile_in_workers`). A
    graph no pool takes counts as one whose worker failed: compiled here at its next call."""
    future = _submitted(compile_in_worker, graph, compiler)
    stats.worker_graphs_started += 1
    return WorkerGraph(graph.gm, graph.packed, compile_here, future, stats, graph.label, True, graph.state, cuda_graphs)


def compile_in_workers(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    compiler: Callable,
    compile_here: Callable[[torch.fx.GraphModule, list[Any]], Callable],
    stats: Stats,
    label: str,
    checkpointed: bool,
    cuda_graphs: bool = False,
) -> Callable:
    """What a region's backend returns for `gm` with workers (`start` first): the graph loaded
    from the caches if they hold it, else a WorkerGraph whose worker compiles it. Once the caches
    missed MISSES_BEFORE_COLD graphs in a row, graphs are handed over without the look-up.

    compiler: the backend a worker compiles with (picklable), under the settings in force now.
    compile_here(gm, inputs): compiles in this process with those settings. checkpointed: run
    the graph under a non-reentrant checkpoint until it is compiled. cuda_graphs: `compiler`
    records CUDA graphs."""
    if not should_use_local_autograd_cache():
        warn(f"{label} compiles in this process: compile workers need AOTAutograd's local cache, which is off")
        return compile_here(gm, example_inputs)
    # Packed before anything compiles: inductor's pre-grad passes may rewrite gm in place.
    with keep_saved_tensors():
        packed = pack_graph(gm, example_inputs)
    if POOL.misses_in_a_row < MISSES_BEFORE_COLD:
        try:
            with _only_from_cache():
                compiled = compile_here(gm, example_inputs)
        except _NotCached:
            POOL.misses_in_a_row += 1
            if POOL.misses_in_a_row == MISSES_BEFORE_COLD:
                logger.info("the caches held none of the last %d graphs: the next ones go to the compile workers "
                            "without a look-up here", MISSES_BEFORE_COLD)
        else:
            POOL.misses_in_a_row = 0
            return compiled
    try:
        if isinstance(packed, str):
            raise RuntimeError(packed)
        state = runtime_state()
        future = POOL.submit(compile_in_worker, job(packed, compiler, state), cache_env())
    except Exception as error:  # a graph or setting that does not pickle; no pool could start, or it exited
        compiles_here(f"{label} could not be handed to a compile worker ({error}); it compiles in this process",
                      isinstance(error, WorkersExited))
        return compile_here(gm, example_inputs)
    stats.worker_graphs_started += 1
    return WorkerGraph(gm, packed, compile_here, future, stats, label, checkpointed, state, cuda_graphs)
