"""The activation memory of every candidate budget, from one trace of each graph.

The min-cut partitioner decides, per budget, which forward values a graph saves for its
backward; everything else of a compile (dynamo's trace, AOTAutograd's joint graph) is the same
for every budget. `SavedBytesEstimate.backend()` is an AOTAutograd backend without inductor:
it traces each graph once, partitions the joint graph at every candidate budget (on copies;
the graph itself runs partitioned at the budget it was compiled with), and at the graph's first
call runs each candidate's forward graph on the real inputs, to read the bytes of what that
partition saves (storages, so a saved view keeps its whole base, as it does in training). It
counts the calls of each graph: a graph's saved bytes stay alive once per call until the
backward. `added_bytes(budget)` is then what a step at `budget` keeps beyond a step at the
traced budget.

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


def traced_step_attention() -> contextlib.AbstractContextManager:
    """SDPA kernels for the traced step: any but cuDNN's. Its backward, run uncompiled from an
    AOTAutograd graph, hit an illegal memory access on sd-scripts' Flux (H100, torch 2.11,
    under CUDA_LAUNCH_BLOCKING: `mha_graph.execute` failed); flash attention saves tensors of
    the same sizes (output and log-sum-exp)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


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


@dataclass
class GraphRecord:
    """One traced training graph: its forward at each other candidate budget, and what each
    budget saves (the traced budget's own forward is the graph's)."""

    forwards: dict[float, torch.fx.GraphModule]
    num_fwd_outputs: int
    saved_bytes: dict[float, int] = field(default_factory=dict)  # filled at the first call
    calls: int = 0


class SavedBytesEstimate:
    """Traces graphs at `budget` (one of `candidates`) and measures every candidate's saved bytes."""

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
            bw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
            inference_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
            partition_fn=self._partition_all,
            decompositions=select_decomp_table(),
        )

    def new_step(self) -> None:
        """Count calls from zero: `added_bytes` is then of the next step."""
        for graph in self.graphs:
            graph.calls = 0

    def added_bytes(self, budget: float) -> int:
        """What a step at `budget` saves beyond a step at the traced budget (negative: less)."""
        return sum(g.calls * (g.saved_bytes[budget] - g.saved_bytes[self.budget]) for g in self.graphs if g.saved_bytes)

    def _partition_all(
        self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        # The traced budget first: inductor's joint-graph passes run once, on `joint` itself;
        # the other budgets partition copies of the graph they left (the partitioner changes
        # the graph it is given).
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            forward, backward = self._partition(joint, joint_inputs, **kwargs)
        forwards = {}
        for budget in self.candidates:
            if budget != self.budget:
                with torch._functorch.config.patch(activation_memory_budget=budget):
                    forwards[budget], _ = min_cut_rematerialization_partition(
                        copy.deepcopy(joint), joint_inputs, compiler="inductor", **kwargs
                    )
        self._pending = GraphRecord(forwards, num_fwd_outputs=kwargs["num_fwd_outputs"])
        return forward, backward

    def _forward(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        record, self._pending = self._pending, None
        run = gm.forward
        if record is None:  # a forward that was not partitioned here: nothing to measure
            return make_boxed_func(run)
        self.graphs.append(record)

        def saved(outputs: Sequence[Any], args: Sequence[Any]) -> int:
            split = record.num_fwd_outputs
            return _saved_bytes(outputs[split:], [*args, *outputs[:split]])

        def forward(*args: Any) -> Any:
            record.calls += 1
            if record.saved_bytes:
                return run(*args)
            for budget, candidate in record.forwards.items():
                record.saved_bytes[budget] = saved(candidate(*args), args)
            record.forwards = {}  # measured: the graphs are not needed again
            outputs = run(*args)  # the traced budget's own forward: measured from this call
            record.saved_bytes[self.budget] = saved(outputs, args)
            return outputs

        return make_boxed_func(forward)

