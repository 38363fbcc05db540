"""The activation memory of every candidate budget, from one trace of each graph.

The min-cut partitioner decides, per budget, which forward values a graph saves for its
backward; everything else of a compile (dynamo's trace, AOTAutograd's joint graph) is the same
for every budget. `SavedBytesEstimate.backend()` is an AOTAutograd backend without inductor:
it traces each graph once and runs it partitioned at the traced budget, keeping the joint graph
(after inductor's joint-graph passes) and each step's first inputs of the graph. It counts the
calls of each graph: a graph's saved bytes stay alive once per call until the backward.

`added_bytes(budget)`, asked after a step, is what a step at `budget` keeps beyond a step at
the traced budget. The first time a budget is asked for, each graph's joint graph is partitioned
at it (on a copy) and that forward runs once on the kept inputs, to read the bytes of what the
partition saves (storages, so a saved view keeps its whole base, as it does in training).
Partitioning is most of what the estimate costs (about a second per graph and budget for a
full-size block), so only the budgets asked for are partitioned: auto bisects for the largest
predicted to fit. `release_inputs()` drops the kept inputs.

The traced graphs hold the attention kernels the compiled step would run (cuDNN's, where
torch picks it): the partitioner decides differently for them (cuDNN's attention is not among
its compute-intensive ops, flash and efficient attention are). Traced with cuDNN's kernel
ruled out, diffusers' Lumina 2 was predicted 10.91 GiB at budget 0.1 where the compiled step
peaks at 8.86 GiB (9.90 predicted with it), and auto chose 0.0.

auto (compile_accel.auto_budget) uses it to compile and time only the budgets that should fit,
instead of compiling each candidate with inductor to find out.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch._functorch.config
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

PartitionFn = Callable[..., tuple[torch.fx.GraphModule, torch.fx.GraphModule]]


def _inductor_partition() -> PartitionFn:
    """The partition inductor itself runs: its joint-graph passes, then the min-cut partitioner
    (a torch without the module-level function: the partitioner alone)."""
    from torch._inductor import compile_fx

    partition = getattr(compile_fx, "partition_fn", None)
    if partition is not None:
        return partition
    return functools.partial(min_cut_rematerialization_partition, compiler="inductor")


def _laid_out_as(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`grad` with the strides of `out` (a copy when they differ)."""
    if grad.stride() == out.stride():
        return grad
    return torch.empty_strided(out.shape, out.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def cudnn_attention_gradients_laid_out(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` (a backward graph, changed in place) with each cuDNN attention backward given the
    output's gradient in the output's strides, as inductor's lowering gives it (its SDPA layout
    constraint); run uncompiled, the graph passes the gradient as it comes. On sd-scripts' Flux
    (H100, torch 2.11) it came with strides (70778880, 128, 15360, 1) against the output's
    (14155776, 589824, 128, 1), and cuDNN's backward failed with an illegal memory access."""
    target = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    calls = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is target]
    for node in calls:
        grad, out = node.args[0], node.args[4]  # (grad_out, query, key, value, out, ...)
        with gm.graph.inserting_before(node):
            node.args = (gm.graph.call_function(_laid_out_as, (grad, out)), *node.args[1:])
    if calls:
        gm.recompile()
    return gm


def _saved_bytes(saved: Sequence[Any], kept: Sequence[Any]) -> int:
    """Bytes of the storages of `saved` that are not storages of `kept`: the graph's inputs and
    outputs, which the step keeps anyway (the next block saves its input)."""
    known = {t.untyped_storage().data_ptr() for t in kept if isinstance(t, torch.Tensor)}
    total = 0
    for value in saved:
        if not isinstance(value, torch.Tensor):
            continue  # saved sizes (SymInts)
        storage = value.untyped_storage()
        if storage.data_ptr() not in known:
            known.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _layout(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return None
    return value.shape, value.stride(), value.dtype, value.device


def _as_called(value: Any, layout: Any) -> Any:
    """A kept input as the graph saw it. A tensor whose layout changed since (a swapped-out
    block's weight now on the CPU, an offloaded one emptied) is stood in for by zeros of the
    old layout: what a partition saves depends on the sizes, not on the values."""
    if layout is None or _layout(value) == layout:
        return value
    shape, stride, dtype, device = layout
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


@dataclass
class GraphRecord:
    """One traced training graph: its joint graph, what each budget asked for saves, its
    calls in the current step and the inputs of the first (with their layouts then)."""

    joint: torch.fx.GraphModule  # after the traced budget's partition; copies are partitioned again
    joint_inputs: Any
    partition_kwargs: dict[str, Any]
    saved_bytes: dict[float, int] = field(default_factory=dict)
    calls: int = 0
    inputs: list[tuple[Any, Any]] = field(default_factory=list)  # (value, layout) of the step's first call


class SavedBytesEstimate:
    """Traces graphs at `budget` (one of `candidates`) and measures the saved bytes of the
    candidates asked for."""

    def __init__(self, candidates: Sequence[float], budget: float) -> None:
        if budget not in candidates:
            raise ValueError(f"the traced budget {budget} is not one of the candidates {tuple(candidates)}")
        self.candidates = tuple(candidates)
        self.budget = budget
        self.graphs: list[GraphRecord] = []
        self._partition = _inductor_partition()
        self._pending: GraphRecord | None = None  # partitioned, its forward not compiled yet

    def backend(self) -> Callable:
        """An AOTAutograd backend (dynamo's graph in, a callable out) that records as above."""
        from torch._inductor.compile_fx import select_decomp_table

        return aot_autograd(
            fw_compiler=self._forward,
            bw_compiler=lambda gm, example_inputs: make_boxed_func(cudnn_attention_gradients_laid_out(gm).forward),
            inference_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
            partition_fn=self._partition_traced,
            decompositions=select_decomp_table(),
        )

    def new_step(self) -> None:
        """Count calls from zero: `added_bytes` is then of the next step."""
        for graph in self.graphs:
            graph.calls = 0

    def added_bytes(self, budget: float) -> int:
        """What the last step would have saved at `budget` beyond what it saved at the traced
        budget (negative: less). Call it before `release_inputs()`."""
        if budget not in self.candidates:
            raise ValueError(f"budget {budget} is not one of the candidates {self.candidates}")
        called = [g for g in self.graphs if g.calls]
        return sum(g.calls * (self._saved(g, budget) - g.saved_bytes[self.budget]) for g in called)

    def release_inputs(self) -> None:
        """Drop the inputs kept from the last step (they would add to the next step's peak)."""
        for graph in self.graphs:
            graph.inputs = []

    def _partition_traced(
        self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        # Inductor's joint-graph passes run once, here, on `joint` itself; other budgets partition
        # copies of the graph they and this partition left (the partitioner changes the graph it is given).
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            forward, backward = self._partition(joint, joint_inputs, **kwargs)
        self._pending = GraphRecord(joint, joint_inputs, kwargs)
        return forward, backward

    def _saved(self, graph: GraphRecord, budget: float) -> int:
        if budget not in graph.saved_bytes:
            with torch._functorch.config.patch(activation_memory_budget=budget):
                forward, _ = min_cut_rematerialization_partition(
                    copy.deepcopy(graph.joint), graph.joint_inputs, compiler="inductor", **graph.partition_kwargs
                )
            args = [_as_called(value, layout) for value, layout in graph.inputs]
            # As AOTAutograd runs a forward graph: without grad, and without autocast (the graph
            # holds its casts).
            with torch.no_grad(), _no_autocast():
                graph.saved_bytes[budget] = self._measure(graph, forward(*args), args)
        return graph.saved_bytes[budget]

    @staticmethod
    def _measure(graph: GraphRecord, outputs: Sequence[Any], args: Sequence[Any]) -> int:
        split = graph.partition_kwargs["num_fwd_outputs"]
        return _saved_bytes(outputs[split:], [*args, *outputs[:split]])

    def _forward(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        record, self._pending = self._pending, None
        run = gm.forward
        if record is None:  # a forward that was not partitioned here: nothing to measure
            return make_boxed_func(run)
        self.graphs.append(record)

        def forward(*args: Any) -> Any:
            record.calls += 1
            outputs = run(*args)
            if record.calls == 1:
                record.inputs = [(value, _layout(value)) for value in args]
                if self.budget not in record.saved_bytes:  # the traced budget: this call's own
                    record.saved_bytes[self.budget] = self._measure(record, outputs, args)
            return outputs

        return make_boxed_func(forward)


def _no_autocast() -> contextlib.AbstractContextManager:
    stack = contextlib.ExitStack()
    for device_type in ("cuda", "cpu"):
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack
