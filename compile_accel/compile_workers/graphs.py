"""The graphs handed to the compile workers (WorkerGraph): each runs as dynamo traced it until its
worker is back, then is compiled here from the caches the worker filled, at a call where that is
safe, and runs compiled. Every graph handed over and not yet running compiled, while its model
lives, is in HANDED_OVER; `wait`, `wait_and_load` and `step_started` act on them all."""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.checkpoint import checkpoint

from ..checkpointing import keep_saved_tensors, under_saved_tensor_checkpoint
from ..stats import Stats, warn
from .packing import compile_packed, in_runtime_state, runtime_state, set_flags
from .pool import POOL, compiles_here

logger = logging.getLogger("compile_accel")


class GraphState(enum.Enum):
    COMPILING = "compiling"  # in its worker
    BACK = "back"  # its worker done at a step's start: compiled here at its next call
    LOADED = "loaded"  # compiled here (from the worker's caches, or anew after its failure)
    FAILED = "failed"  # compiled neither in its worker nor here: runs uncompiled


class HandedOver:
    """The graphs of this process handed to the workers (one: HANDED_OVER), under POOL.lock."""

    def __init__(self) -> None:
        # Not yet switched, as handed over; weakly: a graph whose model (and dynamo's cache entry)
        # is gone is no one's to wait for, load or run.
        self.graphs: list[weakref.ref[WorkerGraph]] = []
        self.held: set[int] = set()  # id()s of the Stats whose graphs hold_switches keeps uncompiled
        self.switched = 0  # graphs that run compiled here now, for the rest of the process
        self.first_step_start: float | None = None  # time.time() at the first step_started()

    def unswitched(self) -> list[WorkerGraph]:
        """The graphs still compiling or back (the switched ones dropped: step_started runs every step)."""
        live = [graph for graph in (ref() for ref in self.graphs) if graph is not None]
        unswitched = [graph for graph in live if graph.state in (GraphState.COMPILING, GraphState.BACK)]
        self.graphs[:] = [weakref.ref(graph) for graph in unswitched]
        return unswitched


HANDED_OVER = HandedOver()


def _aot_cache_hits() -> int:
    return torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]


_ATTENTION_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# Dynamo traces a checkpoint call inside a region (blocks mode with the trainer's checkpointing on)
# as this op. Outside a compile, torch 2.11 runs it as a plain call of its body, which keeps every
# activation for the backward (pytorch/pytorch#160773): a first step running such graphs uncompiled
# took the memory of a step without checkpointing (sd-scripts' Anima at batch 2 ran out of 24 GiB;
# benchmarks/results/h200_gpu_like_rtx4090/README.md). torch 2.13 checkpoints it, but recomputes
# outside `_uncompiled`'s attention backends. Uncompiled, our graphs call a checkpoint of our own.
_TRACED_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
_WITH_EAGER_CHECKPOINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _eager_checkpoint(body: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """The traced checkpoint op's meaning, run eagerly: a non-reentrant checkpoint of its body
    (with the selective-checkpoint policy that dynamo keeps on the body, if any), recomputed
    under the attention backends it ran under (another backend's saved values differ; on CUDA
    the recompute sets them from autograd's device thread while the step's thread waits in
    backward())."""
    kwargs["use_reentrant"] = False
    if "_checkpoint_context_fn" in body.meta:
        kwargs["context_fn"] = body.meta["_checkpoint_context_fn"]
    return checkpoint(_uncompiled, body, *args, **kwargs)


def _with_eager_checkpoints(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm`, or a copy of it (made once) whose traced checkpoints call `_eager_checkpoint`: the
    graph itself stays as traced, for its compile. (Checkpoints in the bodies of other
    higher-order ops are left to torch.)"""
    if gm not in _WITH_EAGER_CHECKPOINTS:
        rewritten = None  # (not gm itself: a value holding its key would keep it alive)
        if any(node.target is _TRACED_CHECKPOINT for node in gm.graph.nodes):
            graph = torch.fx.Graph()
            graph._codegen = gm.graph._codegen
            graph.output(graph.graph_copy(gm.graph, {}))
            for node in graph.nodes:
                if node.target is _TRACED_CHECKPOINT:
                    node.target = _eager_checkpoint
            rewritten = torch.fx.GraphModule(gm, graph)
        _WITH_EAGER_CHECKPOINTS[gm] = rewritten
    rewritten = _WITH_EAGER_CHECKPOINTS[gm]
    return gm if rewritten is None else rewritten


def _uncompiled(gm: torch.fx.GraphModule, *inputs: Any) -> Any:
    # Without cuDNN's attention: its eager backward fails on gradients laid out as a compiled
    # step's neighbours give them (torch 2.11: an illegal memory access;
    # benchmarks/results/h200_workers_whole_compile/README.md); inductor's lowering lays them out
    # for it, eager does not.
    with sdpa_kernel(_ATTENTION_WITHOUT_CUDNN):
        return _with_eager_checkpoints(gm)(*inputs)


def run_uncompiled(gm: torch.fx.GraphModule, inputs: tuple | list, checkpointed: bool) -> Any:
    """`gm` run as dynamo traced it; `checkpointed`: under a non-reentrant checkpoint, which keeps
    only its inputs for the backward and runs it again there."""
    if checkpointed:
        return checkpoint(_uncompiled, gm, *inputs, use_reentrant=False)
    return _uncompiled(gm, *inputs)


def compile_packed_here(packed: bytes, compiler: Callable, state: dict[str, Any]) -> Any:
    """packing.compile_packed in this process under `state` (the graph's at its trace, as its worker
    compiled it: AOTAutograd's cache key holds grad mode and autocast); this process's flags are
    put back after."""
    here = runtime_state()
    try:
        with keep_saved_tensors(), in_runtime_state(state):
            return compile_packed(packed, compiler)
    finally:
        set_flags(here)


class WorkerGraph:
    """A graph handed to a worker: runs uncompiled until the worker is done, then is compiled
    here from the caches the worker filled (compile_here, at its first call after) and runs
    compiled. A worker's error, or a graph the caches did not get, is warned about once and
    compiled here.

    checkpointed: the graph runs under a checkpoint of its own until compiled (a budget replaced
    the block's checkpointing), and may switch at any call outside a trainer's non-reentrant
    checkpoint. Otherwise, or inside one, a trainer's checkpoint may run it again in the backward,
    so it switches only at a call after `step_started`. runtime:
    grad mode, autocast, ... as the graph was handed over (`packing.runtime_state`), which its
    compile here is under. cuda_graphs: compiled to replay as a CUDA graph."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        packed: bytes,
        compile_here: Callable[[torch.fx.GraphModule, list[Any]], Callable],
        future: concurrent.futures.Future,
        stats: Stats,
        label: str,
        checkpointed: bool,
        runtime: dict[str, Any] | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self._gm = gm
        self._cuda_graphs = cuda_graphs
        self._runtime = runtime_state() if runtime is None else runtime  # (as handed over; default: now)
        self._packed = packed
        self._compile_here = compile_here
        self.future = future
        self.state = GraphState.COMPILING
        self._stats = stats
        self._label = label
        self._checkpointed = checkpointed
        self._compiled: Callable | None = None
        self._switch_lock = threading.Lock()
        self._record: dict[str, Any] | None = None  # its entry in stats.worker_compiles, once loaded
        self._handed_over = time.time()  # (a hair after the submit; WorkerCompile.started is on this clock)
        with POOL.lock:
            HANDED_OVER.graphs.append(weakref.ref(self))

    def __call__(self, *inputs: Any) -> Any:
        if id(self._stats) not in HANDED_OVER.held and (
            self.state is GraphState.BACK
            or (
                self.state is GraphState.COMPILING
                and self._checkpointed
                and self.future.done()
                # (a checkpoint the budget could not switch off, around the block, would recompute
                # it in the backward: it must run as in the forward)
                and not under_saved_tensor_checkpoint()
            )
        ):
            self.switch()
        if self._compiled is not None:
            return self._compiled(*inputs)
        return run_uncompiled(self._gm, inputs, self._checkpointed)

    def switch(self) -> None:
        """Compile the graph here from the caches its worker filled (or here, after its worker's
        failure); from then on it runs compiled, or uncompiled for good where both failed."""
        with self._switch_lock:
            if self.state not in (GraphState.COMPILING, GraphState.BACK):
                return
            problem, report, lost = None, None, False
            try:
                report = self.future.result()
                if report.aot_autograd.get("autograd_cache_bypass"):
                    problem = "AOTAutograd's cache cannot hold it (the worker's torch logged why)"
            except Exception as error:  # the worker's compile error, or its pool's process gone
                problem = f"{type(error).__name__}: {error}"
                lost = POOL.lost_with_the_pool(error)
            hits = _aot_cache_hits()
            start = time.perf_counter()
            try:
                # Under the state the worker compiled it in: wait_and_load runs outside the step.
                self._compiled = compile_packed_here(self._packed, self._compile_here, self._runtime)
            except Exception as error:
                self.state = GraphState.FAILED
                self._stats.worker_failures.append(f"{self._label}: {problem or ''} {type(error).__name__}: {error}".strip())
                warn(f"{self._label} did not compile in a worker ({problem}) nor here, and keeps running uncompiled: {error}")
                return
            self.state = GraphState.LOADED
            with POOL.lock:
                HANDED_OVER.switched += 1
            seconds = time.perf_counter() - start
            if problem is None and _aot_cache_hits() == hits:
                problem = "what it compiled was not found in AOTAutograd's cache"
            if problem is not None:
                self._stats.worker_failures.append(f"{self._label}: {problem}")
                compiles_here(f"{self._label} did not compile in a worker ({problem}); compiled in this process "
                               f"({seconds:.1f} s)", lost)
                return
            self._stats.worker_graphs_compiled += 1
            queued = max(0.0, report.started - self._handed_over)
            self._record = {
                "graph": self._label, "queued_s": round(queued, 3), "worker_s": round(report.seconds, 3),
                "load_s": round(seconds, 3), **report.times.as_dict(),
                **_timeline(handed_over=self._handed_over, back=report.started + report.seconds, loaded=time.time()),
            }
            self._stats.worker_compiles.append(self._record)
            logger.info(
                "%s: compiled in a worker in %.1f s after %.1f s in its queue (%s), loaded from the caches in %.1f s "
                "(%d of %d graphs handed to the workers)",
                self._label,
                report.seconds,
                queued,
                report.times.summary(),
                seconds,
                self._stats.worker_graphs_compiled,
                self._stats.worker_graphs_started,
            )

    def run_once_on_stand_ins(self) -> None:
        """Run the compiled graph once, forward and backward, on zeros shaped as its inputs, under
        the state it was handed over in, the random-number state put back: its kernels' first run
        (autotuning, loading) is paid here rather than in the next step
        (benchmarks/results/h200_worker_warm_up/).
        A graph handed over with grad runs once more inside a backward (`_in_a_backward`), where a
        checkpoint recomputes it. Each run takes one block's weights (copies) and activations of
        memory, freed after. Not for a graph replayed as a CUDA graph (zeros at other addresses
        than the weights it records), one with integer inputs (indices: zeros may index out of
        bounds, which a kernel asserts), nor one not compiled here. A failure is warned about: the
        graph runs as it is."""
        if self._compiled is None or self._cuda_graphs:
            return
        fakes = [node.meta.get("example_value") for node in self._gm.graph.find_nodes(op="placeholder")]
        if not all(isinstance(fake, torch.Tensor) for fake in fakes):
            return  # (non-tensor inputs: graphs with them are not handed over)
        if any(not (fake.is_floating_point() or fake.dtype == torch.bool) for fake in fakes):
            return
        devices = sorted({fake.device for fake in fakes if fake.device.type == "cuda"}, key=str)
        here = runtime_state()
        start = time.perf_counter()

        def forward_and_backward() -> None:
            with in_runtime_state(self._runtime):
                stand_ins = [_zeros_like(fake) for fake in fakes]
                outputs = [out for out in pytree.tree_leaves(self._compiled(*stand_ins)) if _wants_grad(out)]
                if outputs:
                    torch.autograd.backward(outputs, [torch.ones_like(out) for out in outputs])

        try:
            with torch.random.fork_rng(devices=devices), keep_saved_tensors():
                forward_and_backward()
                if self._runtime["grad"]:
                    _in_a_backward(forward_and_backward, devices[0] if devices else torch.device("cpu"))
                for device in devices:  # a kernel's error shows here, not in the next step
                    torch.cuda.synchronize(device)
            if self._record is not None:
                self._record["first_run_s"] = round(time.perf_counter() - start, 3)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError):
                torch.cuda.empty_cache()  # what the run took is the training's again
            warn(f"{self._label}: its first run on stand-in inputs failed ({type(error).__name__}: {error}); "
                 "it runs compiled from its next call, which pays its kernels' first run")
        finally:
            set_flags(here)


class _CallInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: Callable[[], None]) -> torch.Tensor:
        ctx.call = call
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.call()
        return grad, None


def _in_a_backward(call: Callable[[], None], device: torch.device) -> None:
    """Call `call` inside a backward, on the thread the autograd engine runs `device`'s backward
    work on: where a checkpoint recomputes a graph's forward. Some of what a first run sets up is
    kept per thread, as ATen keeps cuDNN's attention plans: without this run, a model under
    reentrant checkpoints pays it in the attention calls of the step after the wait
    (benchmarks/results/h200_step_after_wait_threads/README.md)."""
    torch.autograd.backward(_CallInBackward.apply(torch.zeros((), device=device, requires_grad=True), call))


def _since_first_step(at: float) -> str:
    start = HANDED_OVER.first_step_start
    return "" if start is None else f" ({at - start:.1f} s into the first step)"


def _timeline(**times: float) -> dict[str, float]:
    """Each time.time() as seconds since the first step started, named `<name>_at_s` (none before
    a first step: a graph handed over outside the training's steps)."""
    start = HANDED_OVER.first_step_start
    if start is None:
        return {}
    return {f"{name}_at_s": round(at - start, 3) for name, at in times.items()}


def _zeros_like(fake: torch.Tensor) -> torch.Tensor:
    """A real tensor of `fake`'s shape, strides, dtype and device, zeros, a leaf needing grad as it did;
    of its subclass (an Int8Weight) over zeros where it is a wrapper."""
    if is_traceable_wrapper_subclass(fake):
        names, meta = fake.__tensor_flatten__()
        inner = {name: _zeros_like(getattr(fake, name)) for name in names}
        return type(fake).__tensor_unflatten__(inner, meta, fake.shape, fake.stride())
    zeros = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device).zero_()
    return zeros.requires_grad_(fake.requires_grad)


def _wants_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def pending() -> int:
    """Graphs (of every model in this process) handed to the workers and not yet running
    compiled: still compiling, or back and switched to at their next call."""
    with POOL.lock:
        return len(HANDED_OVER.unswitched())


def compiling(stats: Stats) -> int:
    """Graphs counting into `stats` (one region function's compiles: one model, one budget)
    handed to the workers and not back from them yet."""
    with POOL.lock:
        return sum(graph._stats is stats and not graph.future.done() for graph in HANDED_OVER.unswitched())


def hold_switches(stats: Stats, held: bool) -> None:
    """While held, the graphs counting into `stats` that are back from the workers keep running
    uncompiled until released: auto's calibration runs a candidate budget's graphs compiled
    first in a step of its own, which checks that their peak fits, before a training step may.
    The caller keeps `stats` alive while it holds them."""
    with POOL.lock:
        (HANDED_OVER.held.add if held else HANDED_OVER.held.discard)(id(stats))


def graphs_switched() -> int:
    """Graphs (of every model in this process) handed to the workers that run compiled here now:
    loaded from the caches the workers filled, or compiled here after a worker's failure."""
    with POOL.lock:
        return HANDED_OVER.switched


def wait() -> int:
    """Wait until the workers are done with every job handed to them (graphs, auto's partitions,
    precompiles); returns `pending()` as it was before (not 0: those graphs switch to compiled in
    the next step)."""
    waiting = pending()
    with POOL.lock:
        futures = [graph.future for graph in HANDED_OVER.unswitched()] + POOL.out
    POOL.wait_all(futures)
    return waiting


def wait_refusal(workers: int | None, auto: str | None, wait_flag: str, workers_flag: str) -> str | None:
    """Why the first step cannot wait for the compile workers (`wait_and_load`) as `wait_flag`
    asks, or None: the rule the bench and the launcher share. `workers`: how many were asked for;
    `auto`: the name of the run's activation_memory_budget="auto", where it asks for it."""
    if not workers:
        return f"{wait_flag} waits for the compile workers: give {workers_flag} N too"
    if auto:
        return (
            f"{wait_flag}: {auto} measures its candidates in the steps after the first, each once its graphs are "
            "back from the workers: the steps until it has chosen run uncompiled whether the first step waits or not"
        )
    return None


def wait_and_load() -> int:
    """Load each graph here as its worker is done with it, rather than at its next call, run it
    once (`WorkerGraph.run_once_on_stand_ins`), then wait for the workers' other jobs (`wait`);
    return how many graphs. A trainer that wants every step after the first to run compiled, as
    fast as the ones after it, calls it at the end of its first step (the sd-scripts launcher's
    `--compile_workers_wait`, the bench's `--compile-workers-wait`): that step then lasts until
    the slowest graph is back and loaded, the graphs back first loading while the others still
    compile. Between steps only: a graph that a trainer's checkpoint recomputes must not change
    within a step. Graphs that auto holds (`hold_switches`) stay as they are."""
    with POOL.lock:  # (no graph is handed over between steps: this is every one to load)
        graphs = {graph.future: graph for graph in HANDED_OVER.unswitched() if id(graph._stats) not in HANDED_OVER.held}
    if graphs:
        logger.info(
            "waiting for the compile workers: %d graphs to load here, %d of them back%s",
            len(graphs), sum(future.done() for future in graphs), _since_first_step(time.time()),
        )
    start = time.perf_counter()
    for future in POOL.as_completed(list(graphs)):
        graphs[future].switch()
        graphs[future].run_once_on_stand_ins()
    wait()
    if graphs:
        logger.info("%d graphs loaded and run once in %.1f s%s", len(graphs), time.perf_counter() - start,
                    _since_first_step(time.time()))
    return len(graphs)


def step_started() -> None:
    """Say that a training step starts (apply() calls it from the model's forward pre-hook): a
    graph back from its worker by now may switch to compiled in this step. A graph that a
    trainer's checkpoint recomputes in the backward switches only here, between steps: a
    checkpoint must see its forward save the same tensors twice."""
    with POOL.lock:
        if HANDED_OVER.first_step_start is None:
            HANDED_OVER.first_step_start = time.time()
        for graph in HANDED_OVER.unswitched():
            if graph.state is GraphState.COMPILING and graph.future.done():
                graph.state = GraphState.BACK
