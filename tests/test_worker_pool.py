"""The compile workers' pool: when it starts and stops (a stand-in pool), and what happens when
its process is killed or its pipe breaks (real pools: torch's subprocess pool, its pipe ends
closed or kept open, and the spawned pool Windows gets)."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, build
from worker_stand_ins import as_traced, loaded_by_hand, returned_future, sine, traced_graph

import compile_accel
from compile_accel import CompileConfig, compile_workers
from compile_accel.compile_workers import GraphState, WorkerGraph, WorkerPrecompiled
from compile_accel.stats import Stats

pytestmark = pytest.mark.skipif(
    not compile_workers.SUPPORTED,
    reason="compile_workers needs torch's graph pickler and AOTAutograd's cache (torch >= 2.8) and a platform other than Windows",
)


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
    for name, value in (("count", 0), ("pool", None), ("out", []), ("after_first_step", False)):
        monkeypatch.setattr(compile_workers.POOL, name, value)
    monkeypatch.setattr(compile_workers.pool, "IDLE_SECONDS_BEFORE_FIRST_STEP_DONE", 2.0)


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
    assert pool.jobs == [(compile_workers.worker.get_ready,)] * 3 and compile_workers.POOL.out == []
    first = compile_workers.POOL.submit("graph 0")
    first.set_result("compiled")
    assert compile_workers.running()  # nothing out, but idle for less than 2 s
    second = compile_workers.POOL.submit("graph 1")  # the next wave goes to the same pool
    assert len(_FakePool.made) == 1
    second.set_exception(RuntimeError("inductor raised"))  # a failed graph is back too
    back = time.monotonic()
    checks = [t for t in threading.enumerate() if getattr(t, "function", None) == compile_workers.POOL._stop_if_idle]
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
        acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5, compile_workers=100000))
    (pool,) = _FakePool.made
    assert pool.count == 3 and len(pool.jobs) == 3  # each worker's get-ready job
    acceleration.remove()


@pytest.mark.usefixtures("fake_pool")
def test_after_the_first_step_the_pool_stops_once_every_graph_is_back_and_starts_again_for_the_next() -> None:
    compile_workers.start(3)
    first = compile_workers.POOL.submit("graph 0")
    compile_workers.first_step_done()
    (pool,) = _FakePool.made
    assert compile_workers.running() and not pool.shut_down.is_set()  # a graph is out
    first.set_result("compiled")
    assert pool.shut_down.wait(10) and not compile_workers.running()
    # A graph after that (new input shapes) starts a new pool of the same size, which stops
    # as soon as that graph is back.
    second = compile_workers.POOL.submit("graph 1")
    assert len(_FakePool.made) == 2 and _FakePool.made[1].count == 3 and compile_workers.running()
    second.set_result("compiled")
    assert _FakePool.made[1].shut_down.wait(10) and not compile_workers.running()


@pytest.mark.usefixtures("fake_pool")
def test_a_kept_pool_stays_up_with_nothing_out_until_released() -> None:
    """auto keeps the pool between its partitions' return and its candidate's hand-over."""
    holder = type("Holder", (), {})()  # (as an AutoBudget: hashable, weakly referenced)
    compile_workers.start(2)
    compile_workers.keep_running(holder, True)
    partitions = compile_workers.POOL.submit("partitions")
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
    for name, value in (("count", 0), ("pool", None), ("out", []), ("after_first_step", False)):
        monkeypatch.setattr(compile_workers.POOL, name, value)
    if request.param == "pipe ends kept open":
        monkeypatch.setattr(compile_workers.pool, "_close_its_pipe_ends", lambda pool: None)
    monkeypatch.setattr(compile_workers.pool, "SPAWNED_POOL", request.param == "spawned pool")
    monkeypatch.setattr(compile_workers.POOL, "misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)
    compile_workers.start(1)
    if request.param == "spawned pool":
        process = next(iter(compile_workers.POOL.pool._executor._processes.values()))
    else:
        process = compile_workers.POOL.pool.process

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
    gm, inputs = traced_graph(sine, x)
    return compile_workers.compile_in_workers(gm, inputs, as_traced, loaded_by_hand(runs), stats, label, False)


pool_killing = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")


def test_windows_spawned_pool_compiles_graphs_in_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows' pool (spawned processes, nothing inherited but what the jobs carry): a graph
    handed over compiles in a worker and runs as traced once back; the pool stops when idle."""
    for name, value in (("count", 0), ("pool", None), ("out", []), ("after_first_step", False)):
        monkeypatch.setattr(compile_workers.POOL, name, value)
    monkeypatch.setattr(compile_workers.pool, "SPAWNED_POOL", True)
    monkeypatch.setattr(compile_workers.POOL, "misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)
    compile_workers.start(1)
    pool = compile_workers.POOL.pool
    assert isinstance(pool, compile_workers.pool._SpawnedPool)
    assert pool._executor._mp_context.get_start_method() == "spawn"
    stats, runs = Stats(), []
    graph = _handed_over("graph 20/0", runs, stats)
    assert isinstance(graph, WorkerGraph)
    assert _within_deadline(compile_workers.wait_and_load) == 1
    assert (stats.worker_graphs_compiled, stats.worker_failures) == (1, [])
    (record,) = stats.worker_compiles
    assert record["worker_s"] > 0 and graph.state is GraphState.LOADED
    x = torch.randn(3, 4)
    torch.testing.assert_close(graph(x)[0], sine(x))
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
    torch.testing.assert_close(graphs[1](x)[0], sine(x))


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
    assert graph.state is GraphState.LOADED and graph._compiled is not None and runs  # compiled here, run on zeros
    assert stats.worker_graphs_compiled == 0 and len(stats.worker_failures) == 1
    assert stats.worker_failures[0].startswith("graph 17/0: ")
    assert compile_workers.pending() == 0 and not compile_workers.running()


@pool_killing
def test_a_pool_killed_while_a_graph_loads_leaves_the_others_to_compile_here_with_one_warning(
    kill_pool: Callable,
) -> None:
    x = torch.randn(3, 4)
    gm, inputs = traced_graph(sine, x)

    def killed_as_it_loads(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        kill_pool()
        return loaded_by_hand([])(graph, example_inputs)

    back_stats, out_stats = Stats(), Stats()
    back = WorkerGraph(gm, compile_workers.packing.pack_graph(gm, inputs), killed_as_it_loads, returned_future(), back_stats,
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
    assert back.state is GraphState.LOADED and out.state is GraphState.LOADED and compile_workers.pending() == 0


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
    monkeypatch.setattr(compile_workers.POOL, "misses_in_a_row", compile_workers.MISSES_BEFORE_COLD)
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
    precompiled = WorkerPrecompiled(compile_workers.POOL.submit(time.sleep, HANG))  # still compiling, as it were

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


def test_jobs_still_out_at_exit_end_with_the_pool_as_asked_without_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run shorter than its graphs' compile (a bench mode of a few fast steps): at the
    interpreter's exit the pool stops with a job out, whose end is not taken for a pool that
    exited unasked (it was, with "killed, out of memory or crashed", at the end of every such run)."""
    for name, value in (("count", 0), ("pool", None), ("after_first_step", True)):
        monkeypatch.setattr(compile_workers.POOL, name, value)
    compile_workers.start(1)
    job = compile_workers.POOL.submit(time.sleep, 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _within_deadline(compile_workers.POOL._stop_at_exit)  # what atexit runs
        _within_deadline(lambda: concurrent.futures.wait([job]))
        time.sleep(0.5)  # (the idle check that the job's end arms runs on a timer's thread)
    assert _ours(caught) == [] and compile_workers.POOL.exited is None
    assert not compile_workers.running()
