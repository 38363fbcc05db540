"""activation_memory_budget="auto": selection logic, the predicted peaks against measured ones,
calibration on the first training step (with a scripted measurement), the search against an
exhaustive one, the cache, and a training step left as it would have been."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import time

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error

import compile_accel
from compile_accel import CompileConfig, compile_workers
from compile_accel import BlockOffloadConductor, saved_bytes
from compile_accel.auto_budget import (
    CANDIDATES,
    GIB,
    AutoBudget,
    CacheEntry,
    Measurement,
    OffloadLadder,
    PredictedPeak,
    cache_path,
    choose,
    predict_largest_fitting,
)
from compile_accel.auto_budget.search import next_rung
from compile_accel.memory import SavedActivationMeter
from compile_accel.saved_bytes import SavedBytesEstimate
from compile_accel.stats import Stats

# The min-cut partitioner with the budget, without inductor's code generation: calibration
# compiles candidates, and this keeps that quick on a CPU.
BACKEND = "aot_eager_decomp_partition"


@pytest.mark.parametrize(
    "free_gib, reserved_gib, limit_gib",
    [
        (10.0, 4.0, 13.0),  # what is free and what this process holds, less 1 GiB
        (20.0, 10.0, 24.0 - 1.2),  # spilled (Windows): the GPU's 24 GiB, less 5% of it
    ],
)
def test_the_default_limit_is_free_and_reserved_memory_never_past_the_gpus_own(
    monkeypatch: pytest.MonkeyPatch, free_gib: float, reserved_gib: float, limit_gib: float
) -> None:
    from types import SimpleNamespace

    from compile_accel.auto_budget import default_limit_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * GIB), 24 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved_gib * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=24 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0, raising=False)
    assert default_limit_bytes(torch.device("cuda", 0)) == pytest.approx(limit_gib * GIB, abs=1)


def test_auto_times_the_backward_of_every_differentiable_output_also_inside_plain_objects() -> None:
    """What auto's timed step sums into its loss: the tensors requiring grad in tuples, dicts and
    in a plain object's attributes (sd-scripts' SD 1.x U-Net returns one), not the others."""
    from types import SimpleNamespace

    from compile_accel.autograd_graph import differentiable_outputs

    weight = torch.randn(3, requires_grad=True)
    a, b, c = weight * 2, weight + 1, weight.sum()
    output = (SimpleNamespace(sample=a, steps=4, mask=torch.ones(3)), {"extra": [b, torch.zeros(2)]}, c)
    assert [id(t) for t in differentiable_outputs(output)] == [id(a), id(b), id(c)]
    assert differentiable_outputs(SimpleNamespace(sample=torch.ones(2))) == []


def test_choose_fastest_within_the_limit() -> None:
    table = [Measurement(0.0, 1.0, 5), Measurement(0.5, 0.7, 8), Measurement(1.0, 0.5, 12)]
    assert choose(table, 10) == (table[1], True)
    assert choose(table, 12) == (table[2], True)
    assert choose(table, 4) == (table[0], False)  # nothing fits: the lowest peak


def _budget(acceleration: compile_accel.Acceleration) -> float:
    """The budget every compiled function of `acceleration` runs at now."""
    (budget,) = {shared.backend.budget for shared in {r.shared for r in acceleration.regions}}
    return budget


def _scripted(acceleration: compile_accel.Acceleration, calls: list[float], out_of_memory_from: float = 2.0):
    """A measurement that runs the step (so the budget really compiles) and reports the numbers
    of PEAKS and SECONDS; from budget `out_of_memory_from` on, the backward runs out of memory."""

    def measure(run, device, parameters):
        budget = _budget(acceleration)
        calls.append(budget)
        if budget >= out_of_memory_from:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(torch.Tensor, "backward", _out_of_memory(torch.Tensor.backward))
                run()
        run()
        return SECONDS[budget], int(PEAKS[budget] * GIB)

    return measure


def _scripted_prediction(acceleration: compile_accel.Acceleration, error_gib: float = 0.0):
    """The real prediction (its traced step runs), answering PEAKS plus `error_gib` instead."""
    real = acceleration.auto_budget.predict

    def predict(run, device, parameters, counts, limit):
        assert real(run, device, parameters, counts, limit)  # the traced step predicted something
        return {budget: int((PEAKS[budget] + error_gib) * GIB) for budget in acceleration.auto_budget.candidates}

    return predict


def _out_of_memory(real_backward):
    def backward(tensor: torch.Tensor, *args, **kwargs) -> None:
        real_backward(tensor, *args, **kwargs)  # gradients written, then the allocator gives up
        raise torch.OutOfMemoryError("CUDA out of memory (scripted)")

    return backward


PEAKS = {0.0: 1.0, 0.1: 1.5, 0.3: 2.0, 0.5: 2.5, 0.7: 3.0, 0.8: 3.5, 1.0: 4.0}
SECONDS = {0.0: 0.9, 0.1: 0.8, 0.3: 0.7, 0.5: 0.6, 0.7: 0.5, 0.8: 0.45, 1.0: 0.4}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test starts with its own, empty auto-budget cache."""
    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path))


def _model(checkpointing: str | None = None) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """One block class: each candidate compiles one graph. (test_chosen_budget_... keeps both
    classes: every class's compiled function takes the chosen budget.)"""
    return build("kohya", checkpointing, **ONE_BLOCK_CLASS)


def _auto(
    model: torch.nn.Module,
    limit_gib: float,
    calls: list[float],
    candidates: tuple[float, ...] = CANDIDATES,
    out_of_memory_from: float = 2.0,
    **config,
) -> compile_accel.Acceleration:
    """apply() with activation_memory_budget="auto", measured by the scripted PEAKS/SECONDS table
    (and predicted by the real traced step); fewer candidates calibrate faster."""
    config = CompileConfig(
        mode="blocks", activation_memory_budget="auto", vram_limit_gib=limit_gib, backend=BACKEND, **config
    )
    acceleration = compile_accel.apply(model, config)
    acceleration.auto_budget.measure = _scripted(acceleration, calls, out_of_memory_from)
    acceleration.auto_budget.candidates = candidates
    return acceleration


def test_calibration_picks_the_fastest_fitting_budget_and_leaves_training_unchanged() -> None:
    model, params = _model("non-reentrant")
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)

    calls: list[float] = []
    acceleration = _auto(model, 2.6, calls, candidates=(0.0, 0.5, 0.7, 1.0))
    # Predicted 0.6 GiB too low: 0.7 is predicted to fit (2.4 GiB) and 1.0 not (3.4 GiB).
    acceleration.auto_budget.predict = _scripted_prediction(acceleration, error_gib=-0.6)
    assert acceleration.stats()["auto_budget"] is None
    rng = torch.get_rng_state()
    loss, grads = lora_step(model, params, inputs)

    assert calls == [0.7, 0.5]  # 0.7 measured over the limit, then the next smaller one fits
    result = acceleration.stats()["auto_budget"]
    assert result["budget"] == 0.5 and result["fits"] and not result["cached"]  # fastest under 2.6 GiB
    assert [(row["budget"], row["peak_bytes"]) for row in result["predicted"]] == [
        (b, int((PEAKS[b] - 0.6) * GIB)) for b in (0.0, 0.5, 0.7, 1.0)
    ]
    assert _budget(acceleration) == 0.5
    assert torch.equal(torch.get_rng_state(), rng)
    # The step that triggered calibration is the step the model would have taken.
    assert relative_error(loss, expected_loss) < 1e-4
    assert all(relative_error(g, e) < 1e-4 for g, e in zip(grads, expected_grads, strict=True))
    assert cache_path().is_file()

    # The same training again: the cache answers, nothing is measured.
    torch._dynamo.reset()
    again, params = _model("non-reentrant")
    calls.clear()
    acceleration = _auto(again, 2.6, calls, candidates=(0.0, 0.5, 0.7, 1.0))
    lora_step(again, params, inputs)
    assert calls == []
    assert acceleration.stats()["auto_budget"]["cached"] and acceleration.stats()["auto_budget"]["budget"] == 0.5


@pytest.mark.parametrize("base_compute", [None, "int8"])
def test_predicted_peaks_are_what_each_budget_saves(monkeypatch, base_compute: str | None) -> None:
    """The traced step's prediction for every candidate against the bytes autograd saves in a
    step compiled at that budget (the CPU's peak), on the same batch: within 1% of the largest.
    Budgets are partitioned when first asked for (bisection for the largest predicted to fit),
    and once. With int8 base compute the prediction is of the int8 graphs (which save int8
    activations)."""
    model, _ = _model()
    inputs = inputs_for(model)
    acceleration = _auto(model, 1.0, [], base_compute=base_compute)
    partitioned: list[float] = []
    real_partition = saved_bytes.partition_saved_bytes

    def partition(joint, joint_inputs, budget, *args, **kwargs):
        partitioned.append(budget)
        return real_partition(joint, joint_inputs, budget, *args, **kwargs)

    monkeypatch.setattr(saved_bytes, "partition_saved_bytes", partition)
    predictions = []
    first_step = []

    def predict(run, device, parameters, counts, limit):
        real = acceleration.auto_budget._predict
        # The first traced step is also where each block class's first call runs eager
        # (compile_accel.region_inputs); it predicts within 1% too, the steps after it alike.
        first_step.append(real(run, device, parameters, counts, limit=-1))
        predictions.append(real(run, device, parameters, counts, limit=-1))  # over at the traced budget
        predictions.append(real(run, device, parameters, counts, limit=predictions[0][0.0]))  # only it fits
        predictions.append(real(run, device, parameters, counts, limit=2**62))  # all fit
        predictions.append(real(run, device, parameters, counts, limit=predictions[2][0.5] - 1))  # up to 0.3
        predictions.append(real(run, device, parameters, counts, limit=predictions[2][0.8] - 1))  # up to 0.7
        raise KeyboardInterrupt  # stop after the predictions

    acceleration.auto_budget.predict = predict
    with pytest.warns(RuntimeWarning, match="calibration stopped"), pytest.raises(KeyboardInterrupt):
        lora_step(model, [], inputs)
    low, traced, top, below_half, below_08 = predictions
    assert list(low) == [0.0] and list(traced) == [0.0, 0.5, 0.1] and list(top) == [0.0, 0.5, 0.8, 1.0]
    assert list(below_half) == [0.0, 0.5, 0.1, 0.3] and list(below_08) == [0.0, 0.5, 0.8, 0.7]
    predicted = {**traced, **top, **below_half, **below_08}
    assert all(p[0.0] == predicted[0.0] for p in predictions) and traced[0.5] == top[0.5]
    assert partitioned == [0.5, 0.1, 0.8, 1.0, 0.3, 0.7]  # one graph: each other budget once, when first asked for
    acceleration.remove()
    measured = {}
    for budget in CANDIDATES:
        torch._dynamo.reset()
        config = CompileConfig(
            mode="blocks", activation_memory_budget=budget, backend=BACKEND, base_compute=base_compute
        )
        compiled = compile_accel.apply(model, config)
        lora_step(model, [], inputs)  # (its first block runs eager: compile_accel.region_inputs)
        with SavedActivationMeter(model.parameters()) as meter:
            model(*inputs).square().mean()
        measured[budget] = meter.bytes
        if base_compute:
            assert compiled.stats()["base_compute"]["in_8_bits"] > 0
        compiled.remove()
    assert measured[1.0] > 2 * measured[0.0]  # the budgets differ enough for this to test something
    for budget in CANDIDATES:
        assert abs(predicted[budget] - measured[budget]) <= 0.01 * measured[1.0], (budget, predicted, measured)
    assert abs(first_step[0][0.0] - measured[0.0]) <= 0.01 * measured[1.0], (first_step, measured)


@pytest.mark.parametrize("fits_up_to", [-1, 0, 1, 2, 3, 4, 5])
def test_bisection_predicts_the_largest_fitting_and_the_next_larger_with_few_partitions(fits_up_to: int) -> None:
    asked = []

    def predict(budget: float) -> int:
        asked.append(budget)
        return 0 if CANDIDATES.index(budget) <= fits_up_to else 2

    predicted: dict[float, int] = {}
    predict_largest_fitting(CANDIDATES, predict, 1, predicted)
    fitting = [b for b, peak in predicted.items() if peak <= 1]
    assert max(fitting, default=None) == (CANDIDATES[fits_up_to] if fits_up_to >= 0 else None)
    if 0 <= fits_up_to < len(CANDIDATES) - 1:
        assert CANDIDATES[fits_up_to + 1] in predicted  # the next larger, predicted over
    assert len(asked) == len(set(asked)) <= 4  # the lowest, then at most three of the five others


@pytest.mark.parametrize("rungs", [1, 2, 5, 9])
def test_the_ladder_climb_finds_the_lowest_fitting_rung_then_goes_up_while_faster(rungs: int) -> None:
    """next_rung walked to its end, the state a dict (as a search paused for the compile workers
    keeps it), over every rung a fit can start at and random step times: the first rung; the
    lowest that fits, with the one under it seen not to; upward only while each rung is faster."""
    generator = torch.Generator().manual_seed(rungs)
    for fits_from in range(rungs + 1):  # rungs >= fits_from fit (rungs: none does)
        seconds = torch.rand(rungs, generator=generator).tolist()
        fastest: dict[int, Measurement | None] = {}
        while (rung := next_rung(fastest, rungs)) is not None:
            assert rung not in fastest and len(fastest) <= rungs, (rung, fastest)
            fastest[rung] = Measurement(0.5, seconds[rung], 1) if rung >= fits_from else None
        measured_fitting = sorted(r for r, m in fastest.items() if m is not None)
        assert 0 in fastest
        if fits_from == 0:
            assert list(fastest) == [0]
        elif fits_from == rungs:
            assert measured_fitting == [] and set(fastest) == {0, rungs - 1}
        else:
            assert measured_fitting[0] == fits_from and fits_from - 1 in fastest
            end = fits_from  # the walk up: on while the rung above is faster
            while end + 1 < rungs and seconds[end + 1] < seconds[end]:
                end += 1
            walked = set(range(fits_from, min(end + 2, rungs)))  # (and the one above, seen not faster)
            assert walked <= set(fastest)
            # the rest: the first and last rungs, and the bisection's O(log) rungs
            assert len(set(fastest) - walked - {0, rungs - 1}) <= (rungs - 1).bit_length()


def test_a_partition_stopped_at_its_choice_counts_what_the_whole_partition_saves(monkeypatch) -> None:
    """Partitions for a prediction stop once the partitioner chose what to save: for every budget
    and traced graph, the bytes that the whole partition's forward graph saves (its outputs after
    the forward's own, storages not among its inputs and outputs). With the graph's min cuts
    remembered across budgets: the same bytes, and each min cut solved once."""
    model, _ = _model()
    acceleration = _auto(model, 1.0, [])
    real_predict = acceleration.auto_budget._predict

    def predict(run, device, parameters, counts, limit):
        real_predict(run, device, parameters, counts, limit=-1)  # the traced step, no other budget
        raise KeyboardInterrupt

    acceleration.auto_budget.predict = predict
    with pytest.warns(RuntimeWarning, match="calibration stopped"), pytest.raises(KeyboardInterrupt):
        lora_step(model, [], inputs_for(model))
    graphs = acceleration.auto_budget._estimate.graphs
    assert graphs
    solved = []
    solve = saved_bytes.partitioners.solve_min_cut

    def counted_solve(joint_graph, node_info, min_cut_options, dont_ban=None):
        solved.append((min_cut_options, dont_ban))
        return solve(joint_graph, node_info, min_cut_options, dont_ban)

    monkeypatch.setattr(saved_bytes.partitioners, "solve_min_cut", counted_solve)
    for graph in graphs:
        stopped, whole, remembered, min_cuts = {}, {}, {}, {}
        for budget in CANDIDATES:
            stopped[budget] = saved_bytes.partition_saved_bytes(
                graph.joint, graph.joint_inputs, budget, **graph.partition_kwargs
            )
        fresh, solved[:] = len(solved), []
        for budget in CANDIDATES:
            remembered[budget] = saved_bytes.partition_saved_bytes(
                graph.joint, graph.joint_inputs, budget, min_cuts, **graph.partition_kwargs
            )
        assert remembered == stopped
        assert len(solved) == len(min_cuts) < fresh  # each once, where each budget solved its own
        for budget in CANDIDATES:
            with torch._functorch.config.patch(activation_memory_budget=budget):
                forward, _ = saved_bytes.partitioners.min_cut_rematerialization_partition(
                    copy.deepcopy(graph.joint), graph.joint_inputs, compiler="inductor", **graph.partition_kwargs
                )
            split = graph.partition_kwargs["num_fwd_outputs"]
            outputs = list(forward.graph.find_nodes(op="output")[0].args[0])
            whole[budget] = saved_bytes._saved_bytes(forward.graph, outputs[split:], split)
        assert whole[1.0] > 2 * whole[0.0]  # the budgets differ enough for this to test something
        assert stopped == whole
        assert graph.saved_bytes[CANDIDATES[0]] == whole[CANDIDATES[0]]  # the traced budget's, counted as it ran
    acceleration.remove()


class _ManualAttention(torch.nn.Module):
    """Attention written out, which inductor's joint-graph passes fuse: a pattern that traces a
    forward and backward of its own while the graph is partitioned."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.matmul(q, k.transpose(-2, -1)).div(8.0).softmax(dim=-1).matmul(v),)  # (as dynamo's graphs return)


def test_a_workers_partitions_of_a_traced_graph_are_those_made_here() -> None:
    """What a compile worker runs (PartitionedPerBudget) counts, per candidate, the bytes that
    the traced step's partition and the later ones here count, also for a graph whose joint-graph
    passes trace graphs of their own (written-out attention)."""
    gm = torch.fx.symbolic_trace(_ManualAttention())
    inputs = [torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3)]
    estimate = SavedBytesEstimate(CANDIDATES, CANDIDATES[0])
    estimate.backend()(copy.deepcopy(gm), inputs)
    (graph,) = estimate.graphs
    here = {budget: estimate._saved(graph, budget) for budget in CANDIDATES}
    assert here[1.0] > 0  # a budget saves something: the test can tell them apart
    assert saved_bytes.PartitionedPerBudget(CANDIDATES, CANDIDATES[0])(copy.deepcopy(gm), inputs) == here


def test_a_graph_no_worker_partitioned_is_partitioned_here_with_a_warning() -> None:
    """A graph the traced step ran under a checkpoint kept nothing: a budget adds all it saves per
    call. A worker's failure runs the worker's job here (warned about); a worker's {} (no
    backward) saves nothing."""
    estimate = SavedBytesEstimate(CANDIDATES, CANDIDATES[0])
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(RuntimeError("the worker died"))
    here = {budget: 1000 * (rank + 1) for rank, budget in enumerate(CANDIDATES)}
    estimate.add_checkpointed(failed, lambda: here)
    without_backward: concurrent.futures.Future = concurrent.futures.Future()
    without_backward.set_result({})
    estimate.add_checkpointed(without_backward, lambda: pytest.fail("the worker's answer is taken"))
    for graph in estimate.graphs:
        graph.calls = 3
    with pytest.warns(RuntimeWarning, match="did not partition a traced graph .*the worker died.*partitioning it here"):
        added = [estimate.added_bytes(budget) for budget in CANDIDATES]
    assert added == [3 * here[budget] for budget in CANDIDATES]


def test_only_the_counted_step_counts_and_a_stuck_workers_partitions_are_done_here_after_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calls count between new_step and end_step only (the training steps that run the traced
    graphs while the workers partition them do not); a partition a worker has not answered is
    out until WORKER_PARTITIONS_TIMEOUT_SECONDS after the step, then done here (warned about)
    without waiting again."""
    monkeypatch.setattr(saved_bytes, "WORKER_PARTITIONS_TIMEOUT_SECONDS", 0.3)
    estimate = SavedBytesEstimate(CANDIDATES, CANDIDATES[0])
    stuck: concurrent.futures.Future = concurrent.futures.Future()  # never answered
    here = {budget: 1000 * (rank + 1) for rank, budget in enumerate(CANDIDATES)}
    graph = estimate.add_checkpointed(stuck, lambda: here)
    estimate.called(graph)  # before the step: not counted
    estimate.new_step()
    estimate.called(graph)
    estimate.called(graph)
    estimate.end_step()
    estimate.called(graph)  # a training step after it: not counted
    assert graph.calls == 2 and estimate.partitions_out()
    deadline = time.monotonic() + 0.3
    while estimate.partitions_out():
        assert time.monotonic() < deadline + 1.0, "still out long after its deadline"
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not partition a traced graph .*TimeoutError.*partitioning it here"):
        added = estimate.added_bytes(CANDIDATES[-1])
    assert time.monotonic() - start < 0.2  # the deadline had passed: no second wait
    assert added == 2 * here[CANDIDATES[-1]]


def test_cudnn_attention_backward_gets_its_gradient_laid_out_as_the_output() -> None:
    """The traced step's uncompiled backward gives cuDNN's attention backward the output's
    gradient in the output's strides (as inductor does), with its values; other calls unchanged."""
    graph = torch.fx.Graph()
    grad, out, other = (graph.placeholder(name) for name in ("grad", "out", "other"))
    backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    attention = graph.call_function(backward, (grad, other, other, other, out))
    added = graph.call_function(torch.add, (grad, out))
    graph.output((attention, added))
    gm = saved_bytes.cudnn_attention_gradients_laid_out(torch.fx.GraphModule(torch.nn.Module(), graph))
    laid_out = attention.args[0]
    assert laid_out.target is saved_bytes._laid_out_as and laid_out.args == (grad, out)
    assert attention.args[1:] == (other, other, other, out) and added.args == (grad, out)
    assert "_laid_out_as" in gm.code  # recompiled: the module runs the rewritten graph

    output = torch.randn(2, 3, 8, 4)  # (batch, heads, tokens, head dim), contiguous
    gradient = torch.randn(2, 8, 3, 4).transpose(1, 2)  # as a projection's backward gives it
    same = saved_bytes._laid_out_as(gradient, output)
    assert same.stride() == output.stride() and torch.equal(same, gradient)
    assert saved_bytes._laid_out_as(output, output) is output


def test_nothing_fits_warns_and_takes_the_lowest_peak() -> None:
    model, params = _model()
    acceleration = _auto(model, 0.5, [], candidates=(0.0, 0.5))
    with pytest.warns(RuntimeWarning, match="no activation memory budget fits"):
        lora_step(model, params, inputs_for(model))
    assert acceleration.stats()["auto_budget"]["budget"] == 0.0


def test_calibration_waits_for_a_training_step() -> None:
    model, _ = _model()
    calls: list[float] = []
    acceleration = _auto(model, 1.0, calls)
    with torch.no_grad():
        model(*inputs_for(model))  # sampling / validation: no calibration
    assert calls == [] and acceleration.stats()["auto_budget"] is None


def test_auto_budget_config_errors() -> None:
    model, _ = _model()
    with pytest.raises(ValueError, match="applies to mode='blocks' only"):
        compile_accel.apply(model, CompileConfig(mode="selective", activation_memory_budget="auto"))
    with pytest.raises(ValueError, match="vram_limit_gib must be a positive number"):
        compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget="auto", vram_limit_gib=-1))
    with pytest.raises(ValueError, match="vram_limit_gib applies to activation_memory_budget='auto' only"):
        compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5, vram_limit_gib=8))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="without a GPU needs CompileConfig.vram_limit_gib"):
            compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget="auto"))


def test_chosen_budget_reuses_its_calibration_graphs() -> None:
    model, params = build("kohya", None)  # both block classes
    acceleration = _auto(model, 2.6, [], candidates=(0.5, 1.0))
    inputs = inputs_for(model)
    lora_step(model, params, inputs)
    after_calibration = acceleration.stats()
    # 1.0 (predicted from the tiny model's real bytes to fit) was measured first and peaks over
    # the limit: every class's compiled function is at 0.5.
    assert after_calibration["auto_budget"]["budget"] == 0.5
    assert _budget(acceleration) == 0.5
    lora_step(model, params, inputs)
    # Every candidate's graphs are counted (both block kinds, at each budget); the step after
    # calibration compiles none.
    assert acceleration.stats()["unique_graphs"] == after_calibration["unique_graphs"] >= 2
    assert acceleration.stats()["compile_seconds"] == after_calibration["compile_seconds"] > 0
    assert acceleration.stats()["recompiles"] == 0


def test_out_of_memory_moves_the_search_down_and_leaves_gradients_alone() -> None:
    model, params = _model()
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)
    calls: list[float] = []
    acceleration = _auto(model, 10.0, calls, candidates=(0.0, 0.5, 1.0), out_of_memory_from=0.5)
    loss, grads = lora_step(model, params, inputs)
    assert calls == [1.0, 0.5, 0.0]  # all predicted to fit; the two largest ran out of memory
    result = acceleration.stats()["auto_budget"]
    assert result["budget"] == 0.0 and result["fits"]
    assert [m["out_of_memory"] for m in result["table"]] == [True, True, False]
    assert relative_error(loss, expected_loss) < 1e-4
    assert all(relative_error(g, e) < 1e-4 for g, e in zip(grads, expected_grads, strict=True))


def test_cache_tells_apart_what_is_compiled() -> None:
    measured = []
    for exclude in ([], ["single_blocks.3"], ["single_blocks.3"]):
        torch._dynamo.reset()
        model, params = _model()
        calls: list[float] = []
        _auto(model, 2.6, calls, candidates=(0.0,), exclude=exclude)
        lora_step(model, params, inputs_for(model))
        measured.append(bool(calls))
    assert measured == [True, True, False]  # another exclude calibrates anew; the same one is cached


def test_a_cached_choice_that_does_not_fit_still_warns() -> None:
    for _ in range(2):
        torch._dynamo.reset()
        model, params = _model()
        _auto(model, 0.5, [], candidates=(0.0,))
        with pytest.warns(RuntimeWarning, match="no activation memory budget fits"):
            lora_step(model, params, inputs_for(model))


def test_training_in_eval_mode_warns_that_calibration_waits() -> None:
    model, params = _model()
    calls: list[float] = []
    acceleration = _auto(model, 2.6, calls)
    model.eval()
    with pytest.warns(RuntimeWarning, match="calibrates in training mode"):
        model(*inputs_for(model)).square().mean().backward()
    assert calls == [] and acceleration.stats()["auto_budget"] is None


# ---- the joint search over budget and offload, with a fake measurement (nothing compiles) ----

SWAPS = (0, 2, 4, 6, 8, 10, 12)


def _fake_weights_gib(level: float) -> float:
    return 10.0 - 0.5 * level  # each swapped block frees half a GiB


def _fake_seconds(budget: float, level: float) -> float:
    return SECONDS[budget] + 0.06 * level  # each swapped block costs its copies


class FakeTraining:
    """A plain Linear model whose auto calibration reads its "peak" and "time" from a table
    over (budget, blocks swapped), and its prediction from that table's peaks plus
    `error_gib`: the budget and the ladder are only recorded."""

    def __init__(self, limit_gib: float, levels: tuple[float, ...] = SWAPS, error_gib: float = 0.0) -> None:
        self.model = torch.nn.Linear(4, 4)
        self.budget: float | None = None
        self.level = levels[0]
        self.error_gib = error_gib
        self.set_levels: list[float] = []
        self.measured: list[tuple[float, float]] = []
        self.predicted_levels: list[float] = []
        ladder = OffloadLadder("blocks_to_swap", levels, self._set_level)
        self.auto = AutoBudget(self.model, self._set_budget, Stats(), limit_gib, find_ladder=lambda device: ladder)
        self.auto.measure = self._measure
        self.auto.predict = self._predict

    def _set_budget(self, budget: float, stats: Stats, adopt: bool = False) -> None:
        self.budget = budget

    def _set_level(self, level: float) -> None:
        self.set_levels.append(level)
        self.level = level

    def _peak_gib(self, budget: float) -> float:
        return _fake_weights_gib(self.level) + PEAKS[budget]

    def _measure(self, run, device, parameters) -> tuple[float, int]:
        run()
        self.measured.append((self.level, self.budget))
        return _fake_seconds(self.budget, self.level), int(self._peak_gib(self.budget) * GIB)

    def _predict(self, run, device, parameters, counts, limit) -> dict[float, int]:
        run()
        self.predicted_levels.append(self.level)
        return {budget: int((self._peak_gib(budget) + self.error_gib) * GIB) for budget in self.auto.candidates}

    def step(self) -> None:
        self.model(torch.randn(2, 4)).sum().backward()


def _exhaustive_best(limit_gib: float) -> tuple[float, float]:
    """(blocks swapped, budget) of the fastest fitting pair over the whole table."""
    fitting = [(l, b) for l in SWAPS for b in CANDIDATES if _fake_weights_gib(l) + PEAKS[b] <= limit_gib]
    return min(fitting, key=lambda lb: _fake_seconds(lb[1], lb[0]))


def test_joint_search_swaps_the_fewest_blocks_that_pay_and_is_cached() -> None:
    """Nothing fits with every block resident: bisection finds the fewest blocks swapped at
    which a budget fits (6, budget 0.0), climbing finds that 8 and 10 let larger budgets fit and
    run faster (10: budget 0.7) and that 12 does not pay. The choice is the fastest of the whole
    table, found by timing one budget per rung visited; the same training again reads it from
    the cache."""
    training = FakeTraining(limit_gib=8.0)
    training.step()
    result = training.auto.result
    assert (result["offload"], result["budget"]) == _exhaustive_best(8.0) == (10, 0.7)
    assert result["fits"] and result["offload_name"] == "blocks_to_swap"
    assert (training.level, training.budget) == (10, 0.7)
    assert sorted(training.predicted_levels) == [0, 4, 6, 8, 10, 12]  # never 2
    # One budget timed per rung: the largest predicted to fit, or the lowest where none is.
    assert training.measured == [(0, 0.0), (12, 1.0), (6, 0.0), (4, 0.0), (8, 0.3), (10, 0.7)]
    assert all(row["offload"] in SWAPS for row in result["table"] + result["predicted"])

    again = FakeTraining(limit_gib=8.0)
    again.step()
    assert again.measured == [] and again.auto.result["cached"]
    assert again.set_levels == [10] and again.budget == 0.7


@pytest.mark.parametrize("limit_gib", [6.5, 7.0, 8.0, 9.5, 13.0, 20.0])
@pytest.mark.parametrize("error_gib", [0.0, -0.7, 0.4])
def test_predicted_search_chooses_what_timing_every_setting_would(limit_gib: float, error_gib: float) -> None:
    """The search through predicted peaks chooses the exhaustive search's setting (every budget
    at every rung timed), also when the prediction is too low (a measurement corrects it) or too
    high by less than a candidate's step (the next larger one is tried)."""
    training = FakeTraining(limit_gib=limit_gib, error_gib=error_gib)
    training.step()
    result = training.auto.result
    assert (result["offload"], result["budget"]) == _exhaustive_best(limit_gib)
    assert len(training.measured) < len(SWAPS) * len(CANDIDATES) / 3


@pytest.mark.parametrize(
    "limit_gib, slower_at_08, chosen, measured",
    [
        (13.6, False, 0.8, [(0, 0.7), (0, 0.8)]),  # 0.8 predicted 13.9 GiB, less 0.7's 0.4 over: 13.5 fits
        (13.6, True, 0.7, [(0, 0.7), (0, 0.8)]),  # tried, fits, slower: 0.7 stays, nothing more is tried
        (13.45, False, 0.7, [(0, 0.7)]),  # 13.5 over: 0.8 is not tried
    ],
)
def test_a_budget_under_its_predicted_peak_lets_the_next_larger_be_tried(
    monkeypatch: pytest.MonkeyPatch, limit_gib: float, slower_at_08: bool, chosen: float, measured: list
) -> None:
    """Predictions 0.4 GiB high: 0.7 is the largest predicted to fit (13.4 GiB) and measures 13.0;
    0.8 is measured where its prediction less that overshoot fits, and taken where it is faster."""
    if slower_at_08:
        monkeypatch.setitem(SECONDS, 0.8, SECONDS[0.7] + 0.05)
    training = FakeTraining(limit_gib=limit_gib, error_gib=0.4)
    training.step()
    assert training.measured == measured
    assert training.auto.result["budget"] == training.budget == chosen and training.auto.result["fits"]


def test_joint_search_stays_resident_when_a_budget_fits() -> None:
    training = FakeTraining(limit_gib=13.0)
    training.step()
    assert training.set_levels == [] and training.measured == [(0, 0.7)]  # 10 + 3 GiB <= 13
    assert (training.auto.result["offload"], training.budget) == (0, 0.7)


def test_nothing_fits_even_at_the_top_rung_warns_and_takes_the_lowest_peak() -> None:
    training = FakeTraining(limit_gib=3.0)
    with pytest.warns(RuntimeWarning, match="no activation memory budget fits 3.00 GiB on this batch even at blocks_to_swap 12"):
        training.step()
    assert (training.level, training.budget) == (12, 0.0)
    assert training.measured == [(0, 0.0), (12, 0.0)]  # nothing predicted to fit: the lowest is run


class FakeWorkers:
    """Compile workers for FakeTraining: each budget set hands a graph over (counted in the Stats
    it compiles into), which compiles for `steps` training steps."""

    def __init__(self, training: FakeTraining, steps: int) -> None:
        self.steps = steps
        self.left = 0  # steps until the graph handed over is back
        self.stats: Stats | None = None  # what the graph in the workers counts into
        set_budget, measure = training._set_budget, training.auto.measure

        def set_budget_in_workers(budget: float, stats: Stats, adopt: bool = False) -> None:
            set_budget(budget, stats)
            stats.worker_graphs_started += 1
            self.left, self.stats = self.steps, stats

        def measure_back(run, device, parameters) -> tuple[float, int]:
            assert self.left == 0, "measured before its graph was back"
            return measure(run, device, parameters)

        training.auto.set_budget = set_budget_in_workers
        training.auto.measure = measure_back
        training.auto.compiling = lambda stats: self.left if stats is self.stats else 0

    def step_done(self) -> None:
        self.left = max(0, self.left - 1)


def test_with_compile_workers_a_candidate_is_measured_at_the_first_step_after_its_graphs_are_back() -> None:
    """The first step waits for the prediction only; the candidate runs (uncompiled) while its
    graph compiles, graphs back from the workers are held uncompiled until calibration measured
    them, a candidate measured over the limit hands the next one over, and the choice, the table
    and the cache are those of a calibration without workers. Prediction 0.6 GiB too low: 0.7 is
    predicted to fit 12.6 GiB (12.4) and measures 13.0; 0.5 measures 12.5."""
    plain = FakeTraining(limit_gib=12.6, error_gib=-0.6)
    plain.step()
    cache_path().unlink()

    training = FakeTraining(limit_gib=12.6, error_gib=-0.6)
    workers = FakeWorkers(training, steps=2)
    seen = []
    for _ in range(6):
        training.step()
        workers.step_done()
        held = workers.stats is not None and id(workers.stats) in compile_workers.HANDED_OVER.held
        seen.append((training.budget, training.auto.checking, held, training.auto.result is None))
    assert seen == [
        (0.7, 0.7, True, True),  # predicted, 0.7 handed over: the step ran on
        (0.7, 0.7, True, True),  # still compiling: nothing measured
        (0.5, 0.5, True, True),  # back: 0.7 measured over the limit, 0.5 handed over
        (0.5, 0.5, True, True),
        (0.5, None, False, False),  # back: 0.5 measured, fits, chosen; graphs free to switch
        (0.5, None, False, False),  # calibrated: nothing more
    ]
    assert training.predicted_levels == [0]  # predicted once, not again when the search went on
    assert training.measured == plain.measured == [(0, 0.7), (0, 0.5)]
    result, expected = training.auto.result, plain.auto.result
    assert {k: result[k] for k in ("budget", "fits", "table", "predicted")} == {
        k: expected[k] for k in ("budget", "fits", "table", "predicted")
    }
    assert 0 <= result["waited_seconds"] <= result["calibration_seconds"]
    assert json.loads(cache_path().read_text())  # written once chosen


def test_with_compile_workers_the_next_larger_budget_is_handed_over_after_one_under_its_prediction() -> None:
    """Predictions 0.4 GiB high (as test_a_budget_under_its_predicted_peak_...): 0.7 comes back,
    measures under its prediction, and 0.8 is handed to the workers and measured when back; the
    choice is a calibration's without workers."""
    plain = FakeTraining(limit_gib=13.6, error_gib=0.4)
    plain.step()
    cache_path().unlink()

    training = FakeTraining(limit_gib=13.6, error_gib=0.4)
    workers = FakeWorkers(training, steps=2)
    seen = []
    for _ in range(6):
        training.step()
        workers.step_done()
        seen.append((training.budget, training.auto.checking, training.auto.result is None))
    assert seen == [
        (0.7, 0.7, True),  # predicted, 0.7 handed over
        (0.7, 0.7, True),
        (0.8, 0.8, True),  # back: 0.7 measured 0.4 GiB under its prediction, 0.8 handed over
        (0.8, 0.8, True),
        (0.8, None, False),  # back: measured, fits, faster: chosen
        (0.8, None, False),
    ]
    assert training.measured == plain.measured == [(0, 0.7), (0, 0.8)]
    assert training.auto.result["table"] == plain.auto.result["table"] and plain.auto.result["budget"] == 0.8


def _with_cuda_graphs(training: FakeTraining, limit_gib: float) -> list[bool]:
    """Give `training` an AutoBudget with CUDA graphs on; returns, per measurement, whether it
    read reserved memory."""
    read = []

    def measure(run, device, parameters, reserved: bool = False):
        read.append(reserved)
        return training._measure(run, device, parameters)

    ladder = training.auto.find_ladder(torch.device("cpu"))
    training.auto.remove()
    training.auto = AutoBudget(
        training.model,
        training._set_budget,
        Stats(),
        limit_gib,
        find_ladder=lambda device: ladder,
        measure=measure,
        cuda_graphs=True,
    )
    training.auto.predict = training._predict
    return read


def test_with_cuda_graphs_auto_reads_reserved_peaks_and_never_offloads() -> None:
    """CUDA graphs record the weights where they are and keep their memory in pools of their
    own: with them, the ladder is not climbed even where nothing fits, and every measurement
    reads reserved memory."""
    training = FakeTraining(limit_gib=8.0)  # nothing fits resident: without CUDA graphs it swaps 10 blocks
    read = _with_cuda_graphs(training, 8.0)
    nothing_fits = "no activation memory budget fits 8.00 GiB on this batch; using budget 0.0"
    with pytest.warns(RuntimeWarning, match=nothing_fits):
        training.step()
    assert training.set_levels == [] and training.predicted_levels == [0]
    assert training.measured == [(0, 0.0)] and read == [True]
    assert training.auto.result["offload_name"] is None


def test_with_cuda_graphs_auto_does_not_step_up() -> None:
    """A candidate measured after the one that fits would free the CUDA graphs recorded for it,
    which the choice may come back to: with CUDA graphs, the largest predicted to fit that fits is
    kept (test_a_budget_under_its_predicted_peak_... steps up to 0.8 here without them)."""
    training = FakeTraining(limit_gib=13.6, error_gib=0.4)
    _with_cuda_graphs(training, 13.6)
    training.step()
    assert training.measured == [(0, 0.7)] and training.auto.result["budget"] == 0.7


def test_interrupted_calibration_warns_counts_and_runs_again() -> None:
    """Ctrl-C during a candidate's step: the first rung and the lowest budget are back, a
    warning says so, and the next training forward calibrates (and settles) again."""
    training = FakeTraining(limit_gib=8.0)
    measure = training.auto.measure

    def interrupted(run, device, parameters):
        if len(training.measured) == 3:
            raise KeyboardInterrupt
        return measure(run, device, parameters)

    training.auto.measure = interrupted
    with pytest.warns(RuntimeWarning, match="calibration stopped .KeyboardInterrupt"), pytest.raises(KeyboardInterrupt):
        training.step()
    assert training.auto.result is None and (training.level, training.budget) == (0, 0.0)
    training.auto.measure = measure
    training.step()
    assert (training.auto.result["offload"], training.auto.result["budget"]) == (10, 0.7)


@pytest.mark.parametrize(
    "damage",
    [
        {"budget": "0.5"},
        {"table": "a string"},
        {"table": [1, 2]},
        {"table": [{"seconds": 0.1}]},
        {"budget": True},
        {"fits": 1},
        {"offload": 3},
        {"limit_gib": float("nan")},
        {"predicted": [{"budget": 0.5, "offload": 0, "peak_bytes": "1"}]},
        {"limit_gib": 10**400},  # an int math.isfinite cannot take (OverflowError)
    ],
    ids=[
        "budget-str",
        "table-str",
        "table-ints",
        "row-without-budget",
        "budget-bool",
        "fits-int",
        "offload-off-ladder",
        "limit-nan",
        "predicted-str",
        "limit-huge-int",
    ],
)
def test_a_malformed_cache_entry_warns_and_calibrates_again(damage: dict) -> None:
    FakeTraining(limit_gib=8.0).step()
    cache = json.loads(cache_path().read_text())
    cache_path().write_text(json.dumps({key: {**entry, **damage} for key, entry in cache.items()}))
    training = FakeTraining(limit_gib=8.0)
    with pytest.warns(RuntimeWarning, match="malformed entry"):
        training.step()
    assert training.measured and (training.auto.result["offload"], training.budget) == (10, 0.7)


def test_a_cache_entry_reads_back_as_written_and_a_bad_field_is_named() -> None:
    entry = CacheEntry(
        budget=0.5,
        fits=True,
        limit_gib=8.0,
        table=(Measurement(0.7, 0.0, 0, out_of_memory=True, offload=10), Measurement(0.5, 0.21, 7 * GIB, offload=10)),
        offload=10,
        predicted=(PredictedPeak(0.0, 10, 5 * GIB), PredictedPeak(0.7, 10, 9 * GIB)),
    )
    data = json.loads(json.dumps(entry.to_json()))
    assert CacheEntry.from_json(data, (0, 10, 20)) == entry
    with pytest.raises(ValueError, match="^offload$"):
        CacheEntry.from_json(data, None)  # a rung where the run has no ladder
    with pytest.raises(ValueError, match="no run of the chosen budget"):
        CacheEntry.from_json({**data, "budget": 0.7}, (0, 10, 20))  # chosen, but it ran out of memory


def test_auto_raises_the_conductors_offload_fraction_and_training_matches_eager() -> None:
    """A conductor attached to the blocks is the ladder: when nothing fits with its fraction,
    auto streams more blocks (re-attaching them), and the step's LoRA gradients are eager's."""
    model, params = _model()
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)
    conductor = BlockOffloadConductor(offload_fraction=0.0, device="cpu").attach(list(model.single_blocks))
    acceleration = _auto(model, 2.0, [], candidates=(0.0,))

    def measure(run, device, parameters):
        run()
        peak = 1.0 + 2.0 * (1.0 - conductor.offload_fraction)  # streamed blocks leave the GPU
        return 0.1, int(peak * GIB)

    acceleration.auto_budget.measure = measure
    loss, grads = lora_step(model, params, inputs)
    result = acceleration.stats()["auto_budget"]
    assert result["offload_name"] == "offload_fraction" and result["fits"]
    assert conductor.offload_fraction == result["offload"] >= 0.5 and conductor.stats()["streamed_blocks"] >= 2
    assert relative_error(loss, expected_loss) < 1e-4
    assert all(relative_error(g, e) < 1e-4 for g, e in zip(grads, expected_grads, strict=True))
    conductor.remove()


@pytest.mark.parametrize(
    "text, warning",
    [("[]", "not a JSON object"), ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "could not be read")],
    ids=["a-list", "nested-too-deep"],  # nested too deep: json raised RecursionError at the first forward
)
def test_a_cache_file_that_is_not_a_json_object_warns_and_is_rewritten(text: str, warning: str) -> None:
    cache_path().write_text(text)
    training = FakeTraining(limit_gib=8.0)
    with pytest.warns(RuntimeWarning, match=warning):
        training.step()
    assert training.measured and isinstance(json.loads(cache_path().read_text()), dict)
