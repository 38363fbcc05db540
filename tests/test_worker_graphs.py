"""One graph handed to the compile workers (compile_accel.compile_workers.WorkerGraph): how it
is packed, what runs until it is back, how it switches to the compiled code or compiles here when
the worker's result cannot be loaded, and wait_and_load. Stand-in graphs and compilers
(tests/worker_stand_ins.py); the workers' real compiles: tests/test_compile_workers.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import threading
import time
import warnings
import weakref
from typing import Any, Callable

import pytest
import torch
from worker_stand_ins import WorkerError, as_traced, loaded_by_hand, returned_future, sine, traced_graph, worker_report
from torch import nn
from torch._functorch.aot_autograd import aot_module_simplified
from torch.nn.attention import SDPBackend, sdpa_kernel

from compile_accel import compile_workers
from compile_accel.compile_profile import CompileClock
from compile_accel.compile_workers import GraphState, WorkerCompile, WorkerGraph
from compile_accel.stats import Stats

pytestmark = pytest.mark.skipif(
    not compile_workers.SUPPORTED,
    reason="compile_workers needs torch's graph pickler and AOTAutograd's cache (torch >= 2.8) and a platform other than Windows",
)


def _checkpointed_sine(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(lambda a: (a @ w).sin() * 2.0, t, use_reentrant=False) + 1.0


def test_a_graph_with_a_checkpoint_traced_in_it_goes_to_a_worker_with_its_body() -> None:
    """A block compiled whole with the model's checkpoint left on (a checkpoint that a budget
    could not switch off) traces it as a higher-order op whose body is a graph of its own: packed
    and compiled with it (here as a worker would, by AOTAutograd)."""
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4)
    gm, inputs = traced_graph(_checkpointed_sine, x, w)
    assert any(isinstance(child, torch.fx.GraphModule) for child in gm.children())
    packed = compile_workers.packing.pack_graph(gm, inputs)
    assert isinstance(packed, bytes), packed
    compiled = compile_workers.packing.compile_packed(packed, torch._dynamo.lookup_backend("aot_eager"))
    x = torch.randn(3, 4, requires_grad=True)  # fresh: the compiled graph against eager
    (out,) = compiled(x, w)
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected = _checkpointed_sine(x, w)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), x)[0], rtol=1e-5, atol=1e-6)


@torch._dynamo.allow_in_graph
def _opaque_double(t: torch.Tensor) -> torch.Tensor:
    return t * 2.0


def test_a_graph_that_aotautograd_would_not_cache_stays_in_this_process() -> None:
    """What a worker compiles comes back through AOTAutograd's cache: a graph it would bypass
    (here a function of no library's in the graph; torch <= 2.11: a checkpoint traced in it) is
    not handed over, and the reason says so."""
    gm, inputs = traced_graph(lambda t: _opaque_double(t).sin(), torch.randn(3))
    reason = compile_workers.packing.pack_graph(gm, inputs)
    assert isinstance(reason, str) and reason.startswith("AOTAutograd would not cache it: "), reason


def test_a_graph_no_pool_takes_compiles_in_this_process_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def closed(*args: Any) -> None:
        raise RuntimeError("Attempting to use a closed pool")

    monkeypatch.setattr(compile_workers.POOL, "submit", closed)
    x = torch.randn(8, 8, requires_grad=True)
    gm, inputs = traced_graph(sine, x)
    stats, compiled_here = Stats(), []

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled_here.append(graph)
        if len(compiled_here) == 1:
            raise compile_workers.handing_over._NotCached  # the lookup in the caches: a miss
        return graph.forward

    with pytest.warns(RuntimeWarning, match=r"graph 5/0 could not be handed to a compile worker "
                      r"\(Attempting to use a closed pool\); it compiles in this process"):
        compiled = compile_workers.compile_in_workers(gm, inputs, as_traced, compile_here, stats, "graph 5/0", False)
    assert compiled_here == [gm, gm]  # looked up in the caches, then compiled
    torch.testing.assert_close(compiled(x)[0], sine(x))
    assert stats.worker_graphs_started == 0 and compile_workers.pending() == 0


def test_a_graph_whose_parameters_hold_gradients_goes_to_a_worker_on_stand_ins_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gradient accumulation over micro-batches of two shapes (no zero_grad between), or the
    precompile after a step whose loop zeroes gradients at the next step's start: a parameter's
    fake kept its .grad, which did not pickle, and the graph compiled in this process."""
    submitted: list[tuple] = []
    monkeypatch.setattr(compile_workers.POOL, "submit", lambda *args: submitted.append(args) or concurrent.futures.Future())
    monkeypatch.setattr(compile_workers.POOL, "misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)  # no look-up here
    weight = nn.Parameter(torch.randn(4, 4))
    weight.grad = torch.ones(4, 4)
    gm, inputs = traced_graph(lambda t: (t @ weight).sin(), torch.randn(3, 4))
    assert any(t.grad is not None for t in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # not "could not be handed to a compile worker"
        graph = compile_workers.compile_in_workers(gm, inputs, as_traced, as_traced, Stats(), "graph 15/0", False)
        precompiled = compile_workers.precompile_in_workers(gm, inputs, as_traced)
    assert isinstance(graph, WorkerGraph) and isinstance(precompiled, compile_workers.WorkerPrecompiled)
    assert len(submitted) == 2
    _, stand_ins = compile_workers.packing.unpack_graph(graph._packed)
    assert [(t.grad, t.requires_grad) for t in stand_ins] == [(None, t.requires_grad) for t in inputs]
    assert torch.equal(weight.grad, torch.ones(4, 4))  # the training's own gradient untouched


def test_after_a_run_of_misses_graphs_go_to_the_workers_unlooked_up_until_a_worker_finds_one_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cold, each look-up before a hand-over misses and costs the step AOTAutograd's cache key:
    after MISSES_BEFORE_COLD in a row the next graphs go without it; a worker that found its
    graph in the caches (they are warm after all) brings the look-up back."""
    submitted: list[concurrent.futures.Future] = []

    def submit(*args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.add_done_callback(compile_workers.POOL._back)
        submitted.append(future)
        return future

    monkeypatch.setattr(compile_workers.POOL, "submit", submit)
    monkeypatch.setattr(compile_workers.POOL, "_stop_when_idle", lambda: None)  # (no pool to stop)
    x = torch.randn(4, 4)
    gm, inputs = traced_graph(sine, x)
    looked_up = []

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        looked_up.append(graph)
        raise compile_workers.handing_over._NotCached  # every look-up misses

    def hand_over() -> Callable:
        return compile_workers.compile_in_workers(gm, inputs, as_traced, compile_here, Stats(), "graph 13/0", False)

    misses = compile_workers.MISSES_BEFORE_COLD
    graphs = [hand_over() for _ in range(misses + 2)]
    assert len(looked_up) == misses and len(submitted) == misses + 2
    assert all(isinstance(graph, WorkerGraph) for graph in graphs)
    submitted[0].set_result(worker_report(autograd_cache_miss=1, autograd_cache_saved=1))  # compiled: still cold
    hand_over()
    assert len(looked_up) == misses
    submitted[1].set_result(worker_report(autograd_cache_hit=1))  # its worker found it in the caches
    hand_over()
    assert len(looked_up) == misses + 1 and len(submitted) == misses + 4
    for future in submitted[2:]:
        future.set_result(worker_report())


OUTCOMES = {
    # what the worker's future gives -> why the graph compiled here
    "raised": (WorkerError("inductor raised in the worker"), r"WorkerError: inductor raised in the worker"),
    "bypassed": (worker_report(autograd_cache_bypass=1), r"AOTAutograd's cache cannot hold it"),
    "not_cached": (worker_report(autograd_cache_miss=1, autograd_cache_saved=1), r"what it compiled was not found"),
}


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_a_graph_the_worker_did_not_put_in_the_caches_compiles_here_once_with_a_warning(outcome: str) -> None:
    result, why = OUTCOMES[outcome]
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(sine, x)
    future: concurrent.futures.Future = concurrent.futures.Future()
    stats, compiled_here = Stats(), []

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # The packed graph, on fake inputs: as the worker compiled it.
        assert graph.code == gm.code and all(type(t).__name__ == "FakeTensor" for t in example_inputs)
        compiled_here.append(graph)
        return lambda t: (t * 100.0,)  # tells which one ran

    packed = compile_workers.packing.pack_graph(gm, inputs)
    switched_before = compile_workers.graphs_switched()
    graph = WorkerGraph(gm, packed, compile_here, future, stats, "graph 7/0", checkpointed=False)
    torch.testing.assert_close(graph(x)[0], sine(x), rtol=0, atol=0)  # not back: uncompiled
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
    # Back, but a trainer's checkpoint may run it again in this step's backward: uncompiled
    # until the next step starts.
    torch.testing.assert_close(graph(x)[0], sine(x), rtol=0, atol=0)
    assert compiled_here == []
    compile_workers.step_started()
    with pytest.warns(RuntimeWarning, match=f"graph 7/0 did not compile in a worker \\({why}.*\\); compiled in this process"):
        torch.testing.assert_close(graph(x)[0], x * 100.0, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, compiled once
        torch.testing.assert_close(graph(x)[0], x * 100.0, rtol=0, atol=0)
    assert len(compiled_here) == 1 and compile_workers.pending() == 0
    assert len(stats.worker_failures) == 1 and stats.worker_failures[0].startswith("graph 7/0: ")
    assert stats.worker_graphs_compiled == 0
    # Compiled here, it runs compiled: counted, so that the launcher saves its run cache again.
    assert compile_workers.graphs_switched() == switched_before + 1


def test_a_graph_that_compiles_neither_in_a_worker_nor_here_keeps_running_uncompiled() -> None:
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(sine, x)
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(WorkerError("inductor raised in the worker"))

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        raise WorkerError("inductor raised here too")

    stats, switched_before = Stats(), compile_workers.graphs_switched()
    graph = WorkerGraph(gm, compile_workers.packing.pack_graph(gm, inputs), compile_here, future, stats, "graph 8/0", True)
    with pytest.warns(RuntimeWarning, match=r"graph 8/0 did not compile in a worker .* nor here, and keeps running "
                      r"uncompiled: inductor raised here too"):
        torch.testing.assert_close(graph(x)[0], sine(x), rtol=0, atol=0)
    y = torch.randn(3, 4)
    torch.testing.assert_close(graph(y)[0], sine(y), rtol=0, atol=0)
    assert len(stats.worker_failures) == 1 and stats.worker_graphs_compiled == 0
    assert compile_workers.graphs_switched() == switched_before  # still uncompiled: nothing new to save


def test_a_graph_whose_model_is_gone_is_neither_pending_nor_loaded() -> None:
    """A graph handed over whose model (and dynamo's cache entry) was dropped before it ran
    compiled (a trainer that builds its model again) is no one's: wait_and_load does not compile
    it here nor run it on stand-ins, and pending() does not count it."""
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(sine, x)
    packed = compile_workers.packing.pack_graph(gm, inputs)
    loads: list = []
    back: concurrent.futures.Future = concurrent.futures.Future()
    back.set_result(worker_report())
    before = compile_workers.pending()
    graph = WorkerGraph(gm, packed, lambda *_: loads.append(1), back, Stats(), "graph 9/0", checkpointed=False)
    assert compile_workers.pending() == before + 1
    del graph
    gc.collect()
    assert compile_workers.pending() == before
    assert compile_workers.wait_and_load() == 0 and loads == []


def test_wait_and_load_waits_for_the_workers_then_loads_their_graphs_before_their_next_call() -> None:
    """--compile_workers_wait: the end of the first step waits for the workers and loads what they
    compiled, so that the next step runs compiled from its first call; auto's held graphs stay."""
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(sine, x)
    packed = compile_workers.packing.pack_graph(gm, inputs)

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # Under autocast, as handed over in the step (AOTAutograd's cache key holds it), not as now.
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] += 1  # as a load of the workers' entry
        return lambda t: (t * 100.0,)  # tells which one ran

    stats, held_stats = Stats(), Stats()
    back_later: concurrent.futures.Future = concurrent.futures.Future()
    back_already: concurrent.futures.Future = concurrent.futures.Future()
    back_already.set_result(worker_report())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = WorkerGraph(gm, packed, compile_here, back_later, stats, "graph 9/0", checkpointed=False)
        held = WorkerGraph(gm, packed, compile_here, back_already, held_stats, "graph 9/1", checkpointed=False)
    compile_workers.hold_switches(held_stats, True)
    timer = threading.Timer(0.3, back_later.set_result, args=(worker_report(),))
    started = time.monotonic()
    timer.start()
    try:
        assert compile_workers.wait_and_load() == 1
        assert time.monotonic() - started >= 0.25  # it waited for the worker
        # Compiled at its next call, though no step has started since it was back.
        torch.testing.assert_close(graph(x)[0], x * 100.0, rtol=0, atol=0)
        assert stats.worker_graphs_compiled == 1 and [c["graph"] for c in stats.worker_compiles] == ["graph 9/0"]
        torch.testing.assert_close(held(x)[0], sine(x), rtol=0, atol=0)  # held by auto: uncompiled
    finally:
        compile_workers.hold_switches(held_stats, False)
    assert compile_workers.wait_and_load() == 1 and compile_workers.pending() == 0  # released: loaded too
    torch.testing.assert_close(held(x)[0], x * 100.0, rtol=0, atol=0)
    assert not torch.is_autocast_enabled("cpu")  # put back


def test_wait_and_load_loads_each_graph_as_it_comes_back_while_the_others_still_compile() -> None:
    """The first step's wait ends with the slowest graph's compile, not that plus every graph's
    load: a graph back early is loaded (and run once) while a later one is still in its worker."""
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(sine, x)
    packed = compile_workers.packing.pack_graph(gm, inputs)
    back_later: concurrent.futures.Future = concurrent.futures.Future()
    pending_when_loaded = []

    def come_back() -> None:
        if not back_later.done():
            back_later.set_result(worker_report())

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        pending_when_loaded.append(not back_later.done())
        come_back()  # the late one's worker is done once the early one is loaded
        torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] += 1
        return graph.forward

    early = WorkerGraph(gm, packed, compile_here, returned_future(), Stats(), "graph 12/0", checkpointed=False)
    late = WorkerGraph(gm, packed, compile_here, back_later, Stats(), "graph 12/1", checkpointed=False)
    timer = threading.Timer(5.0, come_back)  # (so that waiting for every graph first fails, not hangs)
    timer.start()
    try:
        assert compile_workers.wait_and_load() == 2
    finally:
        timer.cancel()
    assert pending_when_loaded == [True, False]  # the early one while the late one compiled
    assert early.state is GraphState.LOADED and late.state is GraphState.LOADED and compile_workers.pending() == 0


def test_wait_and_load_runs_each_loaded_graph_once_on_zeros_and_leaves_the_training_as_it_was() -> None:
    """Its kernels' first run (autotuning, loading) falls in the first step, not the second, also
    inside a backward for a graph with grad, where a checkpoint recomputes it (on a GPU, on the
    autograd engine's thread); the stand-ins' gradients and the random numbers drawn are not the
    training's."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.empty_strided((3, 4), (1, 3)).copy_(torch.randn(3, 4))  # not contiguous: the stand-in has its strides
    gm, inputs = traced_graph(lambda t, weight: (t @ weight).sin() * torch.rand(1), x, w)
    packed = compile_workers.packing.pack_graph(gm, inputs)
    # One record per graph: wait_and_load loads them in the order their workers finish.
    runs: list[list[tuple]] = [[], [], []]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = WorkerGraph(gm, packed, loaded_by_hand(runs[0]), returned_future(), Stats(), "graph 10/0", True)
    recorded = WorkerGraph(gm, packed, loaded_by_hand(runs[1]), returned_future(), Stats(), "graph 10/1", True,
                           cuda_graphs=True)
    with torch.no_grad():
        without_grad = WorkerGraph(gm, packed, loaded_by_hand(runs[2]), returned_future(), Stats(), "graph 10/2", True)
    rng = torch.get_rng_state()
    assert compile_workers.wait_and_load() == 3
    # The CUDA graph's is not run: zeros are not where its weights are.
    [(stand_ins, autocast, in_backward), (recomputed, recomputed_autocast, recomputed_in_backward)], [], [
        (no_grad_stand_ins, _, no_grad_in_backward)
    ] = runs
    assert (in_backward, recomputed_in_backward, no_grad_in_backward) == (False, True, False)
    for run in (stand_ins, recomputed):
        assert [(t.shape, t.stride(), t.requires_grad) for t in run] == [
            (t.shape, t.stride(), t.requires_grad) for t in inputs
        ]
        assert all(not t.any() for t in run)
        assert run[1].grad is not None  # the backward ran, into the stand-in
    assert autocast and recomputed_autocast  # under the hand-over's autocast
    assert no_grad_stand_ins[1].grad is None  # handed over without grad: no backward
    assert w.grad is None and torch.equal(torch.get_rng_state(), rng)  # the training's own untouched
    graph(x, w)[0].sum().backward()
    recorded(x, w)
    without_grad(x, w)
    assert [len(r) for r in runs] == [3, 1, 2] and w.grad is not None  # all compiled, on the real inputs


def test_each_graph_loaded_says_when_in_the_first_step_it_was_handed_over_back_and_loaded() -> None:
    """The first step's timeline (stats()["worker_compiles"]): which graphs it waited for, and
    whether for their workers or for their loads here."""
    compile_workers.step_started()  # the first step starts: the timeline's zero
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(sine, x)
    future: concurrent.futures.Future = concurrent.futures.Future()
    stats = Stats()
    packed = compile_workers.packing.pack_graph(gm, inputs)
    graph = WorkerGraph(gm, packed, loaded_by_hand([]), future, stats, "graph 14/0", False)
    time.sleep(0.3)
    future.set_result(WorkerCompile({}, time.time() - 0.1, 0.1, CompileClock().since()))  # queued 0.2 s, compiled 0.1 s
    assert compile_workers.wait_and_load() == 1
    [record] = stats.worker_compiles
    assert 0 <= record["handed_over_at_s"] < record["back_at_s"] <= record["loaded_at_s"]
    assert record["back_at_s"] - record["handed_over_at_s"] >= 0.29 and record["queued_s"] >= 0.19
    assert record["first_run_s"] >= 0  # run once on zeros (a forward and a backward)
    assert graph.state is GraphState.LOADED


def test_a_graph_with_integer_inputs_or_whose_first_run_fails_runs_compiled_from_its_next_call() -> None:
    """Zeros as indices may index out of bounds (a device-side assert on a GPU): not run. A first
    run that raises is warned about."""
    x = torch.randn(3, 4)
    indexed_gm, indexed_inputs = traced_graph(lambda t, i: t[i] * 2.0, x, torch.tensor([2, 0]))
    gm, inputs = traced_graph(sine, x)
    runs: list[tuple] = []
    indexed = WorkerGraph(indexed_gm, compile_workers.packing.pack_graph(indexed_gm, indexed_inputs),
                          loaded_by_hand(runs), returned_future(), Stats(), "graph 11/0", True)
    failing = WorkerGraph(gm, compile_workers.packing.pack_graph(gm, inputs), loaded_by_hand(runs, fails=True), returned_future(),
                          Stats(), "graph 11/1", True)
    with pytest.warns(RuntimeWarning, match=r"graph 11/1: its first run on stand-in inputs failed \(RuntimeError: no "
                      r"kernel for zeros\); it runs compiled from its next call"):
        assert compile_workers.wait_and_load() == 2
    assert len(runs) == 1  # the failing one's; none for the indexed one
    torch.testing.assert_close(indexed(x, torch.tensor([2, 0]))[0], x[[2, 0]] * 2.0)
    torch.testing.assert_close(failing(x)[0], sine(x))
    assert len(runs) == 3  # both compiled


@pytest.mark.parametrize("checkpointed", [True, False])
def test_until_it_is_compiled_a_budgeted_graph_runs_under_a_checkpoint(checkpointed: bool) -> None:
    """A budget switched the block's own checkpointing off: uncompiled, the graph recomputes its
    forward in the backward instead of keeping every activation."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(lambda t, weight: (t @ weight).sin(), x, w)
    calls = []
    forward = gm.forward
    gm.forward = lambda *args: calls.append(1) or forward(*args)
    graph = WorkerGraph(gm, b"", lambda *a: None, concurrent.futures.Future(), Stats(), "graph 9/0", checkpointed)
    (out,) = graph(*inputs)
    (grad,) = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(grad, torch.autograd.grad((x @ w).sin().sum(), w)[0])
    assert len(calls) == (2 if checkpointed else 1)


def test_uncompiled_a_checkpoint_traced_in_the_graph_keeps_no_activation_of_its_body() -> None:
    """Blocks mode with the trainer's checkpointing on: dynamo traces the checkpoint as an op that
    torch 2.11 runs outside a compile as a plain call of its body (pytorch/pytorch#160773).
    Until compiled, the graph checkpoints for real: nothing of the body is kept for the backward,
    the gradients are eager's, and the graph left for the compile still holds the traced op."""
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    gm, inputs = traced_graph(_checkpointed_sine, x, w)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        (out,) = compile_workers.run_uncompiled(gm, inputs, checkpointed=False)
    # The checkpoint keeps its inputs; a plain call of the body would keep the matmul's product too.
    assert saved and all(t is x or t is w for t in saved)
    grads = torch.autograd.grad(out.sum(), (x, w))
    expected = _checkpointed_sine(x, w)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for grad, eager in zip(grads, torch.autograd.grad(expected.sum(), (x, w))):
        torch.testing.assert_close(grad, eager, rtol=1e-5, atol=1e-6)
    assert any(node.target is torch.ops.higher_order.tag_activation_checkpoint for node in gm.graph.nodes)


def test_graphs_run_uncompiled_are_freed_once_dropped() -> None:
    """Each graph's runnable version is kept for its next call, not beyond the graph's own life."""
    gm, inputs = traced_graph(_checkpointed_sine, torch.randn(3, 4), torch.randn(4, 4))
    plain, plain_inputs = traced_graph(sine, torch.randn(3))
    compile_workers.run_uncompiled(gm, inputs, checkpointed=False)
    compile_workers.run_uncompiled(plain, plain_inputs, checkpointed=False)
    graphs = [weakref.ref(gm), weakref.ref(plain)]
    del gm, plain, inputs, plain_inputs
    torch._dynamo.reset()
    gc.collect()
    assert [graph() for graph in graphs] == [None, None]


_CUDNN_ATTENTION_SEEN: list[bool] = []


@torch._dynamo.allow_in_graph
def _noting_cudnn_attention(t: torch.Tensor) -> torch.Tensor:
    _CUDNN_ATTENTION_SEEN.append(torch.backends.cuda.cudnn_sdp_enabled())
    return t * 1.0


def test_uncompiled_a_traced_checkpoint_recomputes_under_the_attention_backends_of_its_forward() -> None:
    """Uncompiled graphs run without cuDNN's attention; a checkpoint's recompute in the backward
    must too, or the attention it recomputes saves another kernel's values than its forward did
    (a CheckpointError on the GPU)."""
    x = torch.randn(3, 4, requires_grad=True)
    gm, inputs = traced_graph(
        lambda t: torch.utils.checkpoint.checkpoint(lambda a: _noting_cudnn_attention(a).sin(), t, use_reentrant=False), x
    )
    _CUDNN_ATTENTION_SEEN.clear()
    (out,) = compile_workers.run_uncompiled(gm, inputs, checkpointed=False)
    out.sum().backward()
    assert _CUDNN_ATTENTION_SEEN == [False, False]  # the forward, then the recompute
    torch.testing.assert_close(x.grad, x.cos())


def test_a_worker_compiles_under_the_training_process_grad_mode_autocast_and_flags() -> None:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = compile_workers.packing.runtime_state()
    assert state["grad"] is False and state["autocast"] == {"cpu": torch.bfloat16}
    flags = compile_workers.packing.precision_flags()
    before = [getattr(module, name) for module, name in flags]
    try:
        with compile_workers.packing.in_runtime_state(state):
            assert not torch.is_grad_enabled()
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert compile_workers.packing.runtime_state() == state
    finally:
        for (module, name), value in zip(flags, before, strict=True):
            setattr(module, name, value)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


_AOT_OPS: list[set] = []  # the ops of each forward graph `_aot_ops_noted` compiled


def _aot_ops_noted(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A compiler (picklable, as a job's is) noting the ops of AOTAutograd's forward graph."""

    def forward(graph: torch.fx.GraphModule, _: list) -> Callable:
        _AOT_OPS.append({node.target for node in graph.graph.nodes if node.op == "call_function"})
        return graph.forward

    return aot_module_simplified(gm, example_inputs, fw_compiler=forward)


@pytest.mark.parametrize("allowed", [None, [SDPBackend.MATH]], ids=["defaults", "math-only"])
def test_a_worker_compiles_attention_with_the_kernels_the_training_process_allows(
    allowed: list | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AOTAutograd's trace puts the attention kernel it chooses in the graph (its cache key does
    not hold the choice): a worker, whose flags are torch's defaults, chooses under the training
    process's. (The diffusers Flux bench turns cuDNN's off; workers that did not compiled it in.)"""
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    gm, inputs = traced_graph(lambda t: torch.nn.functional.scaled_dot_product_attention(t, t, t), q)
    with sdpa_kernel(allowed) if allowed else contextlib.nullcontext():
        job = compile_workers.packing.job(compile_workers.packing.pack_graph(gm, inputs), _aot_ops_noted)
    monkeypatch.setattr(compile_workers.worker, "get_ready", lambda: None)  # (no kernel pool here)
    _AOT_OPS.clear()
    defaults = compile_workers.packing.runtime_state()
    try:  # under torch's default flags, as a worker starts (which keeps the job's flags after)
        compile_workers.worker.compile_job(job, {})
    finally:
        compile_workers.packing.set_flags(defaults)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert (flash in _AOT_OPS[0]) is (allowed is None)
