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
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error
from torch import nn

import compile_accel
from compile_accel import CompileConfig, compile_workers
from compile_accel.auto_budget import _InWorkers
from compile_accel.backend import RegionBackend
from compile_accel.compile_profile import CompileClock
from compile_accel.compile_workers import WorkerCompile, WorkerGraph, WorkerPrecompiled
from compile_accel.stats import Stats

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
    auto's partitions are `compile_workers._compile_job`s) held back until `open()`: graphs handed
    to the workers stay uncompiled however fast the workers are."""

    def __init__(self, pool: Any, job: Callable = compile_workers._compile_in_worker) -> None:
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
        patch.setattr(compile_workers, "_first_step_done", False)
        acceleration = compile_accel.apply(model, CompileConfig(**CONFIG, compile_workers=WORKERS))
        assert compile_workers._pool is not None, "apply() did not start the workers"
        # Set, not patched: the pool stops itself (and clears this) once every graph is back.
        gate = compile_workers._pool = _GatedPool(compile_workers._pool)

        record: dict[str, Any] = {"loss": [], "grads": [], "cache_dir": cache_dir}
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
            record["pending_before"] = compile_workers.pending()
            uncompiled_steps = len(record["loss"])
        finally:  # else a failure here leaves graphs that never come back for later tests to wait on
            gate.open()
        record["still_compiling"] = compile_workers.wait()
        switched_before, artifacts_before = compile_workers.graphs_switched(), _aot_cache_artifacts()
        record["pending_after_wait"] = compile_workers.pending()
        record["running_after_wait"] = compile_workers.running()  # the first step is not done yet
        compile_workers.first_step_done()
        record["running_after_first_step"] = compile_workers.running()
        train(2)  # the step that switches to the workers' graphs, then one on them
        record["pending_after_switch"] = compile_workers.pending()
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
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error
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
    empty inductor cache of its own at `cache`: its graphs compile in the workers, not loaded."""
    from torch._inductor.utils import clear_caches

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    clear_caches()
    torch._dynamo.reset()
    monkeypatch.setattr(compile_workers, "_first_step_done", False)
    seed = torch.seed()
    torch.manual_seed(seed)
    model, params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    torch.manual_seed(seed)
    eager, eager_params = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    return model, params, eager, eager_params


def test_graphs_inside_a_trainers_checkpoint_switch_between_steps_not_before_its_recompute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Selective regions run inside the blocks' non-reentrant checkpoints, which recompute them
    in the backward and check that they save what the forward saved. Graphs that come back
    between a step's forward and its backward run uncompiled in that backward too."""
    from torch._inductor.utils import clear_caches

    model, params, eager, eager_params = _twins_compiled_in_workers(tmp_path, monkeypatch)
    acceleration = compile_accel.apply(model, CompileConfig(mode="selective", compile_workers=WORKERS))
    gate = compile_workers._pool = _GatedPool(compile_workers._pool)
    errors = []
    try:
        for step in range(3):
            inputs = inputs_for(model)
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


@pytest.fixture
def spawned_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Windows' kind of worker pool (spawned processes), a pool of its own, stopped after."""
    for name, value in (("_count", 0), ("_pool", None), ("_out", [])):
        monkeypatch.setattr(compile_workers, name, value)
    monkeypatch.setattr(compile_workers, "SPAWNED_POOL", True)
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
    partitions = _GatedPool(compile_workers._pool, job=compile_workers._compile_job)
    gate = compile_workers._pool = _GatedPool(partitions)
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
        assert set(compile_workers._kept) == {auto}
        calls = [graph.calls for graph in auto._estimate.graphs]
        train()
        assert [graph.calls for graph in auto._estimate.graphs] == calls and sum(calls) > 0
        assert auto.checking is None and acceleration.stats()["worker_graphs_started"] == 0
        partitions.open()
        compile_workers.wait()  # (auto's partitions)
        train()  # predicts, hands 0.5 over
        assert auto.result is None and auto.checking == 0.5 and len(compile_workers._held) == 1
        assert auto.waiting_for == "the graphs of budget 0.5" and len(compile_workers._kept) == 0
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
    assert compile_workers._held == set() and auto.checking is None
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
    from compile_accel.auto_budget import CANDIDATES

    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path / "compile_accel"))
    model, _, _, _ = _twins_compiled_in_workers(tmp_path / "inductor", monkeypatch)
    config = CompileConfig(mode="blocks", activation_memory_budget="auto", vram_limit_gib=64.0, compile_workers=WORKERS)
    acceleration = compile_accel.apply(model, config)
    auto = acceleration.auto_budget
    predict, added, here, checkpointed = auto._predict, [], [], []
    checkpoint = compile_workers.checkpoint

    def traced_step_only(run, device, parameters, counts, limit):
        def note(*args: Any, **kwargs: Any) -> None:
            here.append(args)

        def counted_checkpoint(*args: Any, **kwargs: Any) -> Any:
            checkpointed.append(kwargs["use_reentrant"])
            return checkpoint(*args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(saved_bytes.SavedBytesEstimate, "_partition_traced", note)
            patch.setattr(saved_bytes, "partition_saved_bytes", note)
            patch.setattr(compile_workers, "checkpoint", counted_checkpoint)
            with contextlib.suppress(_InWorkers):  # (the workers' partitions not back yet)
                predict(run, device, parameters, counts, limit=-1)  # the traced step alone
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
    assert len(compile_workers._kept) == 0  # released when calibration stopped
    acceleration.remove()
    torch._dynamo.reset()


class _FakeProcess:
    """The pool's process, running, with no pipe ends of ours to close."""

    args: list[str] = []
    returncode = None

    def poll(self) -> None:
        return None

    def wait(self, timeout: float) -> None:
        return None


class _FakePool:
    """SubprocPool's part that compile_workers uses, its futures finished by hand."""

    made: list[_FakePool] = []

    def __init__(self, count: int, kind: Any) -> None:
        self.count, self.futures, self.jobs, self.shut_down = count, [], [], threading.Event()
        self.threads = os.environ["TORCHINDUCTOR_COMPILE_THREADS"]
        self.running, self.process = True, _FakeProcess()
        _FakePool.made.append(self)

    def submit(self, *args: Any) -> concurrent.futures.Future:
        self.jobs.append(args)
        self.futures.append(concurrent.futures.Future())
        return self.futures[-1]

    def shutdown(self) -> None:
        self.shut_down.set()


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_workers with no pool yet, whose pools are _FakePools."""
    from torch._inductor.compile_worker import subproc_pool

    monkeypatch.setattr(subproc_pool, "SubprocPool", _FakePool)
    monkeypatch.setattr(_FakePool, "made", [])
    monkeypatch.setattr(os, "cpu_count", lambda: 12)  # (at most one worker per core)
    for name, value in (("_count", 0), ("_pool", None), ("_out", []), ("_first_step_done", False)):
        monkeypatch.setattr(compile_workers, name, value)
    monkeypatch.setattr(compile_workers, "IDLE_SECONDS_BEFORE_FIRST_STEP_DONE", 2.0)


@pytest.mark.usefixtures("fake_pool")
def test_before_the_first_step_is_done_an_idle_pool_waits_for_more_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    threads_here = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    compile_workers.start(3)
    compile_workers.start(5)  # a later count is ignored
    (pool,) = _FakePool.made
    assert (pool.count, pool.threads) == (3, "4")  # each worker's share of the 12 cores
    assert os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") == threads_here  # set for the workers only
    # Each worker gets ready for its first graph as it starts (not a graph: not waited for).
    assert pool.jobs == [(compile_workers._get_ready,)] * 3 and compile_workers._out == []
    first = compile_workers._submit("graph 0")
    first.set_result("compiled")
    assert compile_workers.running()  # nothing out, but idle for less than 2 s
    second = compile_workers._submit("graph 1")  # the next wave goes to the same pool
    assert len(_FakePool.made) == 1
    second.set_exception(RuntimeError("inductor raised"))  # a failed graph is back too
    back = time.monotonic()
    checks = [t for t in threading.enumerate() if getattr(t, "function", None) is compile_workers._stop_if_idle]
    for check in checks:
        check.join(0.5)  # (the first graph's check, replaced, ends at once)
    assert sum(check.is_alive() for check in checks) == 1  # one check waits, not one per graph back
    assert pool.shut_down.wait(10) and not compile_workers.running()
    assert time.monotonic() - back >= 1.9  # stopped once idle for the 2 s, counted from the last graph


@pytest.mark.usefixtures("fake_pool")
def test_more_compile_workers_than_cpu_cores_start_one_per_core_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_workers=100000 had apply() starting processes until the test's time ran out."""
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    model, _ = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    with pytest.warns(RuntimeWarning, match=r"CompileConfig\.compile_workers=100000 is more than this machine's 3 CPU "
                      r"cores: using compile_workers=3"):
        acceleration = compile_accel.apply(model, CompileConfig(**CONFIG, compile_workers=100000))
    (pool,) = _FakePool.made
    assert pool.count == 3 and len(pool.jobs) == 3  # each worker's get-ready job
    acceleration.remove()


@pytest.mark.usefixtures("fake_pool")
def test_after_the_first_step_the_pool_stops_once_every_graph_is_back_and_starts_again_for_the_next() -> None:
    compile_workers.start(3)
    first = compile_workers._submit("graph 0")
    compile_workers.first_step_done()
    (pool,) = _FakePool.made
    assert compile_workers.running() and not pool.shut_down.is_set()  # a graph is out
    first.set_result("compiled")
    assert pool.shut_down.wait(10) and not compile_workers.running()
    # A graph after that (new input shapes) starts a new pool of the same size, which stops
    # as soon as that graph is back.
    second = compile_workers._submit("graph 1")
    assert len(_FakePool.made) == 2 and _FakePool.made[1].count == 3 and compile_workers.running()
    second.set_result("compiled")
    assert _FakePool.made[1].shut_down.wait(10) and not compile_workers.running()


@pytest.mark.usefixtures("fake_pool")
def test_a_kept_pool_stays_up_with_nothing_out_until_released() -> None:
    """auto keeps the pool between its partitions' return and its candidate's hand-over."""
    holder = type("Holder", (), {})()  # (as an AutoBudget: hashable, weakly referenced)
    compile_workers.start(2)
    compile_workers.keep_running(holder, True)
    partitions = compile_workers._submit("partitions")
    compile_workers.first_step_done()
    partitions.set_result({})
    (pool,) = _FakePool.made
    assert not pool.shut_down.wait(0.5) and compile_workers.running()
    compile_workers.keep_running(holder, False)
    assert pool.shut_down.wait(10) and not compile_workers.running()


@pytest.mark.usefixtures("fake_pool")
def test_a_pool_that_got_no_graph_stops_when_the_first_step_is_done() -> None:
    """A warm start: every graph came from the caches."""
    compile_workers.start(2)
    assert compile_workers.running()
    compile_workers.first_step_done()
    assert _FakePool.made[0].shut_down.wait(10) and not compile_workers.running()


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


def _traced(fn: Callable, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """dynamo's graph module of `fn` and the inputs it hands a backend."""
    traced: list = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        traced.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    return traced[0]


def _eager(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    return gm.forward


def _sine(t: torch.Tensor) -> torch.Tensor:
    return t.sin() * 2.0 + 1.0


def _checkpointed_sine(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(lambda a: (a @ w).sin() * 2.0, t, use_reentrant=False) + 1.0


def test_a_graph_with_a_checkpoint_traced_in_it_goes_to_a_worker_with_its_body() -> None:
    """A block compiled whole with the model's checkpoint left on (a checkpoint that a budget
    could not switch off) traces it as a higher-order op whose body is a graph of its own: packed
    and compiled with it (here as a worker would, by AOTAutograd)."""
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4)
    gm, inputs = _traced(_checkpointed_sine, x, w)
    assert any(isinstance(child, torch.fx.GraphModule) for child in gm.children())
    packed = compile_workers._pack_graph(gm, inputs)
    assert isinstance(packed, bytes), packed
    compiled = compile_workers._compile_packed(packed, torch._dynamo.lookup_backend("aot_eager"))
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
    gm, inputs = _traced(lambda t: _opaque_double(t).sin(), torch.randn(3))
    reason = compile_workers._pack_graph(gm, inputs)
    assert isinstance(reason, str) and reason.startswith("AOTAutograd would not cache it: "), reason


def test_a_graph_no_pool_takes_compiles_in_this_process_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def closed(*args: Any) -> None:
        raise RuntimeError("Attempting to use a closed pool")

    monkeypatch.setattr(compile_workers, "_submit", closed)
    x = torch.randn(8, 8, requires_grad=True)
    gm, inputs = _traced(_sine, x)
    stats, compiled_here = Stats(), []

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled_here.append(graph)
        if len(compiled_here) == 1:
            raise compile_workers._NotCached  # the lookup in the caches: a miss
        return graph.forward

    with pytest.warns(RuntimeWarning, match=r"graph 5/0 could not be handed to a compile worker "
                      r"\(Attempting to use a closed pool\); it compiles in this process"):
        compiled = compile_workers.compile_in_workers(gm, inputs, _eager, compile_here, stats, "graph 5/0", False)
    assert compiled_here == [gm, gm]  # looked up in the caches, then compiled
    torch.testing.assert_close(compiled(x)[0], _sine(x))
    assert stats.worker_graphs_started == 0 and compile_workers.pending() == 0


def test_a_graph_whose_parameters_hold_gradients_goes_to_a_worker_on_stand_ins_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gradient accumulation over micro-batches of two shapes (no zero_grad between), or the
    precompile after a step whose loop zeroes gradients at the next step's start: a parameter's
    fake kept its .grad, which did not pickle, and the graph compiled in this process."""
    submitted: list[tuple] = []
    monkeypatch.setattr(compile_workers, "_submit", lambda *args: submitted.append(args) or concurrent.futures.Future())
    monkeypatch.setattr(compile_workers, "_misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)  # no look-up here
    weight = nn.Parameter(torch.randn(4, 4))
    weight.grad = torch.ones(4, 4)
    gm, inputs = _traced(lambda t: (t @ weight).sin(), torch.randn(3, 4))
    assert any(t.grad is not None for t in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # not "could not be handed to a compile worker"
        graph = compile_workers.compile_in_workers(gm, inputs, _eager, _eager, Stats(), "graph 15/0", False)
        precompiled = compile_workers.precompile_in_workers(gm, inputs, _eager)
    assert isinstance(graph, WorkerGraph) and isinstance(precompiled, compile_workers.WorkerPrecompiled)
    assert len(submitted) == 2
    _, stand_ins = compile_workers._unpack_graph(graph._packed)
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
        future.add_done_callback(compile_workers._back)
        submitted.append(future)
        return future

    monkeypatch.setattr(compile_workers, "_submit", submit)
    monkeypatch.setattr(compile_workers, "_stop_when_idle", lambda: None)  # (no pool to stop)
    x = torch.randn(4, 4)
    gm, inputs = _traced(_sine, x)
    looked_up = []

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        looked_up.append(graph)
        raise compile_workers._NotCached  # every look-up misses

    def hand_over() -> Callable:
        return compile_workers.compile_in_workers(gm, inputs, _eager, compile_here, Stats(), "graph 13/0", False)

    misses = compile_workers.MISSES_BEFORE_COLD
    graphs = [hand_over() for _ in range(misses + 2)]
    assert len(looked_up) == misses and len(submitted) == misses + 2
    assert all(isinstance(graph, WorkerGraph) for graph in graphs)
    submitted[0].set_result(_report(autograd_cache_miss=1, autograd_cache_saved=1))  # compiled: still cold
    hand_over()
    assert len(looked_up) == misses
    submitted[1].set_result(_report(autograd_cache_hit=1))  # its worker found it in the caches
    hand_over()
    assert len(looked_up) == misses + 1 and len(submitted) == misses + 4
    for future in submitted[2:]:
        future.set_result(_report())


class _WorkerError(RuntimeError):
    pass


def _report(**aot_autograd: int) -> WorkerCompile:
    return WorkerCompile(aot_autograd, time.time(), 1.0, CompileClock().since())


OUTCOMES = {
    # what the worker's future gives -> why the graph compiled here
    "raised": (_WorkerError("inductor raised in the worker"), r"_WorkerError: inductor raised in the worker"),
    "bypassed": (_report(autograd_cache_bypass=1), r"AOTAutograd's cache cannot hold it"),
    "not_cached": (_report(autograd_cache_miss=1, autograd_cache_saved=1), r"what it compiled was not found"),
}


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_a_graph_the_worker_did_not_put_in_the_caches_compiles_here_once_with_a_warning(outcome: str) -> None:
    result, why = OUTCOMES[outcome]
    x = torch.randn(3, 4)
    gm, inputs = _traced(_sine, x)
    future: concurrent.futures.Future = concurrent.futures.Future()
    stats, compiled_here = Stats(), []

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # The packed graph, on fake inputs: as the worker compiled it.
        assert graph.code == gm.code and all(type(t).__name__ == "FakeTensor" for t in example_inputs)
        compiled_here.append(graph)
        return lambda t: (t * 100.0,)  # tells which one ran

    packed = compile_workers._pack_graph(gm, inputs)
    switched_before = compile_workers.graphs_switched()
    graph = WorkerGraph(gm, packed, compile_here, future, stats, "graph 7/0", checkpointed=False)
    torch.testing.assert_close(graph(x)[0], _sine(x), rtol=0, atol=0)  # not back: uncompiled
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
    # Back, but a trainer's checkpoint may run it again in this step's backward: uncompiled
    # until the next step starts.
    torch.testing.assert_close(graph(x)[0], _sine(x), rtol=0, atol=0)
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
    gm, inputs = _traced(_sine, x)
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(_WorkerError("inductor raised in the worker"))

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        raise _WorkerError("inductor raised here too")

    stats, switched_before = Stats(), compile_workers.graphs_switched()
    graph = WorkerGraph(gm, compile_workers._pack_graph(gm, inputs), compile_here, future, stats, "graph 8/0", True)
    with pytest.warns(RuntimeWarning, match=r"graph 8/0 did not compile in a worker .* nor here, and keeps running "
                      r"uncompiled: inductor raised here too"):
        torch.testing.assert_close(graph(x)[0], _sine(x), rtol=0, atol=0)
    y = torch.randn(3, 4)
    torch.testing.assert_close(graph(y)[0], _sine(y), rtol=0, atol=0)
    assert len(stats.worker_failures) == 1 and stats.worker_graphs_compiled == 0
    assert compile_workers.graphs_switched() == switched_before  # still uncompiled: nothing new to save


def test_wait_and_load_waits_for_the_workers_then_loads_their_graphs_before_their_next_call() -> None:
    """--compile_workers_wait: the end of the first step waits for the workers and loads what they
    compiled, so that the next step runs compiled from its first call; auto's held graphs stay."""
    x = torch.randn(3, 4)
    gm, inputs = _traced(_sine, x)
    packed = compile_workers._pack_graph(gm, inputs)

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # Under autocast, as handed over in the step (AOTAutograd's cache key holds it), not as now.
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] += 1  # as a load of the workers' entry
        return lambda t: (t * 100.0,)  # tells which one ran

    stats, held_stats = Stats(), Stats()
    back_later: concurrent.futures.Future = concurrent.futures.Future()
    back_already: concurrent.futures.Future = concurrent.futures.Future()
    back_already.set_result(_report())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = WorkerGraph(gm, packed, compile_here, back_later, stats, "graph 9/0", checkpointed=False)
        held = WorkerGraph(gm, packed, compile_here, back_already, held_stats, "graph 9/1", checkpointed=False)
    compile_workers.hold_switches(held_stats, True)
    timer = threading.Timer(0.3, back_later.set_result, args=(_report(),))
    started = time.monotonic()
    timer.start()
    try:
        assert compile_workers.wait_and_load() == 1
        assert time.monotonic() - started >= 0.25  # it waited for the worker
        # Compiled at its next call, though no step has started since it was back.
        torch.testing.assert_close(graph(x)[0], x * 100.0, rtol=0, atol=0)
        assert stats.worker_graphs_compiled == 1 and [c["graph"] for c in stats.worker_compiles] == ["graph 9/0"]
        torch.testing.assert_close(held(x)[0], _sine(x), rtol=0, atol=0)  # held by auto: uncompiled
    finally:
        compile_workers.hold_switches(held_stats, False)
    assert compile_workers.wait_and_load() == 1 and compile_workers.pending() == 0  # released: loaded too
    torch.testing.assert_close(held(x)[0], x * 100.0, rtol=0, atol=0)
    assert not torch.is_autocast_enabled("cpu")  # put back


def test_wait_and_load_loads_each_graph_as_it_comes_back_while_the_others_still_compile() -> None:
    """The first step's wait ends with the slowest graph's compile, not that plus every graph's
    load: a graph back early is loaded (and run once) while a later one is still in its worker."""
    x = torch.randn(3, 4)
    gm, inputs = _traced(_sine, x)
    packed = compile_workers._pack_graph(gm, inputs)
    back_later: concurrent.futures.Future = concurrent.futures.Future()
    pending_when_loaded = []

    def come_back() -> None:
        if not back_later.done():
            back_later.set_result(_report())

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        pending_when_loaded.append(not back_later.done())
        come_back()  # the late one's worker is done once the early one is loaded
        torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] += 1
        return graph.forward

    early = WorkerGraph(gm, packed, compile_here, _back(), Stats(), "graph 12/0", checkpointed=False)
    late = WorkerGraph(gm, packed, compile_here, back_later, Stats(), "graph 12/1", checkpointed=False)
    timer = threading.Timer(5.0, come_back)  # (so that waiting for every graph first fails, not hangs)
    timer.start()
    try:
        assert compile_workers.wait_and_load() == 2
    finally:
        timer.cancel()
    assert pending_when_loaded == [True, False]  # the early one while the late one compiled
    assert early.future is None and late.future is None and compile_workers.pending() == 0


def _loaded_by_hand(runs: list, fails: bool = False) -> Callable:
    """A compile_here that loads as from the workers' entry: its graph, recording each call's
    inputs, the autocast it ran under and whether inside a backward; `fails`: raises on zeros."""

    def compile_here(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"] += 1

        def run(*args: torch.Tensor) -> Any:
            runs.append((args, torch.is_autocast_enabled("cpu"), torch._C._current_graph_task_id() != -1))
            if fails and not any(t.any() for t in args):
                raise RuntimeError("no kernel for zeros")
            return graph.forward(*args)

        return run

    return compile_here


def _back() -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(_report())
    return future


def test_wait_and_load_runs_each_loaded_graph_once_on_zeros_and_leaves_the_training_as_it_was() -> None:
    """Its kernels' first run (autotuning, loading) falls in the first step, not the second, also
    inside a backward for a graph with grad, where a checkpoint recomputes it (on a GPU, on the
    autograd engine's thread); the stand-ins' gradients and the random numbers drawn are not the
    training's."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.empty_strided((3, 4), (1, 3)).copy_(torch.randn(3, 4))  # not contiguous: the stand-in has its strides
    gm, inputs = _traced(lambda t, weight: (t @ weight).sin() * torch.rand(1), x, w)
    packed = compile_workers._pack_graph(gm, inputs)
    # One record per graph: wait_and_load loads them in the order their workers finish.
    runs: list[list[tuple]] = [[], [], []]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = WorkerGraph(gm, packed, _loaded_by_hand(runs[0]), _back(), Stats(), "graph 10/0", True)
    recorded = WorkerGraph(gm, packed, _loaded_by_hand(runs[1]), _back(), Stats(), "graph 10/1", True,
                           cuda_graphs=True)
    with torch.no_grad():
        without_grad = WorkerGraph(gm, packed, _loaded_by_hand(runs[2]), _back(), Stats(), "graph 10/2", True)
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
    gm, inputs = _traced(_sine, x)
    future: concurrent.futures.Future = concurrent.futures.Future()
    stats = Stats()
    WorkerGraph(gm, compile_workers._pack_graph(gm, inputs), _loaded_by_hand([]), future, stats, "graph 14/0", False)
    time.sleep(0.3)
    future.set_result(WorkerCompile({}, time.time() - 0.1, 0.1, CompileClock().since()))  # queued 0.2 s, compiled 0.1 s
    assert compile_workers.wait_and_load() == 1
    [record] = stats.worker_compiles
    assert 0 <= record["handed_over_at_s"] < record["back_at_s"] <= record["loaded_at_s"]
    assert record["back_at_s"] - record["handed_over_at_s"] >= 0.29 and record["queued_s"] >= 0.19
    assert record["first_run_s"] >= 0  # run once on zeros (a forward and a backward)


def test_a_graph_with_integer_inputs_or_whose_first_run_fails_runs_compiled_from_its_next_call() -> None:
    """Zeros as indices may index out of bounds (a device-side assert on a GPU): not run. A first
    run that raises is warned about."""
    x = torch.randn(3, 4)
    indexed_gm, indexed_inputs = _traced(lambda t, i: t[i] * 2.0, x, torch.tensor([2, 0]))
    gm, inputs = _traced(_sine, x)
    runs: list[tuple] = []
    indexed = WorkerGraph(indexed_gm, compile_workers._pack_graph(indexed_gm, indexed_inputs),
                          _loaded_by_hand(runs), _back(), Stats(), "graph 11/0", True)
    failing = WorkerGraph(gm, compile_workers._pack_graph(gm, inputs), _loaded_by_hand(runs, fails=True), _back(),
                          Stats(), "graph 11/1", True)
    with pytest.warns(RuntimeWarning, match=r"graph 11/1: its first run on stand-in inputs failed \(RuntimeError: no "
                      r"kernel for zeros\); it runs compiled from its next call"):
        assert compile_workers.wait_and_load() == 2
    assert len(runs) == 1  # the failing one's; none for the indexed one
    torch.testing.assert_close(indexed(x, torch.tensor([2, 0]))[0], x[[2, 0]] * 2.0)
    torch.testing.assert_close(failing(x)[0], _sine(x))
    assert len(runs) == 3  # both compiled


@pytest.mark.parametrize("checkpointed", [True, False])
def test_until_it_is_compiled_a_budgeted_graph_runs_under_a_checkpoint(checkpointed: bool) -> None:
    """A budget switched the block's own checkpointing off: uncompiled, the graph recomputes its
    forward in the backward instead of keeping every activation."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    gm, inputs = _traced(lambda t, weight: (t @ weight).sin(), x, w)
    calls = []
    forward = gm.forward
    gm.forward = lambda *args: calls.append(1) or forward(*args)
    graph = WorkerGraph(gm, b"", lambda *a: None, concurrent.futures.Future(), Stats(), "graph 9/0", checkpointed)
    (out,) = graph(*inputs)
    (grad,) = torch.autograd.grad(out.sum(), w)
    torch.testing.assert_close(grad, torch.autograd.grad((x @ w).sin().sum(), w)[0])
    assert len(calls) == (2 if checkpointed else 1)


def test_a_worker_compiles_under_the_training_process_grad_mode_autocast_and_flags() -> None:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = compile_workers._runtime_state()
    assert state["grad"] is False and state["autocast"] == {"cpu": torch.bfloat16}
    flags = compile_workers._precision_flags()
    before = [getattr(module, name) for module, name in flags]
    try:
        with compile_workers._in_runtime_state(state):
            assert not torch.is_grad_enabled()
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert compile_workers._runtime_state() == state
    finally:
        for (module, name), value in zip(flags, before, strict=True):
            setattr(module, name, value)
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


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
    pool, handed = compile_workers._pool, compile_workers.pending()
    with pytest.raises(ValueError, match=message):
        compile_accel.apply(model, CompileConfig(**CONFIG, **fields))
    _untouched(model)
    # No pool started, nothing handed to one.
    assert compile_workers._pool is pool and compile_workers.pending() == handed



def test_an_apply_whose_worker_pool_cannot_start_raises_with_the_model_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """File descriptors exhausted: apply() raised with the blocks' forwards replaced and returned
    nothing to remove() them with; a second apply() stacked a second set, whose forward crashed."""
    from torch._inductor.compile_worker import subproc_pool

    def no_pipes(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(subproc_pool, "SubprocPool", no_pipes)
    monkeypatch.setattr(compile_workers, "_count", 0)
    monkeypatch.setattr(compile_workers, "_pool", None)
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
    pool = compile_workers._pool
    with pytest.raises(ValueError, match=r"CompileConfig\.compile_workers needs torch's graph pickler and AOTAutograd's cache "
                       r"\(torch >= 2\.8\); use compile_workers=0"):
        compile_accel.apply(model, CompileConfig(**CONFIG, compile_workers=WORKERS))
    _untouched(model)
    assert compile_workers._pool is pool


# Killing the workers' pool process (an out-of-memory kill, a crash, `pkill -f compile_worker`):
# the parent kept its child's pipe ends open, so torch's reader never saw the pipe close, the
# waits never returned and later graphs went to a process that was gone.
HANG = 60.0  # seconds: far above what a wait takes once it notices the pool gone


@pytest.fixture(params=["pipe ends closed", "pipe ends kept open", "spawned pool"])
def kill_pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A real pool of one worker, graphs handed to it without a look-up here, and what kills its
    process (torch's SubprocPool's, whose children the workers are; Windows' spawned pool's
    worker) with SIGKILL. With the pipe ends kept open (as torch keeps them), only the liveness
    checks can tell it is gone."""
    for name, value in (("_count", 0), ("_pool", None), ("_out", []), ("_first_step_done", False)):
        monkeypatch.setattr(compile_workers, name, value)
    if request.param == "pipe ends kept open":
        monkeypatch.setattr(compile_workers, "_close_its_pipe_ends", lambda pool: None)
    monkeypatch.setattr(compile_workers, "SPAWNED_POOL", request.param == "spawned pool")
    monkeypatch.setattr(compile_workers, "_misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)
    compile_workers.start(1)
    if request.param == "spawned pool":
        process = next(iter(compile_workers._pool._executor._processes.values()))
    else:
        process = compile_workers._pool.process

    def kill() -> None:
        os.kill(process.pid, signal.SIGKILL)
        (process.join if request.param == "spawned pool" else process.wait)(HANG)

    yield kill
    compile_workers.stop()


def _within_deadline(call: Callable[[], Any]) -> Any:
    """What `call` returns, run in a thread of its own; fails (not hangs) past HANG seconds."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(HANG)
    assert not thread.is_alive(), f"still waiting after {HANG:.0f} s"
    return result[0]


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("compile_accel:")]


def _handed_over(label: str, runs: list, stats: Stats) -> Callable:
    x = torch.randn(3, 4)
    gm, inputs = _traced(_sine, x)
    return compile_workers.compile_in_workers(gm, inputs, _eager, _loaded_by_hand(runs), stats, label, False)


pool_killing = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")


def test_windows_spawned_pool_compiles_graphs_in_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows' pool (spawned processes, nothing inherited but what the jobs carry): a graph
    handed over compiles in a worker and runs as traced once back; the pool stops when idle."""
    for name, value in (("_count", 0), ("_pool", None), ("_out", []), ("_first_step_done", False)):
        monkeypatch.setattr(compile_workers, name, value)
    monkeypatch.setattr(compile_workers, "SPAWNED_POOL", True)
    monkeypatch.setattr(compile_workers, "_misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)
    compile_workers.start(1)
    pool = compile_workers._pool
    assert isinstance(pool, compile_workers._SpawnedPool)
    assert pool._executor._mp_context.get_start_method() == "spawn"
    stats, runs = Stats(), []
    graph = _handed_over("graph 20/0", runs, stats)
    assert isinstance(graph, WorkerGraph)
    assert _within_deadline(compile_workers.wait_and_load) == 1
    assert (stats.worker_graphs_compiled, stats.worker_failures) == (1, [])
    (record,) = stats.worker_compiles
    assert record["worker_s"] > 0 and graph.future is None
    x = torch.randn(3, 4)
    torch.testing.assert_close(graph(x)[0], _sine(x))
    compile_workers.first_step_done()
    assert not compile_workers.running()


@pool_killing
def test_graphs_after_the_pool_process_was_killed_compile_here_with_one_warning(kill_pool: Callable) -> None:
    """New shapes after the kill: the first one's graph went to the dead pool for ever, the next
    one's write to its pipe could block the forward."""
    kill_pool()
    stats = Stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs = _within_deadline(lambda: [_handed_over(f"graph 16/{i}", [], stats) for i in range(2)])
    [warning] = _ours(caught)
    assert "the compile workers' pool process exited (exit code -9" in warning
    assert not any(isinstance(graph, WorkerGraph) for graph in graphs)  # compiled here, at once
    assert stats.worker_graphs_started == 0 and not compile_workers.running()
    x = torch.randn(3, 4)
    torch.testing.assert_close(graphs[1](x)[0], _sine(x))


@pool_killing
def test_a_wait_on_a_killed_pool_returns_and_its_graph_compiles_here_with_one_warning(kill_pool: Callable) -> None:
    stats, runs = Stats(), []
    graph = _handed_over("graph 17/0", runs, stats)
    assert isinstance(graph, WorkerGraph) and stats.worker_graphs_started == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        waiting = threading.Timer(0.5, kill_pool)  # killed while wait_and_load waits for it
        waiting.start()
        assert _within_deadline(compile_workers.wait_and_load) == 1
        waiting.join()
        assert _within_deadline(compile_workers.wait) == 0
    [warning] = _ours(caught)
    assert "the compile workers' pool process exited (exit code -9" in warning
    assert graph.future is None and graph._compiled is not None and runs  # compiled here, run on zeros
    assert stats.worker_graphs_compiled == 0 and len(stats.worker_failures) == 1
    assert stats.worker_failures[0].startswith("graph 17/0: ")
    assert compile_workers.pending() == 0 and not compile_workers.running()


@pool_killing
def test_a_pool_killed_while_a_graph_loads_leaves_the_others_to_compile_here_with_one_warning(
    kill_pool: Callable,
) -> None:
    x = torch.randn(3, 4)
    gm, inputs = _traced(_sine, x)

    def killed_as_it_loads(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        kill_pool()
        return _loaded_by_hand([])(graph, example_inputs)

    back_stats, out_stats = Stats(), Stats()
    back = WorkerGraph(gm, compile_workers._pack_graph(gm, inputs), killed_as_it_loads, _back(), back_stats,
                       "graph 18/0", False)
    out = _handed_over("graph 18/1", [], out_stats)
    assert isinstance(out, WorkerGraph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _within_deadline(compile_workers.wait_and_load) == 2
    [warning] = _ours(caught)
    assert "the compile workers' pool process exited (exit code -9" in warning
    assert back_stats.worker_graphs_compiled == 1 and back_stats.worker_failures == []  # the worker's, loaded
    assert out_stats.worker_graphs_compiled == 0 and len(out_stats.worker_failures) == 1  # compiled here
    assert back.future is None and out.future is None and compile_workers.pending() == 0


@pytest.mark.usefixtures("fake_pool")
def test_a_pool_whose_pipe_breaks_as_a_graph_is_written_is_given_up_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its process exited between the liveness check and the write (the pipe ends closed here)."""
    def broken_pipe(*args: Any) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    compile_workers.start(2)
    (pool,) = _FakePool.made
    monkeypatch.setattr(pool, "submit", broken_pipe)
    monkeypatch.setattr(compile_workers, "_misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)
    stats = Stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs = [_handed_over(f"graph 19/{i}", [], stats) for i in range(2)]
    [warning] = _ours(caught)
    assert "the compile workers' pool process exited (its pipe broke" in warning
    assert not any(isinstance(graph, WorkerGraph) for graph in graphs) and stats.worker_graphs_started == 0
    assert len(_FakePool.made) == 1 and not compile_workers.running()  # no pool started again


@pool_killing
def test_a_precompile_save_waiting_on_a_killed_pool_leaves_its_graph_out_with_one_warning(kill_pool: Callable) -> None:
    """The precompile save's thread waits for each graph it writes (WorkerPrecompiled): killed
    while that wait runs, the graph fails and is left out of the file instead of the thread
    waiting for ever."""
    precompiled = WorkerPrecompiled(compile_workers._submit(time.sleep, HANG))  # still compiling, as it were

    def serialize() -> BaseException | None:
        try:
            WorkerPrecompiled.serialize_compile_artifacts(precompiled)
        except Exception as error:  # what PrecompileSave leaves out (precompile._left_out)
            return error
        return None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        killing = threading.Timer(0.5, kill_pool)
        killing.start()
        error = _within_deadline(serialize)
        killing.join()
    assert error is not None
    [warning] = _ours(caught)
    assert "the compile workers' pool process exited (exit code -9" in warning
    assert not compile_workers.running()
