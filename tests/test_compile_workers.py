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
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error
from torch import nn

import compile_accel
from compile_accel import CompileConfig, compile_workers
from compile_accel.compile_workers import WorkerCompiledGraph
from compile_accel.stats import Stats

pytestmark = pytest.mark.skipif(
    not compile_workers.SUPPORTED,
    reason="compile_workers needs torch's out-of-process compile (torch >= 2.8) and a platform other than Windows",
)

TOLERANCE = 1e-4
WORKERS = 2
LR = 0.1
CONFIG = {"mode": "blocks", "activation_memory_budget": 0.5}


class _GatedPool:
    """The workers' pool, with every result held back until `open()`: graphs handed to the
    workers stay uncompiled however fast the workers are."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
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
        gated: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._pairs.append((real, gated))
            opened = self._opened
        if opened:
            real.add_done_callback(lambda done: self._relay(done, gated))
        return gated

    def open(self) -> None:
        with self._lock:
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
        record["pending_after_wait"] = compile_workers.pending()
        record["running_after_wait"] = compile_workers.running()  # the first step is not done yet
        compile_workers.first_step_done()
        record["running_after_first_step"] = compile_workers.running()
        train(2)  # the step that switches to the workers' graphs, then one on them
        record["pending_after_switch"] = compile_workers.pending()
        record["after"] = acceleration.stats()
        record["uncompiled_steps"] = uncompiled_steps
        record["params"] = max(relative_error(p, e) for p, e in zip(params, eager_params, strict=True))
        record["inductor_counters"] = dict(torch._dynamo.utils.counters["inductor"] - counted_before)
        yield record
        torch._dynamo.reset()
        clear_caches()
    clear_caches()


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
    # The graphs were compiled fresh (a miss in this module's empty cache), not loaded.
    assert trained["inductor_counters"].get("fxgraph_cache_miss", 0) > 0
    assert trained["inductor_counters"].get("fxgraph_cache_hit", 0) == 0
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


class _FakePool:
    """SubprocPool's part that compile_workers uses, its futures finished by hand."""

    made: list[_FakePool] = []

    def __init__(self, count: int, kind: Any) -> None:
        self.count, self.futures, self.shut_down = count, [], threading.Event()
        self.threads = os.environ["TORCHINDUCTOR_COMPILE_THREADS"]
        _FakePool.made.append(self)

    def submit(self, *args: Any) -> concurrent.futures.Future:
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
    first = compile_workers._submit("graph 0")
    first.set_result("compiled")
    assert compile_workers.running()  # nothing out, but idle for less than 2 s
    second = compile_workers._submit("graph 1")  # the next wave goes to the same pool
    assert len(_FakePool.made) == 1
    second.set_exception(RuntimeError("inductor raised"))  # a failed graph is back too
    back = time.monotonic()
    assert pool.shut_down.wait(10) and not compile_workers.running()
    assert time.monotonic() - back >= 1.9  # stopped once idle for the 2 s, counted from the last graph


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
    """Forward and backward compile at the same time in the workers: the forward must hand the
    backward its saved activations in the strides the backward was compiled for."""
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


def test_inductor_settings_a_worker_cannot_compile_are_off_only_while_compiling_there() -> None:
    import torch._inductor.config as inductor_config

    def setting(name: str) -> Any:
        section, _, field = name.rpartition(".")
        return getattr(getattr(inductor_config, section) if section else inductor_config, field)

    if not compile_workers.WORKER_INDUCTOR_SETTINGS:
        pytest.skip("this torch has none of the settings")
    others = {name: not value for name, value in compile_workers.WORKER_INDUCTOR_SETTINGS.items()}
    with inductor_config.patch(others):  # as this torch's defaults (or the environment) may not be
        with compile_workers.compiling_in_workers(Stats(), "graph 0/0"):
            assert {name: setting(name) for name in others} == compile_workers.WORKER_INDUCTOR_SETTINGS
        assert {name: setting(name) for name in others} == others


def test_a_graph_no_pool_takes_compiles_in_this_process_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor.utils import clear_caches

    def closed(*args: Any) -> None:
        raise RuntimeError("Attempting to use a closed pool")

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compiled, not loaded
    clear_caches()
    monkeypatch.setattr(compile_workers, "_submit", closed)
    stats, x = Stats(), torch.randn(8, 8)
    misses = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"]  # counters outlive dynamo's reset
    with pytest.warns(RuntimeWarning, match=r"graph 5/0 \(forward\) could not be handed to a compile worker "
                      r"\(Attempting to use a closed pool\); it compiles in this process"):
        with compile_workers.compiling_in_workers(stats, "graph 5/0"):
            out = torch.compile(lambda t: t.sin() * 2.0 + 1.0, backend="inductor")(x)
    torch.testing.assert_close(out, x.sin() * 2.0 + 1.0)
    assert stats.worker_graphs_started == 0
    assert torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"] > misses  # compiled here
    clear_caches()


class _WorkerError(RuntimeError):
    pass


def _failing(where: str) -> tuple[concurrent.futures.Future, Any, list]:
    """A finished future and an unpack whose result fails at `where`; the compiled graph's calls."""
    calls: list = []

    class Compiled:
        def post_compile(self, *args: Any) -> None:
            if where == "post_compile":
                raise _WorkerError("could not load the compiled graph")

        def __call__(self, inputs: list) -> list:
            calls.append(inputs)
            return [inputs[0] * 100.0]

    future: concurrent.futures.Future = concurrent.futures.Future()
    if where == "worker":
        future.set_exception(_WorkerError("inductor raised in the worker"))
    else:
        future.set_result("pickled output")

    def unpack(output: Any) -> Any:
        assert output == "pickled output"
        if where == "unpack":
            raise _WorkerError("could not unpickle the output")
        return Compiled()

    return future, unpack, calls


@pytest.mark.parametrize("where", ["worker", "unpack", "post_compile"])
def test_a_worker_failure_warns_once_and_the_graph_keeps_running_uncompiled(where: str) -> None:
    stats, saved = Stats(), []
    future, unpack, compiled_calls = _failing(where)
    graph = WorkerCompiledGraph(lambda inputs: [inputs[0] * 2.0 + 1.0], future, unpack, stats, "graph 7/0")
    graph._save = saved.append
    graph.post_compile(["example"], None, {})
    x = torch.randn(3, 4)
    message = {
        "worker": "inductor raised in the worker",
        "unpack": "could not unpickle",
        "post_compile": "could not load",
    }
    warning = f"graph 7/0 failed to compile in a worker and keeps running uncompiled: {message[where]}"
    with pytest.warns(RuntimeWarning, match=warning):
        (out,) = graph([x])
    torch.testing.assert_close(out, x * 2.0 + 1.0, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next calls are quiet
        for _ in range(2):
            y = torch.randn(3, 4)
            torch.testing.assert_close(graph([y])[0], y * 2.0 + 1.0, rtol=0, atol=0)
    assert compiled_calls == [] and saved == []
    assert len(stats.worker_failures) == 1
    assert stats.worker_failures[0].startswith(f"graph 7/0: _WorkerError: {message[where]}")
    assert stats.worker_graphs_compiled == 0
    assert stats.as_dict()["worker_failures"] == stats.worker_failures


def test_a_graph_switches_to_the_workers_graph_once_it_is_back() -> None:
    """The control for the failure test: the same fakes, nothing failing."""
    stats, saved, post_compiled = Stats(), [], []
    future: concurrent.futures.Future = concurrent.futures.Future()

    class Compiled:
        def post_compile(self, *args: Any) -> None:
            post_compiled.append(args)

        def __call__(self, inputs: list) -> list:
            return [inputs[0] * 2.0 + 1.0 + 1000.0]  # tells which one ran

    graph = WorkerCompiledGraph(
        lambda inputs: [inputs[0] * 2.0 + 1.0], future, lambda _: Compiled(), stats, "graph 1/0"
    )
    graph._save = saved.append
    graph.post_compile(["example"], "constants", {"kw": 1})
    x = torch.zeros(2)
    assert graph([x])[0].tolist() == [1.0, 1.0]  # not back yet: uncompiled
    future.set_result("pickled output")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graph([x])[0].tolist() == [1001.0, 1001.0]
        assert graph([x])[0].tolist() == [1001.0, 1001.0]
    assert post_compiled == [(["example"], "constants", {"kw": 1})]
    assert len(saved) == 1 and isinstance(saved[0], Compiled)
    assert stats.worker_graphs_compiled == 1 and stats.worker_failures == []


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



def test_compile_workers_where_torch_cannot_is_refused_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows, or a torch before 2.8: no subprocess compile."""
    monkeypatch.setattr(compile_workers, "SUPPORTED", False)
    model, _ = build("kohya", "non-reentrant", **ONE_BLOCK_CLASS)
    pool = compile_workers._pool
    with pytest.raises(ValueError, match=r"CompileConfig\.compile_workers needs torch's out-of-process compile .*"
                       r"Windows; use compile_workers=0"):
        compile_accel.apply(model, CompileConfig(**CONFIG, compile_workers=WORKERS))
    _untouched(model)
    assert compile_workers._pool is pool
