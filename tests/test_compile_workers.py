"""CompileConfig.compile_workers: inductor's code generation in worker processes.

One compile for the module (the `trained` fixture): the one-block-class DiT trains a few steps
with 2 workers beside an eager twin (same init, same fresh random inputs). The workers' results
are held back behind a gate until the test opens it, so the first steps run the graphs
uncompiled whatever the machine's speed; then the test waits for the workers and trains on
the compiled graphs. Tolerance: relative error (L2 norm of the difference over the norm of the
eager value) below 1e-4 in float32, as tests/test_parity.py: inductor reorders reductions.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, an_empty_inductor_cache, build, inputs_for, lora_step, relative_error
from torch import nn

import compile_accel
from compile_accel import CompileConfig, compile_workers
from compile_accel.backend import RegionBackend

pytestmark = pytest.mark.skipif(
    not compile_workers.SUPPORTED,
    reason="compile_workers needs torch's graph pickler and AOTAutograd's cache (torch >= 2.8) and a platform other than Windows",
)

TOLERANCE = 1e-4
WORKERS = 2
LR = 0.1
CONFIG = {"mode": "blocks", "activation_memory_budget": 0.5}


class _GatedPool:
    """The workers' pool, with the results of one kind of job (default: every graph's compile;
    auto's partitions are `compile_workers.worker.compile_job`s) held back until `open()`: graphs handed
    to the workers stay uncompiled however fast the workers are."""

    def __init__(self, pool: Any, job: Callable = compile_workers.worker.compile_in_worker) -> None:
        self._pool = pool
        self._job = job
        self._opened = False
        self._lock = threading.Lock()
        self._pairs: list[tuple[concurrent.futures.Future, concurrent.futures.Future]] = []

    @staticmethod
    def _relay(real: concurrent.futures.Future, gated: concurrent.futures.Future) -> None:
        error = real.exception()
        if error is not None:
            gated.set_exception(error)
        else:
            gated.set_result(real.result())

    def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        real = self._pool.submit(*args, **kwargs)
        if args[0] is not self._job:
            return real
        gated: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pairs.append((real, gated))
            opened = self._opened
        if opened:
            real.add_done_callback(lambda done: self._relay(done, gated))
        return gated

    def open(self) -> None:
        with self._lock:
            if self._opened:
                return
            self._opened = True
            pairs = list(self._pairs)
        for real, gated in pairs:
            real.add_done_callback(lambda done, gated=gated: self._relay(done, gated))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _sgd(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            param -= LR * grad


def _compare(record: dict, step: tuple, expected: tuple) -> None:
    (loss, grads), (expected_loss, expected_grads) = step, expected
    record["loss"].append(relative_error(loss, expected_loss))
    assert all(g.abs().max() > 0 for g in expected_grads)
    record["grads"].append(max(relative_error(g, e) for g, e in zip(grads, expected_grads, strict=True)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Train the model with workers beside its eager twin; keep the errors and stats of each phase."""
    from torch._inductor.utils import clear_caches

    # An inductor cache of this module's own: a graph already in the shared test cache (an
    # earlier run's) would load from it and never reach the workers.
    cache_dir = str(tmp_path_factory.mktemp("inductor"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", cache_dir)
        clear_caches()
        torch._dynamo.reset()
        seed = torch.seed()
        torch.manual_seed(seed)
        model, params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
        torch.manual_seed(seed)
        eager, eager_params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
        # The eager twin keeps its checkpointing (the accelerated one has it switched off):
        # the same gradients either way.
        patch.setattr(compile_workers.POOL, "after_first_step", False)
        acceleration = compile_accel.apply(model, CompileConfig(**CONFIG, compile_workers=WORKERS))
        assert compile_workers.POOL.pool is not None, "apply() did not start the workers"
        # Set, not patched: the pool stops itself (and clears this) once every graph is back.
        gate = compile_workers.POOL.pool = _GatedPool(compile_workers.POOL.pool)

        record: dict[str, Any] = {"loss": [], "grads": [], "cache_dir": cache_dir}
        # (graphs an earlier test in this process handed over and never ran compiled: not this model's)
        elsewhere = compile_workers.pending()
        # Counters outlive dynamo's reset: this module's are the difference (read anew: torch
        # replaces the Counter while it compiles).
        counted_before = torch._dynamo.utils.counters["inductor"].copy()
        aot_counted_before = torch._dynamo.utils.counters["aot_autograd"].copy()

        def train(steps: int) -> None:
            for _ in range(steps):
                inputs = inputs_for(model)  # fresh random inputs every step
                step, expected = lora_step(model, params, inputs), lora_step(eager, eager_params, inputs)
                _compare(record, step, expected)
                _sgd(params, step[1])
                _sgd(eager_params, expected[1])

        try:
            train(3)  # the compiling step, then two steps with every graph still in the workers
            record["before"] = acceleration.stats()
            record["pending_before"] = compile_workers.pending() - elsewhere
            uncompiled_steps = len(record["loss"])
        finally:  # else a failure here leaves graphs that never come back for later tests to wait on
            gate.open()
        record["still_compiling"] = compile_workers.wait()
        switched_before, artifacts_before = compile_workers.graphs_switched(), _aot_cache_artifacts()
        record["pending_after_wait"] = compile_workers.pending() - elsewhere
        record["running_after_wait"] = compile_workers.running()  # the first step is not done yet
        compile_workers.first_step_done()
        record["running_after_first_step"] = compile_workers.running()
        train(2)  # the step that switches to the workers' graphs, then one on them
        record["pending_after_switch"] = compile_workers.pending() - elsewhere
        record["graphs_switched"] = compile_workers.graphs_switched() - switched_before
        record["aot_artifacts_added"] = _aot_cache_artifacts() - artifacts_before
        record["after"] = acceleration.stats()
        record["uncompiled_steps"] = uncompiled_steps
        record["params"] = max(relative_error(p, e) for p, e in zip(params, eager_params, strict=True))
        record["inductor_counters"] = dict(torch._dynamo.utils.counters["inductor"] - counted_before)
        record["aot_counters"] = dict(torch._dynamo.utils.counters["aot_autograd"] - aot_counted_before)
        yield record
        torch._dynamo.reset()
        clear_caches()
    clear_caches()


def _aot_cache_artifacts() -> int:
    """AOTAutograd entries among the cache artifacts this process would save now."""
    saved = torch.compiler.save_cache_artifacts()
    return 0 if saved is None else len(saved[1].aot_autograd_artifacts)


def test_training_with_workers_matches_eager_before_and_after_the_compiled_graphs_arrive(trained: dict) -> None:
    before, after = trained["before"], trained["after"]
    # Before the gate opened every graph handed to the workers ran uncompiled.
    assert before["worker_graphs_started"] > 0
    assert before["worker_graphs_compiled"] == 0
    assert trained["pending_before"] == before["worker_graphs_started"]
    assert trained["still_compiling"] == before["worker_graphs_started"]
    # Back from the workers, but switched to only at their next call.
    assert trained["pending_after_wait"] == before["worker_graphs_started"]
    # Every graph back: the pool waits for more until the first step is done, then it (and the
    # GPU memory its workers hold) is gone.
    assert trained["running_after_wait"] is True
    assert trained["running_after_first_step"] is False
    assert trained["pending_after_switch"] == 0
    # After the wait and one more step every graph is the workers' compiled one.
    assert after["worker_graphs_started"] == before["worker_graphs_started"]
    assert after["worker_graphs_compiled"] == after["worker_graphs_started"]
    assert after["worker_failures"] == []
    assert after["recompiles"] == 0 and after["fallbacks"] == []
    assert after["compiled_regions"] == after["regions"] > 0
    # Each graph back says where its time went: inductor compiled it in the worker (cold), within
    # the seconds the worker spent on it.
    compiles = after["worker_compiles"]
    assert len(compiles) == after["worker_graphs_started"]
    for report in compiles:
        assert report["fx_graphs_compiled"] > 0 and report["fx_graphs_from_cache"] == 0, report
        assert 0 < report["total_s"] <= report["worker_s"] and report["load_s"] > 0, report
    # The workers compiled them (this module's cache was empty): here each was looked up in
    # AOTAutograd's cache once before it was handed over (a miss) and loaded from it once back.
    assert trained["aot_counters"].get("autograd_cache_miss", 0) == after["worker_graphs_started"]
    assert trained["aot_counters"].get("autograd_cache_hit", 0) == after["worker_graphs_started"]
    assert trained["inductor_counters"].get("fxgraph_cache_miss", 0) == 0
    # Loaded here, each is counted (the launcher's run cache saves then) and is in this process's
    # cache artifacts (torch records a cache hit's entry too); it was not before.
    assert trained["graphs_switched"] == after["worker_graphs_started"]
    assert trained["aot_artifacts_added"] == after["worker_graphs_started"]
    # Parity on every step, uncompiled (the first three) and compiled (the last two).
    assert trained["uncompiled_steps"] == 3 and len(trained["loss"]) == 5
    assert max(trained["loss"]) < TOLERANCE, trained["loss"]
    assert max(trained["grads"]) < TOLERANCE, trained["grads"]
    assert trained["params"] < TOLERANCE


RESTART = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from conftest import ONE_BLOCK_CLASS, an_empty_inductor_cache, build, inputs_for, lora_step, relative_error
import compile_accel
from compile_accel import CompileConfig, compile_workers
torch.manual_seed(int(sys.argv[3]))
model, params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
torch.manual_seed(int(sys.argv[3]))
eager, eager_params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
acceleration = compile_accel.apply(model, CompileConfig(**json.loads(sys.argv[2])))
inputs = inputs_for(model)
(loss, grads), (expected_loss, expected_grads) = lora_step(model, params, inputs), lora_step(eager, eager_params, inputs)
stats = acceleration.stats()
print(json.dumps({
    "stats": {k: stats[k] for k in ("unique_graphs", "fallbacks", "worker_graphs_started", "worker_failures")},
    "inductor": dict(torch._dynamo.utils.counters["inductor"]),
    "aot": dict(torch._dynamo.utils.counters["aot_autograd"]),
    "pending": compile_workers.pending(),
    "loss": relative_error(loss, expected_loss),
    "grads": max(relative_error(g, e) for g, e in zip(grads, expected_grads, strict=True)),
}))
"""


def test_a_restart_loads_the_graphs_the_workers_compiled_from_inductors_cache(trained: dict) -> None:
    """A fresh process on the same inductor cache directory (as a restarted training run)."""
    compiled = trained["after"]["worker_graphs_compiled"]
    assert compiled > 0  # saved to the cache when they arrived
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": trained["cache_dir"]}
    config = json.dumps({**CONFIG, "compile_workers": WORKERS})
    seed = str(torch.randint(0, 2**31, ()).item())
    tests = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", RESTART, tests, config, seed],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    restart = json.loads(proc.stdout.strip().splitlines()[-1])
    assert restart["stats"]["unique_graphs"] > 0 and restart["stats"]["fallbacks"] == []
    # Every graph the workers compiled came from the cache: none compiled, none handed to the workers.
    assert restart["inductor"].get("fxgraph_cache_hit", 0) >= compiled, restart
    assert restart["inductor"].get("fxgraph_cache_miss", 0) == 0, restart
    assert restart["aot"].get("autograd_cache_hit", 0) > 0, restart
    assert restart["stats"]["worker_graphs_started"] == 0 and restart["stats"]["worker_failures"] == [], restart
    assert restart["pending"] == 0
    # What the cache gave back computes what eager does.
    assert restart["loss"] < TOLERANCE and restart["grads"] < TOLERANCE, restart


def _twins_compiled_in_workers(cache: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list, Any, list]:
    """The one-block-class DiT and its eager twin (same init, LoRA parameters of each), with an
    empty inductor cache of its own at `cache`."""
    an_empty_inductor_cache(cache, monkeypatch)
    seed = torch.seed()
    torch.manual_seed(seed)
    model, params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    torch.manual_seed(seed)
    eager, eager_params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    return model, params, eager, eager_params


def test_graphs_inside_a_trainers_checkpoint_switch_between_steps_not_before_its_recompute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Selective regions run the blocks' non-reentrant checkpoints traced (compile_accel.checkpointing):
    until a graph is back it runs uncompiled, its checkpoint a real one, which recomputes it in the
    backward and checks that it saves what the forward saved. Graphs that come back between a
    step's forward and its backward run uncompiled in that backward too."""
    model, params, eager, eager_params = _twins_compiled_in_workers(tmp_path, monkeypatch)
    acceleration = compile_accel.apply(model, CompileConfig(mode="selective", compile_workers=WORKERS))
    _back_between_the_first_forward_and_backward(acceleration, model, params, eager, eager_params, inputs_for)


def test_budgeted_blocks_still_inside_the_models_checkpoint_switch_between_steps_not_before_its_recompute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks under a budget that the model's own checkpoint still wraps (a checkpoint call in the
    model's forward, which no switch turns off): a graph back between a step's forward and its
    backward runs uncompiled in that backward's recompute too, as in the forward (the checkpoint
    checks that both save the same tensors), and compiled from the next step on."""
    from offload_stand_ins import Stack, copy_of, stack_inputs, trainable

    an_empty_inductor_cache(tmp_path, monkeypatch)
    eager = Stack(n=3)
    model = copy_of(eager)
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, compile_workers=WORKERS)
    acceleration = compile_accel.apply(model, config)
    inputs = lambda model: stack_inputs()  # noqa: E731
    _back_between_the_first_forward_and_backward(acceleration, model, trainable(model), eager, trainable(eager), inputs)


def _back_between_the_first_forward_and_backward(
    acceleration: compile_accel.Acceleration,
    model: nn.Module,
    params: list[torch.Tensor],
    eager: nn.Module,
    eager_params: list[torch.Tensor],
    make_inputs: Callable[[nn.Module], tuple],
) -> None:
    """Three steps of `model` (compiled in gated workers) against `eager`, every graph back from
    its worker between the first step's forward and backward: that backward runs none compiled,
    the next steps run all; LoRA gradients within TOLERANCE of eager's throughout."""
    from torch._inductor.utils import clear_caches

    gate = compile_workers.POOL.pool = _GatedPool(compile_workers.POOL.pool)
    errors = []
    try:
        for step in range(3):
            inputs = make_inputs(model)
            loss = model(*inputs).square().mean()
            if step == 0:  # every graph comes back between the forward and its backward
                gate.open()
                assert compile_workers.wait() > 0
            grads = torch.autograd.grad(loss, params)
            expected = torch.autograd.grad(eager(*inputs).square().mean(), eager_params)
            errors.append(max(relative_error(g, e) for g, e in zip(grads, expected, strict=True)))
            if step == 0:
                assert acceleration.stats()["worker_graphs_compiled"] == 0  # not switched in that backward
    finally:
        gate.open()
    stats = acceleration.stats()
    assert stats["worker_graphs_compiled"] == stats["worker_graphs_started"] > 0  # switched at the next step
    assert stats["worker_failures"] == [] and stats["fallbacks"] == []
    assert max(errors) < TOLERANCE, errors
    acceleration.remove()
    torch._dynamo.reset()
    clear_caches()


def test_whole_blocks_with_the_trainers_checkpoint_traced_train_as_eager_before_and_after_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks mode without a budget keeps the blocks' checkpointing, which dynamo traces into each
    graph. Until the workers are back the graphs run uncompiled, the traced checkpoint as a real
    non-reentrant one (torch 2.11 would keep every activation of the block); compiled after."""
    from torch._inductor.utils import clear_caches

    model, params, eager, eager_params = _twins_compiled_in_workers(tmp_path, monkeypatch)
    checkpoint, checkpointed = compile_workers.graphs.checkpoint, []

    def counted_checkpoint(*args: Any, **kwargs: Any) -> Any:
        checkpointed.append(kwargs["use_reentrant"])
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(compile_workers.graphs, "checkpoint", counted_checkpoint)
    # (and the eager first call of each block class: compile_accel.region_inputs)
    monkeypatch.setattr(compile_accel.regions, "checkpoint", counted_checkpoint)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", compile_workers=WORKERS))
    gate = compile_workers.POOL.pool = _GatedPool(compile_workers.POOL.pool)
    errors, checkpoints_per_step = [], []
    try:
        for step in range(3):
            if step == 1:  # every graph back before the second step, which switches to them
                gate.open()
                assert compile_workers.wait() > 0
            inputs = inputs_for(model)
            grads = torch.autograd.grad(model(*inputs).square().mean(), params)
            expected = torch.autograd.grad(eager(*inputs).square().mean(), eager_params)
            errors.append(max(relative_error(g, e) for g, e in zip(grads, expected, strict=True)))
            checkpoints_per_step.append(len(checkpointed))
    finally:
        gate.open()
    # The uncompiled step checkpointed each block; the compiled ones left it to the graphs.
    assert checkpoints_per_step[0] == len(model.single_blocks) and checkpointed == [False] * len(checkpointed)
    assert checkpoints_per_step[2] == checkpoints_per_step[0]
    stats = acceleration.stats()
    assert stats["worker_graphs_compiled"] == stats["worker_graphs_started"] > 0
    assert stats["worker_failures"] == [] and stats["fallbacks"] == []
    assert max(errors) < TOLERANCE, errors
    acceleration.remove()
    torch._dynamo.reset()
    clear_caches()


@pytest.fixture
def spawned_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Windows' kind of worker pool (spawned processes), a pool of its own, stopped after."""
    for name, value in (("count", 0), ("pool", None), ("out", [])):
        monkeypatch.setattr(compile_workers.POOL, name, value)
    monkeypatch.setattr(compile_workers.pool, "SPAWNED_POOL", True)
    yield
    compile_workers.stop()


@pytest.mark.usefixtures("spawned_pool")
def test_auto_trains_on_while_a_candidates_graphs_compile_and_measures_it_once_they_are_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """activation_memory_budget="auto" with workers, here Windows' spawned pool (torch's
    subprocess pool runs auto with workers in the test after): the first step waits for neither the
    workers' partitions of its traced step nor the candidate's compile. The steps run the
    traced graphs uncompiled until the partitions are back (their calls not counted into the
    prediction, the pool kept up); the step after predicts and hands the candidate over, the
    traced step's own graphs (dynamo traces the step once); graphs back are held uncompiled
    (also through a step while one of them is still out) until a training step's calibration
    runs and measures them. Every step trains as eager does."""
    from torch._inductor.utils import clear_caches

    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path / "compile_accel"))  # no cached choice
    model, params, eager, eager_params = _twins_compiled_in_workers(tmp_path / "inductor", monkeypatch)
    config = CompileConfig(mode="blocks", activation_memory_budget="auto", vram_limit_gib=64.0, compile_workers=WORKERS)
    acceleration = compile_accel.apply(model, config)
    auto = acceleration.auto_budget
    auto.candidates = (0.0, 0.5)  # 0.5 predicted to fit 64 GiB: the one handed over
    partitions = _GatedPool(compile_workers.POOL.pool, job=compile_workers.worker.compile_job)
    gate = compile_workers.POOL.pool = _GatedPool(partitions)
    errors, traced = [], []
    trace = RegionBackend.__call__
    monkeypatch.setattr(RegionBackend, "__call__", lambda self, gm, inputs: traced.append(gm) or trace(self, gm, inputs))

    def train() -> None:
        inputs = inputs_for(model)
        loss, grads = lora_step(model, params, inputs)
        expected_loss, expected_grads = lora_step(eager, eager_params, inputs)
        errors.append(max(relative_error(loss, expected_loss), *map(relative_error, grads, expected_grads)))

    try:
        train()  # the traced step, its partitions held in the workers
        assert auto.waiting_for == "the partitions of the traced step's graphs" and auto.checking is None
        assert set(compile_workers.POOL.kept) == {auto}
        calls = [graph.calls for graph in auto._estimate.graphs]
        train()
        assert [graph.calls for graph in auto._estimate.graphs] == calls and sum(calls) > 0
        assert auto.checking is None and acceleration.stats()["worker_graphs_started"] == 0
        partitions.open()
        compile_workers.wait()  # (auto's partitions)
        train()  # predicts, hands 0.5 over
        assert auto.result is None and auto.checking == 0.5 and len(compile_workers.HANDED_OVER.held) == 1
        assert auto.waiting_for == "the graphs of budget 0.5" and len(compile_workers.POOL.kept) == 0
        started = acceleration.stats()["worker_graphs_started"]
        assert started > 0 and compile_workers.pending() == started
    finally:
        partitions.open()
        gate.open()
    assert compile_workers.wait() == started
    switched = compile_workers.graphs_switched()
    with monkeypatch.context() as patch:
        patch.setattr(auto, "compiling", lambda stats: 1)  # as if one of its graphs were still in the workers
        train()
    assert compile_workers.graphs_switched() == switched and auto.result is None  # held, not measured
    train()  # the step whose calibration measures 0.5, compiled
    result = auto.result
    assert result["budget"] == 0.5 and result["fits"] and [row["budget"] for row in result["table"]] == [0.5]
    assert 0 < result["waited_seconds"] < result["calibration_seconds"]
    assert compile_workers.HANDED_OVER.held == set() and auto.checking is None
    stats = acceleration.stats()
    assert stats["worker_graphs_compiled"] == started and stats["worker_failures"] == [] and stats["recompiles"] == 0
    assert len(traced) == started  # each graph traced once by dynamo: the traced step's, handed over
    train()
    assert max(errors) < TOLERANCE, errors
    acceleration.remove()
    torch._dynamo.reset()
    clear_caches()


def test_auto_runs_its_traced_step_uncompiled_under_checkpoints_while_workers_partition_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With workers, auto's traced step runs each graph uncompiled under a checkpoint while a
    worker traces and partitions it at every candidate: nothing is traced by AOTAutograd or
    partitioned here, each graph's bytes are what the same job gives here, and since the
    checkpoint kept nothing of a graph's, a budget adds all it saves per call."""
    from compile_accel import saved_bytes
    from compile_accel.auto_budget import CANDIDATES, Waiting

    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path / "compile_accel"))
    model, _, _, _ = _twins_compiled_in_workers(tmp_path / "inductor", monkeypatch)
    config = CompileConfig(mode="blocks", activation_memory_budget="auto", vram_limit_gib=64.0, compile_workers=WORKERS)
    acceleration = compile_accel.apply(model, config)
    auto = acceleration.auto_budget
    predict, added, here, checkpointed = auto._predict, [], [], []
    checkpoint = compile_workers.graphs.checkpoint

    def traced_step_only(run, device, parameters, counts, limit):
        def note(*args: Any, **kwargs: Any) -> None:
            here.append(args)

        def counted_checkpoint(*args: Any, **kwargs: Any) -> Any:
            checkpointed.append(kwargs["use_reentrant"])
            return checkpoint(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(saved_bytes.SavedBytesEstimate, "_partition_traced", note)
            patch.setattr(saved_bytes, "partition_saved_bytes", note)
            patch.setattr(compile_workers.graphs, "checkpoint", counted_checkpoint)
            patch.setattr(compile_accel.regions, "checkpoint", counted_checkpoint)  # (a class's eager first call)
            waiting = predict(run, device, parameters, counts, limit=-1)  # the traced step alone
            assert isinstance(waiting, Waiting)  # for the workers' partitions
            added.extend(auto._estimate.added_bytes(budget) for budget in CANDIDATES)
        raise KeyboardInterrupt

    auto.predict = traced_step_only
    with pytest.warns(RuntimeWarning, match="calibration stopped"), pytest.raises(KeyboardInterrupt):
        lora_step(model, [], inputs_for(model))
    assert here == []
    graphs = auto._estimate.graphs
    assert graphs and all(graph.joint is None and graph.in_worker is None for graph in graphs)
    # Every region's call counted once (not again in the checkpoint's recompute), under a checkpoint.
    assert sum(graph.calls for graph in graphs) == acceleration.stats()["regions"] == len(checkpointed)
    assert checkpointed == [False] * len(checkpointed)
    assert added == [sum(graph.calls * graph.saved_bytes[budget] for graph in graphs) for budget in CANDIDATES]
    assert added[-1] > added[0]  # the budgets differ: the test can tell them apart
    for graph in graphs:
        assert graph.saved_bytes == graph.partition_here()  # the worker's job, run here
    assert len(compile_workers.POOL.kept) == 0  # released when calibration stopped
    acceleration.remove()
    torch._dynamo.reset()


class _ConvBlock(nn.Module):
    """A U-Net-like residual block: on the CPU (mkldnn) inductor lays its convolutions out
    channels-last, saved activations included, as it does on CUDA."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.nn.functional.silu(self.conv1(torch.nn.functional.silu(self.norm(x)))))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ConvBlock(8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_graphs_whose_saved_activations_inductor_lays_out_anew_train_as_eager_once_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Convolutions' saved activations, which inductor lays out channels-last: the backward
    loaded here must expect them as the forward loaded here gives them."""
    from torch._inductor.utils import clear_caches

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # graphs compiled, not loaded
    clear_caches()
    torch._dynamo.reset()
    model, eager = _ConvNet(), _ConvNet()
    eager.load_state_dict(model.state_dict())
    acceleration = compile_accel.apply(
        model, CompileConfig(mode="blocks", activation_memory_budget=0.5, compile_workers=WORKERS), blocks=[model.blocks]
    )
    errors = []
    for step in range(3):  # handed to the workers; then the switch; then compiled forward and backward
        x = torch.randn(2, 8, 12, 12)
        grads = [torch.autograd.grad(net(x).square().mean(), list(net.parameters())) for net in (model, eager)]
        errors.append(max(relative_error(g, e) for g, e in zip(*grads, strict=True)))
        if step == 0:
            assert compile_workers.wait() > 0
    stats = acceleration.stats()
    assert stats["worker_graphs_compiled"] == stats["worker_graphs_started"] > 0
    assert stats["worker_failures"] == [] and stats["fallbacks"] == []
    assert max(errors) < TOLERANCE, errors
    torch._dynamo.reset()
    clear_caches()


def test_with_workers_a_new_input_shape_is_a_static_graph_of_its_own_unless_dynamic_is_asked_for() -> None:
    """Workers take graphs of static shapes; dynamo's automatic dynamic shapes would compile
    the second shape of a block class with symbolic shapes, in this process."""
    assert CompileConfig(compile_workers=2).compile_dynamic is False
    assert CompileConfig(compile_workers=2, dynamic=True).compile_dynamic is True
    assert CompileConfig().compile_dynamic is None


def _untouched(model: nn.Module) -> None:
    """As tests/test_errors.py: no forward patched, no acceleration attached, checkpointing as built."""
    assert not any("forward" in m.__dict__ and not hasattr(m.__dict__["forward"], "__self__") for m in model.modules())
    assert "_compile_accel" not in model.__dict__
    flags = [b.gradient_checkpointing for b in [*model.double_blocks, *model.single_blocks]]
    assert flags and all(flags)


BAD_WORKERS = [
    ({"compile_workers": -1}, r"CompileConfig\.compile_workers must be an int >= 0, got -1"),
    ({"compile_workers": True}, r"CompileConfig\.compile_workers must be an int >= 0, got True"),
    ({"compile_workers": 1.5}, r"CompileConfig\.compile_workers must be an int >= 0, got 1\.5"),
    ({"compile_workers": 1, "backend": "aot_eager"}, r"CompileConfig\.compile_workers .*backend='aot_eager'"),
]


@pytest.mark.parametrize("fields, message", BAD_WORKERS, ids=["-1", "True", "1.5", "aot_eager"])
def test_bad_compile_workers_is_refused_and_changes_nothing(fields: dict, message: str) -> None:
    model, _ = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    pool, handed = compile_workers.POOL.pool, compile_workers.pending()
    with pytest.raises(ValueError, match=message):
        compile_accel.apply(model, CompileConfig(**CONFIG, **fields))
    _untouched(model)
    # No pool started, nothing handed to one.
    assert compile_workers.POOL.pool is pool and compile_workers.pending() == handed


def test_an_apply_whose_worker_pool_cannot_start_raises_with_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """File descriptors exhausted: apply() raised with the blocks' forwards replaced and returned
    nothing to remove() them with; a second apply() stacked a second set, whose forward crashed."""
    from torch._inductor.compile_worker import subproc_pool

    def no_pipes(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(subproc_pool, "SubprocPool", no_pipes)
    monkeypatch.setattr(compile_workers.POOL, "count", 0)
    monkeypatch.setattr(compile_workers.POOL, "pool", None)
    model, _ = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    inputs = inputs_for(model)
    expected = model(*inputs)

    def as_built() -> tuple:
        forwards = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
        hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
        return forwards, hooks, [block.gradient_checkpointing for block in model.single_blocks]

    built = as_built()
    with pytest.raises(OSError, match="Too many open files"):
        compile_accel.apply(model, CompileConfig(**CONFIG, compile_workers=WORKERS))
    assert as_built() == built
    _untouched(model)
    acceleration = compile_accel.apply(model, CompileConfig(**CONFIG, backend="aot_eager"))  # applies as to a new model
    torch.testing.assert_close(model(*inputs), expected)
    assert acceleration.stats()["compiled_regions"] == acceleration.stats()["regions"] > 0
    acceleration.remove()
    assert as_built() == built


def test_compile_workers_where_torch_cannot_is_refused_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch before 2.8: no graph pickler, no AOTAutograd cache to compile into."""
    monkeypatch.setattr(compile_workers, "SUPPORTED", False)
    model, _ = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    pool = compile_workers.POOL.pool
    with pytest.raises(ValueError, match=r"CompileConfig\.compile_workers needs torch's graph pickler and AOTAutograd's cache "
                       r"\(torch >= 2\.8\); use compile_workers=0"):
        compile_accel.apply(model, CompileConfig(**CONFIG, compile_workers=WORKERS))
    _untouched(model)
    assert compile_workers.POOL.pool is pool
