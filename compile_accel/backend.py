"""The backend every region compiles through, and the AOTAutograd settings it compiles with.

`torch._functorch.config.activation_memory_budget` is read by the min-cut partitioner while a
graph is compiled. Patching it around a region's first call only holds until that region
recompiles (a new shape, a new bucket); the backend below applies it inside every compile
of the region instead, so the budget is part of that region and nothing global changes.

The same patch makes AOTAutograd compile a training graph's backward together with its
forward (`force_non_lazy_backward_lowering`), as torch itself does for a graph that saves
symbolic sizes. By default the backward is compiled lazily, at the first backward: an error
there reaches the user's `loss.backward()`, on that step and every later one, and nothing can
run the region eager instead (its forward has already run compiled). Compiled with the forward,
the error is a compile error of the region's call like any other, which the region answers by
running that call eager and falling back for good (compile_accel.regions): the step's gradients
are eager's. The alternative, an autograd.Function around every compiled call that re-runs the
block eagerly when the compiled backward raises, would put a nested backward (as in reentrant
checkpointing) under every block, in the way of DDP's hooks, checkpoints and the offload
conductor's saved-tensor hooks. The costs: the backward compiles in the first forward with
grad, even when no backward follows; and where inductor donates saved tensors to the backward,
`backward(retain_graph=True)` raises torch's donated-buffer error from the first backward on
(compiled lazily, from the second; `torch._functorch.config.donated_buffer = False` allows it).
A torch without the knob keeps the lazy compile.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import torch
import torch._functorch.config
import torch.fx
import torch.utils._pytree as pytree

from . import compile_workers
from .attention import rewrite_attention
from .base_compute import BaseLinears
from .base_compute_rewrite import rewrite_base_linears
from .config import CUDA_GRAPH_MODES, WITHOUT_CUDA_GRAPHS, CompileConfig
from .dynamo_settings import HAS_EAGER_BACKWARD_KNOB
from .int8_weight import plain_tensors, separate_aliased_outputs
from .saved_bytes import SavedBytesEstimate
from .stats import Stats


# CompileConfig.fast_compile (off by default): inductor settings patched around the regions'
# compiles only. On a full H100/H200 the steps were as fast without the three; on a 4090's compute
# (--gpu-like rtx4090) they cost step time: sd-scripts' SD3 selective 0.3903 s with none of them,
# 0.3929 with dynamic_scale_rblock=False alone, 0.3964 with all three
# (benchmarks/results/h200_gpu_like_rtx4090/README.md).
# pattern_matcher, triton.autotune_pointwise: blocks call attention through SDPA and their matmuls
# through extern kernels, which those passes would look for; without them a cold compile takes
# seconds less (benchmarks/results/h100_compile_profile/knobs/README.md).
# dynamic_scale_rblock: for a reduction kernel that uses many registers, inductor compiles a
# second config (half the reduction block) when the kernel is loaded, and benchmarks the two
# at its first launch, in every process: torch <= 2.12 never takes the choice from its autotune
# cache (pytorch/pytorch#181789, #189121; torch 2.13 skips it on an autotune-cache hit). Off, a warm
# first step takes up to a second less and a cold compile half as long, Lumina 2's and Flux's steps
# as fast, SDXL's kernels perhaps ~1% slower (benchmarks/results/h200_warm_start/README.md).
FAST_COMPILE_SETTINGS: dict[str, Any] = {
    "pattern_matcher": False,
    "triton.autotune_pointwise": False,
    "dynamic_scale_rblock": False,
}


def cacheable_rng_settings() -> dict[str, Any]:
    """Inductor settings that let a traced checkpoint's graph be cached on torch 2.11 and 2.12.
    On CUDA the partitioner wraps a recomputed seeded op (attention: SDPA is tagged
    nondeterministic_seeded) in `graphsafe_run_with_rng_state`, which those versions do not mark
    cacheable (torch 2.13 does: its generator state is a runtime input of the compiled graph), so
    inductor bypassed its cache for the graph, AOTAutograd saved no entry, and the graph never came
    back from the compile workers (benchmarks/results/h200_gpu_like_rtx4090/README.md). Empty
    where the op is cacheable already."""
    op = getattr(torch._prims.rng_prims, "graphsafe_run_with_rng_state", None)
    if op is None or op.cacheable():
        return {}
    marked = torch._inductor.config.unsafe_marked_cacheable_functions
    return {"unsafe_marked_cacheable_functions": {**marked, f"{op.__module__}.{op.__name__}": torch.__version__}}


class RegionNotCompilable(RuntimeError):
    """A region's graph holds something inductor cannot lower well; it runs eager instead."""


def _complex_op(gm: torch.fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("example_value")):
            if isinstance(value, torch.Tensor) and value.is_complex():
                return node.format_node() if node.op != "placeholder" else f"complex input {node.name}"
    return None


def _signature(gm: torch.fx.GraphModule) -> tuple:
    """What a graph was compiled for: its frame, input names/types/shapes/strides/dtypes/devices/requires_grad,
    grad mode and autocast. A second graph with the same signature is a wasted recompile."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor):
            inputs.append(
                (
                    node.name,
                    type(value).__name__,  # (a conductor's Int8Weight, a plain tensor's fake)
                    str(tuple(value.shape)),
                    str(value.stride()),
                    value.dtype,
                    value.device,
                    value.requires_grad,
                )
            )
        else:
            inputs.append((node.name, type(value).__name__))
    autocast = tuple(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in ("cuda", "cpu"))
    frame = compile_id.frame_id if compile_id is not None else None
    return (frame, tuple(inputs), torch.is_grad_enabled(), autocast)


def _has_checkpoint(gm: torch.fx.GraphModule) -> bool:
    return any(
        getattr(node.target, "__name__", "") == "tag_activation_checkpoint"
        for node in gm.graph.nodes
        if node.op == "call_function"
    )


def _inner_backend(config: CompileConfig, cuda_graphs: bool = True) -> Callable:
    """The compiler of a region's graphs; `cuda_graphs=False`: config.compile_mode without its
    CUDA graphs."""
    mode = config.compile_mode
    if not cuda_graphs and mode in CUDA_GRAPH_MODES:
        mode = WITHOUT_CUDA_GRAPHS[mode]
    if config.backend == "inductor" and mode is not None:
        return torch._TorchCompileInductorWrapper(mode, None, config.compile_dynamic)
    return torch._dynamo.lookup_backend(config.backend)


def _outputs_copied(compiled: Callable) -> Callable:
    """`compiled` (a graph replayed as a CUDA graph), its outputs copied out of the graphs' pool.
    Selective mode records only graphs run without grad: a reentrant checkpoint's first forward,
    which keeps each block's output (the next block's input) for its recompute in the backward.
    A tensor in the pool may be overwritten by a later replay; a copy (one kernel per output)
    is the block's own. An output in an input's storage (returned as it came) is not copied."""

    def run(*args: Any) -> Any:
        # Read before the call: a boxed call may empty its argument list.
        leaves = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        inputs = {plain.untyped_storage().data_ptr() for t in leaves for plain in plain_tensors(t)}

        def own(out: torch.Tensor) -> torch.Tensor:
            return out if out.untyped_storage().data_ptr() in inputs else out.clone()

        return pytree.tree_map_only(torch.Tensor, own, compiled(*args))

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def start_compile_workers() -> None:
    """Start inductor's kernel-compile worker processes now. torch starts them at the first graph
    it compiles, and while they start (seconds) it compiles that graph's kernels one by one in
    this process; started at apply(), they are up by the first step. Without triton (no worker
    pool; CPU builds), or in a torch without `maybe_warm_pool`, nothing starts. (Inductor's own
    imports start earlier, beside the program's set-up: compile_accel.preload.)"""
    from torch._inductor import async_compile

    warm_pool = getattr(async_compile, "maybe_warm_pool", None)
    if warm_pool is not None:
        warm_pool()


_running = threading.local()


def compiled_call_running() -> bool:
    """Whether this thread is inside a compiled graph of a region (not eager code that dynamo
    runs between graphs or for excluded submodules): the tensors saved for backward there are
    the compiled function's (the offload conductor may move them)."""
    return getattr(_running, "depth", 0) > 0


def flagged(compiled: Callable) -> Callable:
    """`compiled`, with `compiled_call_running()` true while it runs."""

    def run(*args: Any, **kwargs: Any) -> Any:
        _running.depth = getattr(_running, "depth", 0) + 1
        try:
            return compiled(*args, **kwargs)
        finally:
            _running.depth -= 1

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # dynamo passes a list when it is set
    return run


class _Replaceable:
    """What dynamo keeps for a graph of auto's traced step: runs `target` (the traced graph)
    until RegionBackend.adopt puts the chosen budget's graph there."""

    def __init__(self, target: Callable) -> None:
        self.target = target

    def __call__(self, *args: Any) -> Any:
        return self.target(*args)


class RegionBackend:
    """torch.compile backend for one compiled function (shared by all its regions).

    Per graph it: refuses complex-dtype graphs (inductor has no code generation for complex
    ops), notes a checkpoint still inside a budgeted block, rewrites its attention calls
    (compile_accel.attention) and, with base_compute, its base matmuls
    (compile_accel.base_compute), compiles with the budget and an eager backward compile
    patched in, and once that succeeded counts the graph and whether it is a recompile.

    auto's traced step (`estimate`) with compile workers packs each graph for a worker as dynamo
    traced it and runs it uncompiled while the worker partitions it at every candidate
    (`_traced_in_workers`); `adopt(budget)` then hands those graphs to the workers at the budget
    auto picked and makes this backend that budget's: dynamo's graphs and guards serve it, and
    the picked budget is compiled without tracing the step again (a second trace costs seconds:
    benchmarks/results/h200_auto_one_trace/README.md).
    """

    def __init__(
        self,
        config: CompileConfig,
        budget: float | None,
        stats: Stats,
        estimate: SavedBytesEstimate | None = None,
        base_linears: BaseLinears | None = None,
    ) -> None:
        self.base_linears = base_linears
        # With an estimate: traced for auto's calibration, without inductor (compile_accel.saved_bytes).
        self.estimating = estimate is not None
        self._estimate = estimate
        self.inner = _inner_backend(config) if estimate is None else estimate.backend()
        # Selective mode with CUDA graphs records only the graphs compiled without grad
        # (_outputs_copied); these compile without. Under a trainer's checkpoint, graphs recorded
        # with grad replay in its recompute inside the backward, where a later replay overwrote
        # outputs the backward still read (sd-scripts' SDXL, torch 2.11, twice:
        # benchmarks/results/h200_selective_cuda_graphs/).
        self._with_grad_inner = (
            _inner_backend(config, cuda_graphs=False)
            if config.mode == "selective" and config.compile_mode in CUDA_GRAPH_MODES
            else None
        )
        self.budget = budget
        self.stats = stats
        self.saw_checkpoint = False
        self._aot_settings: dict[str, Any] = {}  # patched around every compile (module docstring)
        if budget is not None:
            self._aot_settings["activation_memory_budget"] = budget
        if HAS_EAGER_BACKWARD_KNOB:
            self._aot_settings["force_non_lazy_backward_lowering"] = True
        # Inductor settings patched around every compile of a region, and only there.
        self._inductor_settings = {**(FAST_COMPILE_SETTINGS if config.fast_compile else {}), **cacheable_rng_settings()}
        # Each graph compiled in a worker process (not auto's traced estimate).
        self.in_workers = config.compile_workers > 0 and estimate is None
        self._config = config
        # auto's traced graphs, packed for the workers, with what dynamo calls for each (None:
        # not traced for auto with workers, adopted, or a graph that could not be packed).
        self.traced: list[tuple[compile_workers.TracedGraph, _Replaceable]] | None = (
            [] if estimate is not None and config.compile_workers > 0 else None
        )

    def adopt(self, budget: float, stats: Stats) -> bool:
        """Make this traced backend (auto's, with workers) `budget`'s, counting into `stats`:
        every graph it traced goes to the compile workers at `budget`, running uncompiled under
        a checkpoint until it is back, and later graphs compile at `budget`. False, with nothing
        changed, for a backend without packed graphs."""
        if not self.traced:
            return False
        self.estimating = False
        self._estimate = None  # (its joint graphs stay with auto, not with every compiled function)
        self.inner = _inner_backend(self._config)
        self.budget = budget
        self._aot_settings["activation_memory_budget"] = budget
        self.in_workers = True
        stats.signatures |= self.stats.signatures  # a graph traced again counts as a recompile
        self.stats = stats
        cuda_graphs = self._config.compile_mode in CUDA_GRAPH_MODES
        with self._settings():  # the workers compile under them
            for graph, call in self.traced:
                call.target = compile_workers.hand_over(graph, self.inner, self._compile_here, stats, cuda_graphs)
        if cuda_graphs:
            stats.cuda_graph_graphs += len(self.traced)
        self.traced = None
        return True

    def count_eager_call(self) -> None:
        """A call that ran eager in place of the graph the next call runs: auto's traced step
        counts it as that graph's."""
        if self.estimating and self._estimate is not None:
            self._estimate.ran_eager()

    def _settings(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(torch._functorch.config.patch(self._aot_settings))
        stack.enter_context(torch._inductor.config.patch(self._inductor_settings))
        return stack

    def _compile_here(
        self, gm: torch.fx.GraphModule, example_inputs: list[Any], inner: Callable | None = None
    ) -> Callable:
        with self._settings():
            return (inner or self.inner)(gm, example_inputs)

    def _inner_now(self) -> tuple[Callable, bool]:
        """The compiler for a graph dynamo hands over now, and whether it records CUDA graphs."""
        if self.estimating or self._config.compile_mode not in CUDA_GRAPH_MODES:
            return self.inner, False
        if self._with_grad_inner is not None and torch.is_grad_enabled():
            return self._with_grad_inner, False
        return self.inner, True

    def _traced_in_workers(self, gm: torch.fx.GraphModule, example_inputs: list[Any], label: str) -> Callable:
        """auto's traced step with compile workers: `gm` packed as dynamo traced it (inductor's
        passes may rewrite it), for `adopt`; a worker traces and partitions it at every
        candidate (compile_accel.saved_bytes) while it runs here uncompiled, under a checkpoint
        where it trains (also in the training steps until auto picks a budget; a graph they
        trace first is partitioned by no one). A graph that cannot be packed is traced and
        partitioned here, and the picked budget traces the step again."""
        traced = compile_workers.pack_traced(gm, example_inputs, label)
        if traced is None:
            self.traced = None
            return self._compile_here(gm, example_inputs)
        training = torch.is_grad_enabled()
        record = None
        if training and self._estimate.counting_calls:  # (a graph first traced after it: no prediction reads it)
            job = self._estimate.worker_job()
            with self._settings():  # the worker traces under them
                partitions = compile_workers.run_in_worker(traced, job)
            record = self._estimate.add_checkpointed(partitions, functools.partial(self._partitioned_here, traced, job))

        def run(*inputs: Any) -> Any:
            if record is not None:
                self._estimate.called(record)
            return compile_workers.run_uncompiled(gm, inputs, checkpointed=training)

        compiled = _Replaceable(run)
        self.traced.append((traced, compiled))
        return compiled

    def _partitioned_here(self, traced: compile_workers.TracedGraph, job: Callable) -> dict[float, int]:
        with self._settings():
            return compile_workers.run_here(traced, job)

    def _rewrite(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
        """The rewrites of every graph before it compiles: attention calls, then base matmuls."""
        rewrite_attention(gm)  # reads traced values of nodes the next rewrite replaces
        if self.base_linears is not None:
            rewrite_base_linears(gm, example_inputs, self.base_linears)
        separate_aliased_outputs(gm, example_inputs)  # (held int8 weights stay after the acceleration)

    def for_precompile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        """This backend as torch's aot_compile calls it (compile_accel.precompile): the same
        rewrites, the graph compiled in a worker under this backend's settings and
        aot_compile's."""
        self._rewrite(gm, example_inputs)
        with self._settings():
            return compile_workers.precompile_in_workers(gm, example_inputs, self.inner)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        op = _complex_op(gm)
        if op is not None:
            raise RegionNotCompilable(
                f"complex-dtype values ({op}); inductor cannot generate code for complex operators. "
                "Rewrite the rotary embedding in real arithmetic, or exclude the submodule that uses it "
                "(CompileConfig.exclude)"
            )
        if self.budget is not None and _has_checkpoint(gm):
            self.saw_checkpoint = True
        signature = _signature(gm)
        label = f"graph {torch._guards.CompileContext.current_compile_id()}"
        self._rewrite(gm, example_inputs)
        inner, cuda_graphs = self._inner_now()
        compile_here = functools.partial(self._compile_here, inner=inner)
        if self.in_workers:
            with self._settings():  # in force while handing over: the worker compiles with them
                compiled = compile_workers.compile_in_workers(
                    gm,
                    example_inputs,
                    inner,
                    compile_here,
                    self.stats,
                    label,
                    # The budget replaced the block's checkpointing: until compiled, checkpoint it.
                    checkpointed=self.budget is not None,
                    cuda_graphs=cuda_graphs,
                )
        elif self.traced is not None:
            compiled = self._traced_in_workers(gm, example_inputs, label)
        else:
            compiled = compile_here(gm, example_inputs)
        if cuda_graphs and self._with_grad_inner is not None:
            compiled = _outputs_copied(compiled)
        compiled = flagged(compiled)
        # Counted once compiled: a compile that raised (or a Ctrl-C) made no graph, and the
        # retry of the same graph is no recompile.
        self.stats.record_graph(signature)
        self.stats.cuda_graph_graphs += cuda_graphs
        return compiled
