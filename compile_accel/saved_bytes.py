"""The activation memory of every candidate budget, from one trace of each graph.

The min-cut partitioner decides, per budget, which forward values a graph saves for its
backward; everything else of a compile (dynamo's trace, AOTAutograd's joint graph) is the same
for every budget. `SavedBytesEstimate.backend()` is an AOTAutograd backend without inductor:
it traces each graph once and runs it partitioned at the traced budget, keeping the joint graph
(after inductor's joint-graph passes). It counts the calls of each graph: a graph's saved bytes
stay alive once per call until the backward.

`added_bytes(budget)`, asked after a step, is what a step at `budget` keeps beyond the traced
step. The first time a budget is asked for, each graph's joint graph is partitioned
at it (on a copy), up to the partitioner's choice of what to save: the bytes are read from the
fake values dynamo and AOTAutograd traced (storages, so a saved view keeps its whole base, as it
does in training), and the forward and backward graphs are never built (their extraction and
the backward's reordering: 20 of 46 s of SDXL U-Net's partitioning in a CPU profile).
Partitioning is most of what the estimate costs, so only the budgets asked for are partitioned:
auto bisects for the largest predicted to fit; and the min cuts a partition solves before its
budget matters are solved once per graph. The traced budget's own partition is counted the
same way, as it goes.

With compile workers, each graph goes to a worker as dynamo traced it instead, which traces and
partitions it the same way at every candidate (PartitionedPerBudget), while this process runs
the traced step with the graph uncompiled under a checkpoint (`add_checkpointed`): it keeps
nothing of the graph's but its inputs, so a budget adds all it saves. This process does not wait
for AOTAutograd's trace and the traced budget's partition (half of SDXL U-Net's traced step in a
CPU profile). A graph no worker partitioned is partitioned here the same way (warned about).

The traced graphs hold the attention kernels the compiled step would run (cuDNN's, where
torch picks it): the partitioner decides differently for them (cuDNN's attention is not among
its compute-intensive ops, flash and efficient attention are): traced with cuDNN's kernel ruled
out, a prediction overshoots the compiled step's peak and auto picks too small a budget
(benchmarks/results/h100_auto_lazy/README.md).

auto (compile_accel.auto_budget) uses it to compile and time only the budgets that should fit,
instead of compiling each candidate with inductor to find out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass, field
from typing import Any, Callable, NoReturn
from unittest import mock

import torch
import torch._functorch.config
import torch.fx
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import partitioners
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils._ordered_set import OrderedSet

from .stats import warn

PartitionFn = Callable[..., tuple[torch.fx.GraphModule, torch.fx.GraphModule]]


def _inductor_partition() -> PartitionFn:
    """The partition inductor itself runs: its joint-graph passes, then the min-cut partitioner
    (a torch without the module-level function: the partitioner alone)."""
    from torch._inductor import compile_fx

    partition = getattr(compile_fx, "partition_fn", None)
    if partition is not None:
        return partition
    return functools.partial(partitioners.min_cut_rematerialization_partition, compiler="inductor")


def _laid_out_as(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`grad` with the strides of `out` (a copy when they differ)."""
    if grad.stride() == out.stride():
        return grad
    return torch.empty_strided(out.shape, out.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


def cudnn_attention_gradients_laid_out(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` (a backward graph, changed in place) with each cuDNN attention backward given the
    output's gradient in the output's strides, as inductor's lowering gives it (its SDPA layout
    constraint); run uncompiled, the graph passes the gradient as it comes, in other strides than
    the output's, and cuDNN's backward fails with an illegal memory access (torch 2.11;
    benchmarks/results/h100_auto_lazy/README.md)."""
    target = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    calls = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is target]
    for node in calls:
        grad, out = node.args[0], node.args[4]  # (grad_out, query, key, value, out, ...)
        with gm.graph.inserting_before(node):
            node.args = (gm.graph.call_function(_laid_out_as, (grad, out)), *node.args[1:])
    if calls:
        gm.recompile()
    return gm


def _size(size: int | torch.SymInt) -> int:
    """A size, or a symbolic size's value in the traced call (its hint)."""
    if isinstance(size, int):
        return size
    if size.node.hint is None:
        raise RuntimeError(
            "activation_memory_budget='auto' cannot predict a graph that saves a tensor of data-dependent size"
        )
    return int(size.node.hint)


def _saved_bytes(graph: torch.fx.Graph, saved: Sequence[torch.fx.Node], num_fwd_outputs: int) -> int:
    """Bytes of the storages of the traced values of `saved` (nodes of `graph`) that are not
    storages of the graph's inputs or forward outputs, which the step keeps anyway (the next
    block saves its input)."""

    def storage(node: torch.fx.Node) -> torch.UntypedStorage | None:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not torch._C._has_storage(value):
            return None  # saved sizes (SymInts)
        return value.untyped_storage()

    outputs = pytree.arg_tree_leaves(*(node.args for node in graph.find_nodes(op="output")))
    kept = [*graph.find_nodes(op="placeholder"), *outputs[:num_fwd_outputs]]
    known = {s._cdata for s in map(storage, kept) if s is not None}
    total = 0
    for value in map(storage, saved):
        if value is not None and value._cdata not in known:
            known.add(value._cdata)
            total += _size(value.nbytes())
    return total


class _SavedValuesChosen(Exception):
    """Raised where the partitioner would build the forward and backward graphs."""


_counting = threading.Lock()  # one patch at a time: overlapping ones would restore each other's


@contextlib.contextmanager
def _counting_saved_values(num_fwd_outputs: int, stop: bool) -> Iterator[list[int]]:
    """Inside, a partition on this thread appends the bytes of what the partitioner chose to save
    to the list yielded, where it would extract the forward and backward graphs
    (`_extract_fwd_bwd_modules`, called so in torch 2.8 to 2.14), and with `stop` goes no
    further (_SavedValuesChosen). The extraction then drops saved values the backward does not
    use (a min cut's are all used) and may quantize or offload them (config, off by default):
    not counted, the same for every budget."""
    extract = partitioners._extract_fwd_bwd_modules
    thread = threading.get_ident()
    counted: list[int] = []

    def counting(joint: torch.fx.GraphModule, saved_values: list[torch.fx.Node], *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != thread:  # another thread's compile: as it is
            return extract(joint, saved_values, *args, **kwargs)
        counted.append(_saved_bytes(joint.graph, saved_values, num_fwd_outputs))
        if stop:
            raise _SavedValuesChosen
        return extract(joint, saved_values, *args, **kwargs)

    with _counting, mock.patch.object(partitioners, "_extract_fwd_bwd_modules", counting):
        yield counted


# A min cut as remembered: the names of the saved values and of the nodes banned from recomputation.
MinCuts = dict[tuple, tuple[list[str], list[str]]]


@contextlib.contextmanager
def _remembering_min_cuts(min_cuts: MinCuts) -> Iterator[None]:
    """Inside, the partitioner's min cuts on this thread are solved once per graph and options
    (kept in `min_cuts`, by node name: each partition gets a copy of the joint graph). A
    budget between 0 and 1 solves up to three min cuts (default, more and fully aggressive
    recomputation) that do not depend on the budget, before the knapsack that does; remembered,
    a graph's later partitions take a fifth of the time
    (benchmarks/results/h200_auto_one_trace/README.md). Called so, with these arguments, in
    torch 2.11 to 2.14."""
    solve = partitioners.solve_min_cut
    thread = threading.get_ident()

    def remembered(joint_graph: torch.fx.Graph, node_info: Any, min_cut_options: Any, dont_ban: Any = None) -> Any:
        if threading.get_ident() != thread:  # another thread's compile: as it is
            return solve(joint_graph, node_info, min_cut_options, dont_ban)
        key = (astuple(min_cut_options), frozenset(node.name for node in dont_ban or ()))
        if key not in min_cuts:
            saved, banned = solve(joint_graph, node_info, min_cut_options, dont_ban)
            min_cuts[key] = ([node.name for node in saved], [node.name for node in banned])
        nodes = {node.name: node for node in joint_graph.nodes}
        saved, banned = min_cuts[key]
        return [nodes[name] for name in saved], OrderedSet(nodes[name] for name in banned)

    with mock.patch.object(partitioners, "solve_min_cut", remembered):
        yield


@contextlib.contextmanager
def _without_python_code() -> Iterator[None]:
    """Inside, graph modules on this thread do not generate their Python code: a partition
    stopped at its choice never runs the joint graph, its copy or the partitioner's clean-up of
    it, and generating their code took a sixth of a full-size SDXL graph's partitions (CPU
    profile, torch 2.14)."""
    recompile = torch.fx.GraphModule.recompile
    thread = threading.get_ident()

    def only_elsewhere(module: torch.fx.GraphModule) -> Any:
        return recompile(module) if threading.get_ident() != thread else None

    with mock.patch.object(torch.fx.GraphModule, "recompile", only_elsewhere):
        yield


def partition_saved_bytes(
    joint: torch.fx.GraphModule,
    joint_inputs: Any,
    budget: float,
    min_cuts: MinCuts | None = None,
    **partition_kwargs: Any,
) -> int:
    """What the min-cut partition of `joint` (left as it is) at `budget` saves for the backward,
    as the partitioner chose it (stopped there: the two graphs are not built). `min_cuts`: the
    min cuts of earlier partitions of `joint`, used and added to (_remembering_min_cuts)."""
    with torch._functorch.config.patch(activation_memory_budget=budget):
        # The lock (_counting_saved_values) first: the other patches go on and off under it.
        with (
            _counting_saved_values(partition_kwargs["num_fwd_outputs"], stop=True) as counted,
            _remembering_min_cuts({} if min_cuts is None else min_cuts),
            _without_python_code(),
        ):
            try:
                partitioners.min_cut_rematerialization_partition(
                    copy.deepcopy(joint), joint_inputs, compiler="inductor", **partition_kwargs
                )
            except _SavedValuesChosen:
                return counted[-1]
    raise RuntimeError("torch's min-cut partitioner returned without extracting the forward and backward graphs")


@dataclass
class GraphRecord:
    """One traced training graph: its joint graph, what each budget asked for saves, what the
    traced step saved of it, and its calls in the counted step (SavedBytesEstimate.new_step)."""

    # After the traced budget's partition; copies are partitioned again. None for a graph the
    # traced step ran uncompiled under a checkpoint (`partition_here` partitions it).
    joint: torch.fx.GraphModule | None
    joint_inputs: Any
    partition_kwargs: dict[str, Any]
    traced_saved: int  # bytes the traced step kept per call (0 under a checkpoint)
    saved_bytes: dict[float, int] = field(default_factory=dict)
    min_cuts: MinCuts = field(default_factory=dict)  # solved by its partitions so far
    calls: int = 0
    # With compile workers: a worker's PartitionedPerBudget of the same graph, read in place of
    # partitions here once a budget is asked for.
    in_worker: concurrent.futures.Future | None = None
    # For a graph without a joint graph here: the worker's job, run here ({budget: bytes}).
    partition_here: Callable[[], dict[float, int]] | None = None


# How long after the counted step the workers have for their partitions of its graphs: a graph
# still out then is partitioned here (SDXL U-Net's largest graph takes ~30 s in a worker).
WORKER_PARTITIONS_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class PartitionedPerBudget:
    """A compile worker's job (compile_accel.compile_workers.run_in_worker): the graph traced as
    SavedBytesEstimate traces it, then what its partition at each candidate saves. Returns
    {budget: bytes}; {} for a graph without a backward."""

    candidates: tuple[float, ...]
    budget: float

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> dict[float, int]:
        from torch._inductor.compile_fx import select_decomp_table

        def partition_every_budget(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> NoReturn:
            # As the traced step partitions it here (whole: inductor's joint-graph passes may
            # trace and partition graphs of their own on the way), then every other budget.
            estimate = SavedBytesEstimate(self.candidates, self.budget)
            estimate._partition_traced(joint, joint_inputs, **kwargs)
            graph = estimate._pending
            raise _EveryBudgetPartitioned({budget: estimate._saved(graph, budget) for budget in self.candidates})

        trace = aot_autograd(
            fw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),  # (a graph without backward)
            partition_fn=partition_every_budget,
            decompositions=select_decomp_table(),
        )
        try:
            trace(gm, example_inputs)
        except _EveryBudgetPartitioned as partitioned:
            return partitioned.saved
        return {}


class _EveryBudgetPartitioned(BaseException):
    """Ends AOTAutograd's trace once every budget is partitioned (not an Exception: nothing on the
    way takes it for a failure)."""

    def __init__(self, saved: dict[float, int]) -> None:
        self.saved = saved


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
        self._in_counted_step = False  # between new_step() and end_step()
        self._eager_calls = 0  # counted calls that ran eager in place of the next graph called
        self._partitions_deadline = 0.0  # time.monotonic() by which the workers' partitions are due

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
        """Count calls from zero until `end_step`: `added_bytes` is then of that step (the
        training steps that run the traced graphs while workers partition them do not count)."""
        for graph in self.graphs:
            graph.calls = 0
        self._eager_calls = 0
        self._in_counted_step = True

    def end_step(self) -> None:
        """The counted step is over: later calls are not counted, and the workers' partitions of
        its graphs are due within WORKER_PARTITIONS_TIMEOUT_SECONDS."""
        self._in_counted_step = False
        self._partitions_deadline = time.monotonic() + WORKER_PARTITIONS_TIMEOUT_SECONDS

    @property
    def counting_calls(self) -> bool:
        return self._in_counted_step

    def called(self, graph: GraphRecord) -> None:
        """One call of `graph` (counted inside the counted step only)."""
        if self._in_counted_step:
            graph.calls += 1 + self._eager_calls
            self._eager_calls = 0

    def ran_eager(self) -> None:
        """A call that ran eager in place of a graph: a block class's first call
        (compile_accel.region_inputs), counted as a call of the next graph called."""
        if self._in_counted_step:
            self._eager_calls += 1

    def partitions_out(self) -> bool:
        """Whether a compile worker is still partitioning a graph the counted step called, and
        its time is not up."""
        return time.monotonic() < self._partitions_deadline and any(
            g.calls and g.in_worker is not None and not g.in_worker.done() for g in self.graphs
        )

    def added_bytes(self, budget: float) -> int:
        """What the last step would have saved at `budget` beyond what the traced step kept
        (negative: less)."""
        if budget not in self.candidates:
            raise ValueError(f"budget {budget} is not one of the candidates {self.candidates}")
        called = [g for g in self.graphs if g.calls]
        return sum(g.calls * (self._saved(g, budget) - g.traced_saved) for g in called)

    def add_checkpointed(
        self, in_worker: concurrent.futures.Future, partition_here: Callable[[], dict[float, int]]
    ) -> GraphRecord:
        """Record a training graph that the traced step runs uncompiled under a checkpoint while
        a worker partitions it (`in_worker`, a PartitionedPerBudget's future); the caller
        counts its calls."""
        record = GraphRecord(None, None, {}, traced_saved=0, in_worker=in_worker, partition_here=partition_here)
        self.graphs.append(record)
        return record

    def _partition_traced(
        self, joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        # Inductor's joint-graph passes run once, here, on `joint` itself; other budgets partition
        # copies of the graph they and this partition left (the partitioner changes the graph it is given).
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            with _counting_saved_values(kwargs["num_fwd_outputs"], stop=False) as counted:
                forward, backward = self._partition(joint, joint_inputs, **kwargs)
        self._pending = GraphRecord(joint, joint_inputs, kwargs, counted[-1], saved_bytes={self.budget: counted[-1]})
        return forward, backward

    def worker_job(self) -> PartitionedPerBudget:
        """What a compile worker runs for a graph this estimate traces, to partition it there."""
        return PartitionedPerBudget(self.candidates, self.budget)

    def _saved(self, graph: GraphRecord, budget: float) -> int:
        if budget not in graph.saved_bytes and graph.in_worker is not None:
            future, graph.in_worker = graph.in_worker, None
            try:
                from_worker = future.result(timeout=max(0.0, self._partitions_deadline - time.monotonic()))
                graph.saved_bytes = {**self._every_budget(from_worker), **graph.saved_bytes}
            except Exception as error:  # the worker's error, or a worker stuck: the same partitions, here
                warn(
                    f"auto: a compile worker did not partition a traced graph ({type(error).__name__}: {error}); "
                    "partitioning it here"
                )
        if budget not in graph.saved_bytes and graph.joint is None:
            graph.saved_bytes = self._every_budget(graph.partition_here())
        if budget not in graph.saved_bytes:
            graph.saved_bytes[budget] = partition_saved_bytes(
                graph.joint, graph.joint_inputs, budget, graph.min_cuts, **graph.partition_kwargs
            )
        return graph.saved_bytes[budget]

    def _every_budget(self, saved: dict[float, int]) -> dict[float, int]:
        """A PartitionedPerBudget's result: {} is a graph without a backward (AOTAutograd decides
        that in the worker), which saves nothing."""
        return saved or dict.fromkeys(self.candidates, 0)

    def _forward(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        record, self._pending = self._pending, None
        run = gm.forward
        if record is None:  # a forward that was not partitioned here: nothing to measure
            return make_boxed_func(run)
        self.graphs.append(record)

        def forward(*args: Any) -> Any:
            self.called(record)
            return run(*args)

        return make_boxed_func(forward)
