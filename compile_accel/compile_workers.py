"""Inductor's code generation in worker processes, while the step runs the graphs uncompiled.

Cold, most of a first step is inductor's Python work on each graph (lowering, scheduling, code
generation: 10-20 s per block class on an H100, benchmarks/results/h100_compile_profile/), done
one graph after another in the training process while the step waits.

With `CompileConfig.compile_workers = N`, each graph AOTAutograd hands to inductor goes to one of
N worker processes instead, through torch's own out-of-process compile
(torch._inductor.compile_fx_ext pickles the graph, its fake example inputs and inductor's
settings; the worker runs inductor's `codegen_and_compile`). Dynamo's trace, AOTAutograd's joint
trace and the min-cut partition still run here. Until its compiled graph is back, a graph runs
as traced: its aten ops uncompiled, as torch's aot_eager backend runs them, saving what the
partition saves. The first call after the worker is done switches to the compiled graph. So the
first step does not wait for inductor, and the graphs of every block class, forward and
backward, compile at the same time.

Caches: inductor saves a graph to its FX graph cache right after compiling it; a graph compiled
in a worker is saved when it arrives (with the cache key and guards of its compile here), so a
restart loads it as it loads one compiled in process. A restart before it arrived compiles it
again. torch's subprocess pool passes file descriptors to its children: not on Windows.

GPU memory: a worker that compiled a graph holds a CUDA context of its own (~520 MiB each on an
H100, torch 2.11: its fake CUDA tensors and the kernels it loads), outside the training
process's memory. The pool stops once every graph handed to it is back and the first step is
done (`first_step_done`; before that, after 60 s without a graph), which frees that memory; a
later graph (new input shapes) starts a new pool.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable
from unittest import mock

import torch
import torch._inductor.config
from torch._functorch.aot_autograd import make_boxed_func

from .saved_bytes import cudnn_attention_gradients_laid_out
from .stats import Stats, warn

try:  # torch's out-of-process compile (torch >= 2.8)
    from torch._inductor.compile_fx_subproc import _SubprocessFxCompile
    from torch._inductor.output_code import OutputCode
except ImportError:
    _SubprocessFxCompile = None
    OutputCode = object

logger = logging.getLogger("compile_accel")

SUPPORTED = _SubprocessFxCompile is not None and sys.platform != "win32"
UNSUPPORTED_WHY = (
    "needs torch's out-of-process compile (torch >= 2.8) and its subprocess pool, which does not run on Windows"
)

# Never taken on the pool's reader thread: it runs the futures' callbacks while holding the
# pool's own lock, which submit() takes.
_lock = threading.Lock()
_count = 0  # the pool's size, from the first apply() that asked for workers
_pool: Any = None  # up from start() or the first graph handed over until idle (_stop_if_idle)
_out: list[concurrent.futures.Future] = []  # the running pool's graphs not yet back
_unswitched: list[WorkerCompiledGraph] = []  # handed to the workers, not yet running compiled
_first_step_done = False  # set by first_step_done(), for the rest of the process
_last_back = 0.0  # time.monotonic() when a graph last came back
# Until the first step is done, an idle pool waits this long for more graphs: a first step hands
# its graphs over in waves (sd-scripts' SDXL: 40 s apart on an H100, as dynamo and AOTAutograd
# reach the next blocks, or the backward's), and a new pool takes seconds to start.
IDLE_SECONDS_BEFORE_FIRST_STEP_DONE = 60.0


def start(count: int) -> None:
    """Start the pool of `count` compile workers now, so that it is up by the first step (a later
    count is ignored). Each worker's inductor compiles its kernels with its share of the CPU
    cores, so N workers do not start N full kernel-compile pools."""
    global _count
    with _lock:
        _count = _count or count
        _running_pool()


def _running_pool() -> Any:
    # Called with _lock held.
    global _pool
    if _pool is not None and not getattr(_pool, "running", True):  # its workers exited
        atexit.unregister(_pool.shutdown)
        _pool = None
    if _pool is None:
        from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool

        threads = str(max(1, (os.cpu_count() or 1) // _count))
        # Read by each worker's inductor when it is imported there; the pool's processes take the
        # environment as it is now.
        with mock.patch.dict(os.environ, {"TORCHINDUCTOR_COMPILE_THREADS": threads}):
            _pool = SubprocPool(_count, kind=SubprocKind.SPAWN)
        atexit.register(_pool.shutdown)
        logger.info("started %d compile workers", _count)
    return _pool


def _submit(*args: Any) -> concurrent.futures.Future:
    """Hand one graph's compile to the pool (started again if it was shut down)."""
    with _lock:
        future = _running_pool().submit(*args)
        _out.append(future)
    future.add_done_callback(_back)
    return future


def _back(_: concurrent.futures.Future) -> None:
    # On the pool's reader thread, so no _lock here: the idle check runs on a timer's thread.
    global _last_back
    _last_back = time.monotonic()
    idle_seconds = 0.0 if _first_step_done else IDLE_SECONDS_BEFORE_FIRST_STEP_DONE
    timer = threading.Timer(idle_seconds, _stop_if_idle, args=(_pool, idle_seconds))
    timer.daemon = True
    timer.start()


def first_step_done() -> None:
    """Say that the training's first step is done (the launcher and the bench do): the pool stops
    now if no graph is out, else as soon as the last one is back, freeing the GPU memory its
    workers hold. A graph after that (new input shapes) starts a new pool."""
    global _first_step_done
    _first_step_done = True
    _stop_if_idle(_pool, 0.0)


def _stop_if_idle(pool: Any, idle_seconds: float) -> None:
    """Shut `pool` down if it is still the pool, no graph is out in it, and none came back in the
    last `idle_seconds` (a later graph's own timer checks again)."""
    global _pool
    with _lock:
        _out[:] = [future for future in _out if not future.done()]
        # (A timer may fire a hair early: 10 ms of slack.)
        if pool is None or pool is not _pool or _out or time.monotonic() - _last_back < idle_seconds - 0.01:
            return
        _pool = None
    atexit.unregister(pool.shutdown)
    # In a thread of its own: shutdown() joins the pool's reader thread.
    threading.Thread(target=pool.shutdown, name="compile_accel-workers-shutdown", daemon=True).start()
    logger.info("no graph is out in the compile workers: workers stopped, their GPU memory freed")


def running() -> bool:
    """Whether the worker pool is up: from `start` or the first graph handed over until no graph
    is out and the first step is done (before that, after 60 s without one)."""
    with _lock:
        return _pool is not None


def pending() -> int:
    """Graphs (of every model in this process) handed to the workers and not yet running
    compiled: still compiling, or back and switched to at their next call."""
    with _lock:
        _unswitched[:] = [graph for graph in _unswitched if graph.future is not None]
        return len(_unswitched)


def wait() -> int:
    """Wait until the workers are done with every graph handed to them; returns `pending()` as it
    was before (not 0: the next call of those graphs switches to the compiled ones)."""
    waiting = pending()
    with _lock:
        futures = [graph.future for graph in _unswitched if graph.future is not None]
    concurrent.futures.wait(futures)
    return waiting


class WorkerCompiledGraph(OutputCode):
    """Inductor's output for a graph compiled in a worker: runs the graph uncompiled until the
    worker's compiled graph is back, then that. A worker's error is warned about once and the
    graph stays uncompiled (counted in the stats' `worker_failures`)."""

    def __init__(
        self, uncompiled: Callable, future: concurrent.futures.Future, unpack: Callable, stats: Stats, label: str
    ) -> None:
        # Called with the inputs in a list, as inductor's compiled graphs are. An instance attribute:
        # the wrapper dynamo puts around a backward copies the instance's, not the class's.
        self._boxed_call = True
        self._run = uncompiled
        self.future: concurrent.futures.Future | None = future
        self._unpack = unpack
        self._stats = stats
        self._label = label
        self._post_compile: tuple | None = None
        self._save: Callable[[Any], None] | None = None
        self._switch_lock = threading.Lock()
        with _lock:
            _unswitched.append(self)

    def __call__(self, inputs: list[Any]) -> Any:
        if self.future is not None and self.future.done():
            self._switch()
        return self._run(inputs)

    def _switch(self) -> None:
        with self._switch_lock:
            future, self.future = self.future, None
            if future is None:
                return
            try:
                compiled = self._unpack(future.result())
                if self._post_compile is not None:
                    compiled.post_compile(*self._post_compile)
            except Exception as error:  # the worker's compile error, or loading what it made
                self._stats.worker_failures.append(f"{self._label}: {type(error).__name__}: {error}")
                warn(f"{self._label} failed to compile in a worker and keeps running uncompiled: {error}")
                return
            self._run = compiled
            self._stats.worker_graphs_compiled += 1
            logger.info(
                "%s: back from a compile worker, running compiled (%d of %d graphs handed to the workers)",
                self._label,
                self._stats.worker_graphs_compiled,
                self._stats.worker_graphs_started,
            )
            if self._save is not None:
                self._save(compiled)

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        # What inductor does to a compiled graph before its first call (cudagraphs, input
        # alignment), done to the worker's graph when it arrives.
        self._post_compile = (example_inputs, constants, graph_kwargs)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # the kernels were compiled in the worker, into the shared Triton cache


def _cache_env() -> dict[str, str]:
    # As torch's own subprocess compile: the worker writes where this process reads.
    return {name: os.environ[name] for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if name in os.environ}


def _keep_traced_output_strides(gm: torch.fx.GraphModule) -> None:
    """Make inductor give every tensor output of a forward graph the strides it was traced with.

    In process, inductor compiles a forward graph first and AOTAutograd compiles its backward
    for the strides inductor chose for the saved activations (which it may lay out differently:
    a convolution's output channels-last, say). Here both compile at the same time, so the
    backward is compiled for the traced strides, and the forward must produce them: every
    output is treated as one the user sees, whose strides inductor keeps. (Without it, sd-scripts'
    SDXL at budget 0.1 on an H100 failed the backward's input stride check.)"""
    output = gm.graph.find_nodes(op="output")[0]
    outputs = output.args[0] if isinstance(output.args[0], (list, tuple)) else output.args
    output.meta["user_visible_output_idxs"] = [
        index
        for index, node in enumerate(outputs)
        if isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)
    ]


def _builtin_op(name: str) -> bool:
    return name.startswith(("torch.ops.aten.", "torch.ops.prims.", "torch.ops.fbgemm."))


@contextlib.contextmanager
def compiling_in_workers(stats: Stats, label: str) -> Iterator[None]:
    """Inside: inductor hands each graph it would compile to the workers (`start` first)."""
    # The module, not the function: some torch versions export the function `compile_fx` as an
    # attribute of torch._inductor under the module's name.
    compile_fx = importlib.import_module("torch._inductor.compile_fx")
    from torch._inductor.codecache import FxGraphCache
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx._graph_pickler import Options as PicklerOptions

    codegen_here = compile_fx.fx_codegen_and_compile
    save_graph = FxGraphCache._save_graph

    def codegen_in_worker(gm: Any, example_inputs: Any, inputs_to_check: Any, *args: Any, **graph_kwargs: Any) -> Any:
        kwargs = {k: v for k, v in graph_kwargs.items() if k != "compile_region_name"}
        is_backward = graph_kwargs.get("is_backward")
        name = f"{label} ({'backward' if is_backward else 'forward'})"
        if not is_backward:
            _keep_traced_output_strides(gm)
        scheme = _SubprocessFxCompile()
        serialized = scheme.serialize_compile(gm, example_inputs, inputs_to_check, kwargs)
        if serialized is None:  # torch logged why (a graph it cannot pickle)
            warn(f"{name} could not be handed to a compile worker (torch logged why); it compiles in this process")
            return codegen_here(gm, example_inputs, inputs_to_check, *args, **graph_kwargs)
        pickled, constants = serialized
        try:
            future = _submit(_SubprocessFxCompile._run_in_child_subprocess, pickled, _cache_env())
        except Exception as error:  # no pool could start, or it closed under us
            warn(f"{name} could not be handed to a compile worker ({error}); it compiles in this process")
            return codegen_here(gm, example_inputs, inputs_to_check, *args, **graph_kwargs)

        def unpack(pickled_output: Any) -> Any:
            output = pickled_output.deserialize(constants)
            scheme._postprocess(output)  # the worker's logs and warnings, replayed here
            return output.graph

        # Uncompiled, a cuDNN attention backward needs the gradient in the output's layout.
        uncompiled = cudnn_attention_gradients_laid_out(gm) if is_backward else gm
        stats.worker_graphs_started += 1
        return WorkerCompiledGraph(make_boxed_func(uncompiled.forward), future, unpack, stats, name)

    def save_when_compiled(key: str, graph: Any, example_inputs: Any, *args: Any) -> None:
        if not isinstance(graph, WorkerCompiledGraph):
            return save_graph(key, graph, example_inputs, *args)
        shape_env = FxGraphCache._get_shape_env()  # this compile's; gone once it returns
        # The guards inductor would store with the graph: AOTAutograd's cache entry, written when
        # this compile returns, records them and loads the graph only where they are the same.
        symints = FxGraphCache._filter_backed_symints(example_inputs)
        graph.guards_expr = shape_env.produce_guards_expression(
            placeholders=symints, guards=shape_env.get_pruned_guards(symints)
        )

        def save(compiled: Any) -> None:
            try:
                with mock.patch.object(FxGraphCache, "_get_shape_env", lambda: shape_env):
                    save_graph(key, compiled, example_inputs, *args)
            except Exception as error:
                warn(f"{graph._label}: the graph compiled in a worker could not be saved to inductor's cache: {error}")

        graph._save = save

    # torch's graph pickler refuses ops outside aten (its default filter); a graph traced under
    # autocast holds a prims.convert_element_type per cast (torch 2.11 on an H100: every bf16
    # block graph was refused). prims ops are torch's own, found by name in any process.
    dumps = GraphPickler.dumps

    def dumps_builtin_ops(obj: Any, options: Any = None) -> bytes:
        return dumps(obj, options or PicklerOptions(ops_filter=_builtin_op))

    with (
        mock.patch.object(GraphPickler, "dumps", dumps_builtin_ops),
        mock.patch.object(compile_fx, "fx_codegen_and_compile", codegen_in_worker),
        mock.patch.object(FxGraphCache, "_save_graph", save_when_compiled),
        torch._inductor.config.patch(WORKER_INDUCTOR_SETTINGS),  # around the cache key too
    ):
        yield


# Inductor settings of every graph compiled with workers (also of one that compiles in process
# after all: its cache key was made with them). Inductor's "mix-order reductions" (a norm's
# backward: two reductions over different dimensions in one kernel) read a part of inductor's
# state that torch's subprocess compile does not carry over (torch 2.11 on an H100: every
# backward graph of sd-scripts' SD3 failed with "Attempt to use poisoned virtualized value
# 'interpreter'" and ran uncompiled), so they are off.
WORKER_INDUCTOR_SETTINGS = (
    {"triton.mix_order_reduction": False} if hasattr(torch._inductor.config.triton, "mix_order_reduction") else {}
)
