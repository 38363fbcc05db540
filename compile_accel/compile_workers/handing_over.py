"""Whole compiles in worker processes, while the step runs the graphs uncompiled.

Cold, a first step is dynamo's trace, then per graph AOTAutograd's joint trace and min-cut
partition and inductor's code generation, all Python, one graph after another in the training
process while the step waits (sd-scripts' SDXL: 195-294 s on an H100).

With `CompileConfig.compile_workers = N`, the training process only traces: each graph dynamo
hands to the region's backend goes, with fake stand-ins for its inputs, to one of N worker
processes, which compile it as this process would (AOTAutograd and inductor, under the same
settings) into inductor's and AOTAutograd's caches. Until it is back, the graph runs as traced,
in eager PyTorch (under a non-reentrant checkpoint where a budget replaced the block's own
checkpointing, so that it saves no more than the block did). At its first call after the worker
is done, the graph is compiled here, from those caches (AOTAutograd cache hit: seconds, no
tracing), and runs compiled from then on. So the first step does not wait for AOTAutograd or
inductor, and the graphs of every block class compile at the same time. A trainer that wants
every step after the first compiled calls `wait_and_load` at the end of the first step instead:
that step then waits for the slowest graph.

Each worker gets ready as it starts (`_get_ready`: inductor imported, its kernel-compile pool
started), so that the pool is best started before the model's set-up (`start`; the sd-scripts
launcher does at the flags' parse); `stop` ends it where nothing will compile after all.

A graph already in the caches (a restart) is not handed over: it loads here as without
workers. A graph the caches cannot hold (AOTAutograd bypasses them: torch logs why), or whose
compile in the worker failed, compiles here at its first call after, with a warning.

The pool is torch's subprocess pool (one process of its own, whose children the workers are),
except on Windows, where that pool cannot pass its pipes: there the workers are spawned
processes of a ProcessPoolExecutor in this process (`_SpawnedPool`), which import the training
script's `__main__` module again, as Windows' DataLoader workers do, so its start must be under
`if __name__ == "__main__":` (sd-scripts' scripts are).

A pool whose process exits though nobody stopped it (killed: an out-of-memory kill, `pkill -f
compile_worker`; crashed) is found at the next hand-over, or within LIVENESS_CHECK_SECONDS by any
wait on the workers: warned about once, its jobs still out fail (their graphs compile here, as
after a worker's failure), and every later graph compiles here: no wait and no write to its pipe
outlives it.

GPU memory: a worker that compiled a graph holds a CUDA context of its own (~520 MiB each on an
H100, torch 2.11: its fake CUDA tensors and the kernels it loads), outside the training
process's memory. The pool stops once every graph handed to it is back and the first step is
done (`first_step_done`; before that, after 60 s without a graph) and nobody keeps it
(`keep_running`), which frees that memory; a later graph (new input shapes) starts a new pool.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import torch
import torch._functorch.config
import torch._inductor.config
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from .compile_profile import CompileClock, CompileTimes
from .dynamo_settings import HAS_EAGER_BACKWARD_KNOB
from .preload import preload_inductor
from .stats import Stats, warn

try:  # torch >= 2.8: the graph pickler (fake tensors included) and AOTAutograd's cache lookup
    from torch._functorch._aot_autograd.autograd_cache import (
        AOTAutogradCache,
        BypassAOTAutogradCache,
        check_cacheable,
        should_use_local_autograd_cache,
    )
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx._graph_pickler import Options as PicklerOptions
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
except ImportError:
    GraphPickler = None

logger = logging.getLogger("compile_accel")

# A worker writes AOTAutograd's cache entry only once it compiled the backward too: it needs
# AOTAutograd's knob for compiling the backward with the forward.
SUPPORTED = GraphPickler is not None and hasattr(AOTAutogradCache, "try_load") and HAS_EAGER_BACKWARD_KNOB
UNSUPPORTED_WHY = "needs torch's graph pickler and AOTAutograd's cache (torch >= 2.8)"
# Torch's subprocess pool hands its process pipes as inherited file descriptors, which Windows
# has not: there the pool is _SpawnedPool.
SPAWNED_POOL = sys.platform == "win32"

# Never taken on the pool's reader thread: it runs the futures' callbacks while holding the
# pool's own lock, which submit() takes.
_lock = threading.Lock()
_count = 0  # the pool's size, from the first apply() that asked for workers
_pool: Any = None  # up from start() or the first graph handed over until idle (_stop_if_idle)
_out: list[concurrent.futures.Future] = []  # the running pool's jobs not yet back
_unswitched: list[WorkerGraph] = []  # handed to the workers, not yet running compiled
_first_step_done = False  # set by first_step_done(), for the rest of the process
_workers_exited: str | None = None  # why the pool's process exited unasked: from then on graphs compile here
_first_step_start: float | None = None  # time.time() at the first step_started() (the model's first forward)
_switched = 0  # graphs handed to the workers that run compiled here now, for the rest of the process
_held: set[int] = set()  # id()s of the Stats whose graphs hold_switches keeps uncompiled
_kept: weakref.WeakSet = weakref.WeakSet()  # the holders keep_running keeps the pool up for
_last_back = 0.0  # time.monotonic() when a graph last came back
_idle_check: threading.Timer | None = None  # the pending _stop_if_idle (_stop_when_idle)
_idle_check_lock = threading.Lock()  # (taken on the pool's reader thread too, never with _lock held)
# Each worker's inductor compiles its kernels in a pool of its own, sized as if this many graphs
# compiled at once (a DiT's blocks make 2-3 graphs: sd-scripts' Flux, Lumina 2), so that a few
# graphs get the training process's share of the CPU; more (SDXL's dozens) share it, N workers
# oversubscribing it N / GRAPHS_AT_ONCE times over. With 2 kernel threads per worker (16 cores, 8
# workers), sd-scripts' Flux graphs waited 3.4-3.7 s for their kernels, with 8 0.3-0.5 s
# (benchmarks/results/h200_worker_warm_up/).
GRAPHS_AT_ONCE = 4
# A graph's look-up in the caches before its hand-over costs the step AOTAutograd's cache key
# (sd-scripts' SDXL, cold: 2.0-2.2 s of AOTAutograd in its first step, 0.85-0.94 s with the
# look-ups stopped after 4; benchmarks/results/h200_first_step_timeline/). After this many misses
# in a row (a cold cache) graphs go to the workers without it, where one the caches hold is a
# quick hit, until a graph is found in them again.
MISSES_BEFORE_COLD = 4
_misses_in_a_row = 0  # look-ups before hand-overs that missed since the last graph found in the caches
# Until the first step is done, an idle pool waits this long for more graphs: a first step hands
# its graphs over in waves (sd-scripts' SDXL: 40 s apart on an H100, as dynamo and AOTAutograd
# reach the next blocks, or the backward's), and a new pool takes seconds to start.
IDLE_SECONDS_BEFORE_FIRST_STEP_DONE = 60.0
# A wait on the workers checks this often that their pool's process is alive.
LIVENESS_CHECK_SECONDS = 1.0


class WorkersExited(RuntimeError):
    """The compile workers' pool process exited though nobody stopped it: graphs compile in the
    training process from then on."""


def start(count: int) -> None:
    """Start the pool of `count` compile workers now, so that it is up by the first step (a later
    count is ignored; more than the CPU cores is that many, with a warning). Each worker's inductor
    compiles its kernels with a share of the CPU cores (GRAPHS_AT_ONCE), so N workers do not start
    N full kernel-compile pools."""
    global _count
    with _lock, contextlib.suppress(WorkersExited):  # (warned about once: graphs compile here)
        _count = _count or _at_most_one_per_core(count)
        _running_pool()


def _at_most_one_per_core(count: int) -> int:
    # Each worker is a process that imports torch, and more than the cores compile no faster:
    # compile_workers=100000 had apply() starting processes until the test's time ran out.
    cores = os.cpu_count() or 1
    if count <= cores:
        return count
    warn(f"CompileConfig.compile_workers={count} is more than this machine's {cores} CPU cores: "
         f"using compile_workers={cores}")
    return cores


def _running_pool() -> Any:
    # Called with _lock held. WorkersExited once a pool's process exited unasked (_check_alive).
    global _pool
    _check_alive()
    if _workers_exited is not None:
        raise WorkersExited(_workers_exited)
    if _pool is None:
        from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool

        # (Every training process on this host has workers: DDP's share the cores too.)
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = str(max(1, (os.cpu_count() or 1) // (min(_count, GRAPHS_AT_ONCE) * processes)))
        # Read by each worker's inductor when it is imported there; the processes take the
        # environment as it is when they start: the pool's (and a _SpawnedPool's workers, at
        # the submits that start them) here.
        with mock.patch.dict(os.environ, {"TORCHINDUCTOR_COMPILE_THREADS": threads}):
            _pool = _SpawnedPool(_count) if SPAWNED_POOL else SubprocPool(_count, kind=SubprocKind.SPAWN)
            _close_its_pipe_ends(_pool)
            atexit.register(_pool.shutdown)
            logger.info("started %d compile workers", _count)
            # One per worker, as each starts (a worker may take two: the second costs nothing);
            # not in _out, which is the graphs' jobs.
            for _ in range(_count):
                _pool.submit(_get_ready).add_done_callback(_log_not_ready)
    return _pool


class _SpawnedPool:
    """The compile workers as spawned processes of a ProcessPoolExecutor in this process (Windows:
    see the module docstring), with what this module uses of torch's SubprocPool: submit,
    shutdown, running, and `process`, the workers watched as that pool's one process."""

    def __init__(self, count: int) -> None:
        self._executor = concurrent.futures.ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("spawn"))
        self.process = _SpawnedWorkers(self._executor)

    @property
    def running(self) -> bool:
        return not self._executor._broken  # (set once a worker exited unasked)

    def submit(self, function: Callable, *args: Any) -> concurrent.futures.Future:
        future = self._executor.submit(function, *args)
        self.process.watch(self._executor._processes.values())  # (a submit may start a worker)
        return future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class _SpawnedWorkers:
    """A _SpawnedPool's workers as one process (Popen's poll, wait, returncode and args): gone
    once any worker exited unasked, with the exit code of the first seen gone (the executor ends
    the others once one exits; -1 until one is known: another thread may be reaping it)."""

    args: tuple = ()  # (no pipe ends passed on: _close_its_pipe_ends has none to close)

    def __init__(self, executor: concurrent.futures.ProcessPoolExecutor) -> None:
        self._executor = executor
        self._workers: dict[int, multiprocessing.process.BaseProcess] = {}  # by pid, as started
        self._exit_code: int | None = None

    def watch(self, workers: Iterable[multiprocessing.process.BaseProcess]) -> None:
        self._workers.update((worker.pid, worker) for worker in list(workers))

    def poll(self) -> int | None:
        if self._exit_code is None and self._executor._broken:
            # The one the executor did not end: exit codes other than its terminate()'s first.
            codes = [worker.exitcode for worker in self._workers.values() if worker.exitcode is not None]
            codes.sort(key=lambda code: code == -signal.SIGTERM)
            if not codes:
                return -1
            self._exit_code = codes[0]
        return self._exit_code

    returncode = property(poll)

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() == -1 and self._exit_code is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.poll()


def _close_its_pipe_ends(pool: Any) -> None:
    """Close this process's copies of the pipe ends torch's pool passed to its process, which torch
    keeps open: then a process that exits closes the pipes, so that the pool's reader sees their
    end (and fails the jobs out) and a write to them raises, instead of waiting for ever on a
    process that is gone. (Each is checked to be the other end of one of the pool's own pipes.)"""
    for argument in pool.process.args:
        option, _, fd = str(argument).partition("=")
        if option in ("--read-fd", "--write-fd"):
            with contextlib.suppress(OSError):  # (closed already: a torch that closes them itself)
                if os.fstat(int(fd)).st_ino in _pipe_inodes(pool):
                    os.close(int(fd))


def _pipe_inodes(pool: Any) -> set[int]:
    return {os.fstat(pipe.fileno()).st_ino for pipe in (pool.read_pipe, pool.write_pipe)}


def _check_alive() -> None:
    """Give the pool up if its process exited though nobody stopped it (stopping sets _pool to
    None first). Called with _lock held."""
    pool = _pool
    if pool is not None and not (pool.running and pool.process.poll() is None):
        _give_up(pool)


def _give_up(pool: Any) -> None:
    """The pool's process exited, or its pipe broke: its jobs still out fail, and graphs compile
    here from now on, with one warning. Called with _lock held."""
    global _pool, _workers_exited
    # (Once torch's reader found the pipe closed, the process is exiting: its exit code comes.)
    with contextlib.suppress(subprocess.TimeoutExpired):
        pool.process.wait(LIVENESS_CHECK_SECONDS)
    code = pool.process.returncode
    _pool = None
    _workers_exited = "its pipe broke" if code is None else f"exit code {code}"
    for future in _out:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # (done meanwhile)
            future.set_exception(WorkersExited(_workers_exited))
    # Not shut down: its process is gone, and a write to its pipe might never return.
    atexit.unregister(pool.shutdown)
    warn(f"the compile workers' pool process exited ({_workers_exited}: killed, out of memory or crashed): the "
         "graphs it had and every later one compile in this process")


def _lost_with_the_pool(error: BaseException) -> bool:
    """Whether a job failed because its pool's process exited (warned about once), not in its worker."""
    from torch._inductor.compile_worker.subproc_pool import SubprocException

    with _lock:
        _check_alive()
        if _workers_exited is None:
            return False
    # A worker's own error: SubprocPool wraps it; a _SpawnedPool passes it on as it was raised.
    if SPAWNED_POOL:
        return isinstance(error, (BrokenProcessPool, WorkersExited))
    return not isinstance(error, SubprocException)


def _compiles_here(message: str, pool_exited: bool) -> None:
    """Say that a graph compiles in this process: a warning, or a log line where that is because the
    pool's process exited (warned about once, _give_up)."""
    if pool_exited:
        logger.info(message)
    else:
        warn(message)


def _as_completed(futures: list[concurrent.futures.Future]) -> Iterator[concurrent.futures.Future]:
    """Each of `futures` as it is done (concurrent.futures.as_completed), the pool's process checked
    every LIVENESS_CHECK_SECONDS: once it exited, its jobs fail (_check_alive) and the wait ends."""
    waiting = set(futures)
    while waiting:
        done, waiting = concurrent.futures.wait(
            waiting, LIVENESS_CHECK_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED
        )
        yield from done
        if not done:
            with _lock:
                _check_alive()


def _wait_all(futures: list[concurrent.futures.Future]) -> None:
    """Until every one of `futures` is done, or failed with the pool's process (_as_completed);
    then the pool's process is checked once more, so that jobs torch failed when it saw the
    process go are warned about as its end."""
    for _ in _as_completed(futures):
        pass
    with _lock:
        _check_alive()


def _log_not_ready(future: concurrent.futures.Future) -> None:
    # A graph's compile in that worker gets ready again first, and fails there with the error.
    if future.exception() is not None:
        logger.debug("a compile worker could not get ready: %r", future.exception())


def _submit(*args: Any) -> concurrent.futures.Future:
    """Hand one graph's compile to the pool (started again if it was shut down); WorkersExited
    once its process exited unasked."""
    with _lock:
        pool = _running_pool()
        try:
            future = pool.submit(*args)
        except (OSError, BrokenProcessPool) as error:  # its process exited as this was written
            _give_up(pool)
            raise WorkersExited(_workers_exited) from error
        _out.append(future)
    future.add_done_callback(_back)
    return future


def _back(future: concurrent.futures.Future) -> None:
    # On the pool's reader thread, so no _lock here: the idle check runs on a timer's thread.
    global _last_back, _misses_in_a_row
    _last_back = time.monotonic()
    report = future.result() if future.exception() is None else None
    if isinstance(report, WorkerCompile) and report.aot_autograd.get("autograd_cache_hit"):
        _misses_in_a_row = 0  # the caches are warm after all
    _stop_when_idle()


def _stop_when_idle() -> None:
    """Check whether the pool is idle once the last graph has been back for the idle time, in a
    timer that replaces the pending one: one waiting thread, not one per graph back (SDXL's 36
    graphs and precompiles left 68)."""
    global _idle_check
    idle_seconds = 0.0 if _first_step_done else IDLE_SECONDS_BEFORE_FIRST_STEP_DONE
    with _idle_check_lock:
        if _idle_check is not None:
            _idle_check.cancel()
        delay = max(0.0, _last_back + idle_seconds - time.monotonic())
        _idle_check = threading.Timer(delay, _stop_if_idle, args=(_pool, idle_seconds))
        _idle_check.name = "compile_accel-workers-idle-check"
        _idle_check.daemon = True
        _idle_check.start()


def first_step_done() -> None:
    """Say that the training's first step is done (the launcher and the bench do): the pool stops
    now if no graph is out (and nobody keeps it), else as soon as the last one is back, freeing
    the GPU memory its workers hold. A graph after that (new input shapes) starts a new pool."""
    global _first_step_done
    _first_step_done = True
    _stop_if_idle(_pool, 0.0)


def keep_running(holder: object, kept: bool) -> None:
    """While kept for some holder (held weakly), the pool does not stop when nothing is out in it.
    Released, it stops once idle as usual. (auto keeps it between its partitions' return and the
    next step's hand-over of a candidate's graphs: a new pool takes seconds to start.)"""
    with _lock:
        released = not kept and holder in _kept
        (_kept.add if kept else _kept.discard)(holder)
    if released:
        _stop_when_idle()


def _stop_if_idle(pool: Any, idle_seconds: float) -> None:
    """Shut `pool` down if it is still the pool, nobody keeps it, no graph is out in it, and none
    came back in the last `idle_seconds` (a later graph back arms the check again)."""
    global _pool
    with _lock:
        _check_alive()
        _out[:] = [future for future in _out if not future.done()]
        # (A timer may fire a hair early: 10 ms of slack.)
        if (
            pool is None
            or pool is not _pool
            or _kept
            or _out
            or time.monotonic() - _last_back < idle_seconds - 0.01
        ):
            return
        _pool = None
    _shut_down(pool)
    logger.info("no graph is out in the compile workers: workers stopped, their GPU memory freed")


def stop() -> None:
    """Stop the pool now, if one runs (a run that compiles nothing after all: the sd-scripts
    launcher falling back to eager after it started the workers)."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        _shut_down(pool)


def _shut_down(pool: Any) -> None:
    atexit.unregister(pool.shutdown)
    # In a thread of its own: shutdown() joins the pool's reader thread.
    threading.Thread(target=pool.shutdown, name="compile_accel-workers-shutdown", daemon=True).start()


def running() -> bool:
    """Whether the worker pool is up: from `start` or the first graph handed over until no graph
    is out, nobody keeps it (`keep_running`) and the first step is done (before that, after 60 s
    without one)."""
    with _lock:
        _check_alive()
        return _pool is not None


def pending() -> int:
    """Graphs (of every model in this process) handed to the workers and not yet running
    compiled: still compiling, or back and switched to at their next call."""
    with _lock:
        return len(_still_unswitched())


def _still_unswitched() -> list[WorkerGraph]:
    # Called with _lock held: drops the graphs that switched (step_started runs every step).
    _unswitched[:] = [graph for graph in _unswitched if graph.future is not None]
    return _unswitched


def compiling(stats: Stats) -> int:
    """Graphs counting into `stats` (one region function's compiles: one model, one budget)
    handed to the workers and not back from them yet."""
    with _lock:
        return sum(graph._stats is stats and not graph.future.done() for graph in _still_unswitched())


def hold_switches(stats: Stats, held: bool) -> None:
    """While held, the graphs counting into `stats` that are back from the workers keep running
    uncompiled until released: auto's calibration runs a candidate budget's graphs compiled
    first in a step of its own, which checks that their peak fits, before a training step may.
    The caller keeps `stats` alive while it holds them."""
    with _lock:
        (_held.add if held else _held.discard)(id(stats))


def graphs_switched() -> int:
    """Graphs (of every model in this process) handed to the workers that run compiled here now:
    loaded from the caches the workers filled, or compiled here after a worker's failure."""
    with _lock:
        return _switched


def wait() -> int:
    """Wait until the workers are done with every job handed to them (graphs, auto's partitions,
    precompiles); returns `pending()` as it was before (not 0: those graphs switch to compiled in
    the next step)."""
    waiting = pending()
    with _lock:
        futures = [graph.future for graph in _unswitched if graph.future is not None] + _out
    _wait_all(futures)
    return waiting


def wait_refusal(workers: int | None, auto: str | None, wait_flag: str, workers_flag: str) -> str | None:
    """Why the first step cannot wait for the compile workers (`wait_and_load`) as `wait_flag`
    asks, or None: the rule the bench and the launcher share. `workers`: how many were asked for;
    `auto`: the name of the run's activation_memory_budget="auto", where it asks for it."""
    if not workers:
        return f"{wait_flag} waits for the compile workers: give {workers_flag} N too"
    if auto:
        return (
            f"{wait_flag}: {auto} measures its candidates in the steps after the first, each once its graphs are "
            "back from the workers: the steps until it has chosen run uncompiled whether the first step waits or not"
        )
    return None


def wait_and_load() -> int:
    """Load each graph here as its worker is done with it, rather than at its next call, run it
    once (`WorkerGraph.run_once_on_stand_ins`), then wait for the workers' other jobs (`wait`);
    return how many graphs. A trainer that wants every step after the first to run compiled, as
    fast as the ones after it, calls it at the end of its first step (the sd-scripts launcher's
    `--compile_workers_wait`, the bench's `--compile-workers-wait`): that step then lasts until
    the slowest graph is back and loaded, the graphs back first loading while the others still
    compile. Between steps only: a graph that a trainer's checkpoint recomputes must not change
    within a step. Graphs that auto holds (`hold_switches`) stay as they are."""
    with _lock:  # (no graph is handed over between steps: this is every one to load)
        graphs = {graph.future: graph for graph in _still_unswitched() if id(graph._stats) not in _held}
    if graphs:
        logger.info(
            "waiting for the compile workers: %d graphs to load here, %d of them back%s",
            len(graphs), sum(future.done() for future in graphs), _since_first_step(time.time()),
        )
    start = time.perf_counter()
    for future in _as_completed(list(graphs)):
        graphs[future]._switch()
        graphs[future].run_once_on_stand_ins()
    wait()
    if graphs:
        logger.info("%d graphs loaded and run once in %.1f s%s", len(graphs), time.perf_counter() - start,
                    _since_first_step(time.time()))
    return len(graphs)


def step_started() -> None:
    """Say that a training step starts (apply() calls it from the model's forward pre-hook): a
    graph back from its worker by now may switch to compiled in this step. A graph that a
    trainer's checkpoint recomputes in the backward switches only here, between steps: a
    checkpoint must see its forward save the same tensors twice."""
    global _first_step_start
    with _lock:
        if _first_step_start is None:
            _first_step_start = time.time()
        for graph in _still_unswitched():
            if graph.future.done():
                graph.back_at_step_start = True


class _NotCached(BaseException):
    """AOTAutograd's cache has no entry for the graph (raised instead of compiling it; not an
    Exception, which torch's cache lookup would take for a failure and compile anyway)."""


@contextlib.contextmanager
def _only_from_cache() -> Iterator[None]:
    """Inside: a compile whose graph AOTAutograd's cache does not hold raises _NotCached."""
    try_load = AOTAutogradCache.try_load

    def load_or_raise(*args: Any, **kwargs: Any) -> Any:
        loaded = try_load(*args, **kwargs)
        # (torch 2.13 returns the compiled function with AOTAutograd's config, earlier ones alone.)
        if (loaded[0] if isinstance(loaded, tuple) else loaded) is None:
            raise _NotCached
        return loaded

    with mock.patch.object(AOTAutogradCache, "try_load", staticmethod(load_or_raise)):
        yield


def _unseen_by_checkpoints() -> contextlib.AbstractContextManager:
    """Around our own work with fake tensors inside a step (packing a graph, loading it): what
    autograd saves there must not reach a checkpoint's hooks, which count the tensors its
    forward saves against what its recomputation saves."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _aot_cache_hits() -> int:
    return torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]


# The state outside the graph that AOTAutograd traces it under and keys its cache on: a worker
# compiles under the training process's.
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _precision_flags() -> list[tuple[Any, str]]:
    # torch >= 2.9 keys on fp32_precision (allow_tf32 sets it too); earlier ones on allow_tf32.
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return [
        (matmul, "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"),
        (matmul, "allow_fp16_reduced_precision_reduction"),
        (matmul, "allow_bf16_reduced_precision_reduction"),
        (cudnn, "fp32_precision" if hasattr(cudnn, "fp32_precision") else "allow_tf32"),
    ]


def _runtime_state() -> dict[str, Any]:
    return {
        "grad": torch.is_grad_enabled(),
        "autocast": {d: torch.get_autocast_dtype(d) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)},
        "deterministic": (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "default_dtype": torch.get_default_dtype(),
        "precision": [getattr(module, name) for module, name in _precision_flags()],
    }


def _set_flags(state: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(state["deterministic"][0], warn_only=state["deterministic"][1])
    torch.utils.deterministic.fill_uninitialized_memory = state["fill_uninitialized_memory"]
    torch.set_default_dtype(state["default_dtype"])
    for (module, name), value in zip(_precision_flags(), state["precision"], strict=True):
        if getattr(module, name) != value:  # (setting one flag can change another's reading)
            setattr(module, name, value)


@contextlib.contextmanager
def _in_runtime_state(state: dict[str, Any]) -> Iterator[None]:
    """The flags set for good (in a worker each graph sets its own; here the caller puts them
    back), grad mode and autocast around the compile."""
    _set_flags(state)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(state["grad"]))
        for device in _AUTOCAST_DEVICES:
            if device in state["autocast"]:
                stack.enter_context(torch.autocast(device, dtype=state["autocast"][device]))
            elif torch.is_autocast_enabled(device):  # (in the training process: run_here)
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


# Node metadata a worker needs: the stack traces (in the generated code's comments) and which
# inputs dynamo found static (parameters: the partitioner treats them as free to keep). The rest
# is dropped (fake values, which the worker propagates anew, and module classes it may not import).
_KEPT_NODE_META = ("stack_trace",)
_STATIC_INPUT_KEY = "_dynamo_static_input_type"


def _kept_meta(meta: dict[str, Any]) -> dict[str, Any]:
    kept = {key: meta[key] for key in _KEPT_NODE_META if key in meta}
    tensor_dict = meta.get("tensor_dict") or {}
    if _STATIC_INPUT_KEY in tensor_dict:
        kept["tensor_dict"] = {_STATIC_INPUT_KEY: tensor_dict[_STATIC_INPUT_KEY]}
    return kept


def _stand_in(fake_mode: FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake of `tensor`, static shapes, without its `.grad`: a parameter's gradient (accumulated
    over micro-batches, or not zeroed yet after a step) is no input of the graph, and its fake does
    not pickle."""
    fake = fake_mode.from_tensor(tensor, static_shapes=True)
    fake.grad = None
    return fake


def _pack_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> bytes | str:
    """The graph, fake stand-ins for its inputs and what AOTAutograd reads of dynamo's graph
    module, as bytes for a worker; or why it cannot go (a string)."""
    if any(not isinstance(x, torch.Tensor) for x in example_inputs):
        return "it has non-tensor inputs (symbolic shapes)"
    if any(type(x) not in (torch.Tensor, torch.nn.Parameter) for x in example_inputs):
        return "it has tensor-subclass inputs"
    try:  # what a worker compiles comes back through AOTAutograd's cache only
        check_cacheable(gm)
    except BypassAOTAutogradCache as error:  # (torch <= 2.11: a checkpoint traced in the graph)
        return f"AOTAutograd would not cache it: {str(error).splitlines()[0]}"
    fake_mode = FakeTensorMode()  # without a shape env: static shapes, as dynamo gives AOTAutograd
    fakes = [_stand_in(fake_mode, x) for x in example_inputs]
    placeholders = gm.graph.find_nodes(op="placeholder")
    sources = [getattr(node, "_dynamo_source", None) for node in placeholders]
    plain = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()).__dict__
    # AOTAutograd's cache key pickles the graph module's attributes in their order.
    attributes = {name: value for name, value in gm.__dict__.items() if name not in plain or name == "meta"}
    order = list(gm.__dict__)
    # Nested graphs too: the bodies of higher-order ops (a checkpoint traced in the region).
    metas = {node: node.meta for graph in gm.modules() if isinstance(graph, torch.fx.GraphModule) for node in graph.graph.nodes}
    try:
        for node in metas:
            node.meta = _kept_meta(node.meta)
        return GraphPickler.dumps((gm, fakes, sources, attributes, order), PicklerOptions(ops_filter=None))
    except Exception as error:  # an op or value torch's pickler cannot take
        return f"{type(error).__name__}: {error}"
    finally:
        for node, meta in metas.items():
            node.meta = meta


def _unpack_graph(packed: bytes) -> tuple[torch.fx.GraphModule, list[Any]]:
    """_pack_graph's graph module, as dynamo made it for AOTAutograd's cache key, and fake inputs."""
    inputs_mode = FakeTensorMode()
    loaded, fakes, sources, attributes, order = GraphPickler.loads(packed, inputs_mode)
    root = torch.nn.Module()  # holding the nested graphs the graph's get_attr nodes name
    for name, child in loaded.named_children():
        root.add_module(name, child)
    gm = torch.fx.GraphModule(root, loaded.graph)  # the class dynamo's has
    merged = {**gm.__dict__, **attributes}
    gm.__dict__.clear()
    gm.__dict__.update({name: merged.pop(name) for name in order if name in merged})
    gm.__dict__.update(merged)
    for node, source in zip(gm.graph.find_nodes(op="placeholder"), sources, strict=True):
        node._dynamo_source = source
    FakeTensorProp(gm, inputs_mode).propagate_dont_convert_inputs(*fakes)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta.pop("val")  # where dynamo keeps it
    return gm, fakes


def _compile_packed(packed: bytes, compiler: Callable) -> Callable:
    """Compile the packed graph, the same way in a worker and here: both make the same
    AOTAutograd cache key, so that here it loads what the worker compiled."""
    gm, fakes = _unpack_graph(packed)
    # Caches need a shape env in the tracing context; the inputs have none, so their shapes
    # stay static (as dynamo's real inputs do: AOTAutograd's key records it).
    context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
    with torch._guards.tracing(context):
        return compiler(gm, fakes)


def _job(packed: bytes, compiler: Callable, state: dict[str, Any] | None = None) -> bytes:
    """A graph's compile for a worker: the graph, the compiler and the settings in force now,
    under `state` (grad mode, autocast, ...; default: as they are now)."""
    return pickle.dumps(
        (
            packed,
            compiler,
            torch._inductor.config.save_config_portable(),
            torch._functorch.config.save_config_portable(),
            _runtime_state() if state is None else state,
        )
    )


def _get_ready() -> None:
    """In a worker, before its first graph: import inductor's compiler and start inductor's own
    kernel-compile pool, without waiting for it. Cold, a worker's first graph did both inside its
    compile: the imports took seconds, and until its kernel pool was up inductor compiled the
    kernels one after another in the worker (benchmarks/results/h200_worker_warm_up/)."""
    preload_inductor()
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.use_process_pool()  # starts the pool; True once it is up


def _compile_job(job: bytes, env: dict[str, str]) -> Callable:
    """In a worker: compile a _job's graph as the training process would."""
    os.environ.update(env)  # the training process's cache directories
    _get_ready()  # (where the warm-up job did not reach this worker first)
    packed, compiler, inductor_settings, functorch_settings, state = pickle.loads(job)
    torch._inductor.config.load_config(inductor_settings)
    torch._functorch.config.load_config(functorch_settings)
    with _in_runtime_state(state):
        return _compile_packed(packed, compiler)


@dataclass
class WorkerCompile:
    """What a worker reports of one graph's compile."""

    aot_autograd: dict[str, int]  # AOTAutograd's cache counters of it (a bypass: the caches cannot hold it)
    started: float  # time.time() when the worker took it up
    seconds: float  # from then until the caches held it
    times: CompileTimes  # where those seconds went, by torch's compile timers in the worker


def _compile_in_worker(job: bytes, env: dict[str, str]) -> WorkerCompile:
    """In a worker: compile one graph into the caches the training process reads."""
    started, clock = time.time(), CompileClock()
    counted = torch._dynamo.utils.counters["aot_autograd"].copy()
    _compile_job(job, env)
    counters = dict(torch._dynamo.utils.counters["aot_autograd"] - counted)
    return WorkerCompile(counters, started, time.time() - started, clock.since())


def _precompile_in_worker(job: bytes, env: dict[str, str]) -> bytes:
    """In a worker: compile one graph as torch's aot_compile does (the job's settings bundle the
    kernels into AOTAutograd's entry) and return it serialized (compile_accel.precompile)."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    return Bundled.serialize_compile_artifacts(Bundled(_compile_job(job, env)))


class WorkerPrecompiled:
    """A graph that torch's aot_compile handed to the compile workers (`precompile_in_workers`):
    it serializes as what the worker returns, waiting for it, and loads as torch's own bundled
    graphs do. It does not run here."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    @classmethod
    def serialize_compile_artifacts(cls, fn: WorkerPrecompiled) -> bytes:
        _wait_all([fn.future])  # (a pool whose process is gone fails it: the graph is left out)
        return fn.future.result()

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Any:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

        return BundledAOTAutogradSerializableCallable.deserialize_compile_artifacts(data)

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError("a graph precompiled in a compile worker runs once saved and loaded")


def precompile_in_workers(gm: torch.fx.GraphModule, example_inputs: list[Any], compiler: Callable) -> WorkerPrecompiled:
    """What the precompile backend returns for `gm` (inside torch's aot_compile, whose settings
    the worker compiles under): the graph handed to a worker. RuntimeError for a graph that
    cannot go (symbolic shapes, tensor subclasses, an op the pickler refuses)."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    SerializableCallable.register(WorkerPrecompiled)  # what aot_compile takes
    with _unseen_by_checkpoints():
        packed = _pack_graph(gm, example_inputs)
    if isinstance(packed, str):
        raise RuntimeError(f"cannot hand the graph to a compile worker: {packed}")
    return WorkerPrecompiled(_submit(_precompile_in_worker, _job(packed, compiler), _cache_env()))


_ATTENTION_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _uncompiled(gm: torch.fx.GraphModule, *inputs: Any) -> Any:
    # Without cuDNN's attention: its eager backward fails on gradients laid out as a compiled
    # step's neighbours give them (sd-scripts' Flux fp8 on an H200, torch 2.11: an illegal memory
    # access); inductor's lowering lays them out for it, eager does not.
    with sdpa_kernel(_ATTENTION_WITHOUT_CUDNN):
        return gm(*inputs)


def run_uncompiled(gm: torch.fx.GraphModule, inputs: tuple | list, checkpointed: bool) -> Any:
    """`gm` run as dynamo traced it; `checkpointed`: under a non-reentrant checkpoint, which keeps
    only its inputs for the backward and runs it again there."""
    if checkpointed:
        return checkpoint(_uncompiled, gm, *inputs, use_reentrant=False)
    return _uncompiled(gm, *inputs)


class WorkerGraph:
    """A graph handed to a worker: runs uncompiled until the worker is done, then is compiled
    here from the caches the worker filled (compile_here, at its first call after) and runs
    compiled. A worker's error, or a graph the caches did not get, is warned about once and
    compiled here.

    checkpointed: the graph runs under a checkpoint of its own until compiled (a budget replaced
    the block's checkpointing), and may switch at any call. Otherwise a trainer's checkpoint may
    run it again in the backward, so it switches only at a call after `step_started`. state:
    grad mode, autocast, ... as the graph was handed over (`_runtime_state`), which its compile
    here is under. cuda_graphs: compiled to replay as a CUDA graph."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        packed: bytes,
        compile_here: Callable[[torch.fx.GraphModule, list[Any]], Callable],
        future: concurrent.futures.Future,
        stats: Stats,
        label: str,
        checkpointed: bool,
        state: dict[str, Any] | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        self._gm = gm
        self._cuda_graphs = cuda_graphs
        self._state = _runtime_state() if state is None else state  # (as handed over; default: now)
        self._packed = packed
        self._compile_here = compile_here
        self.future: concurrent.futures.Future | None = future
        self._stats = stats
        self._label = label
        self._checkpointed = checkpointed
        self.back_at_step_start = False
        self._compiled: Callable | None = None
        self._switch_lock = threading.Lock()
        self._record: dict[str, Any] | None = None  # its entry in stats.worker_compiles, once loaded
        self._handed_over = time.time()  # (a hair after the submit; WorkerCompile.started is on this clock)
        with _lock:
            _unswitched.append(self)

    def __call__(self, *inputs: Any) -> Any:
        if (
            self.future is not None
            and id(self._stats) not in _held
            and (self.back_at_step_start or (self._checkpointed and self.future.done()))
        ):
            self._switch()
        if self._compiled is not None:
            return self._compiled(*inputs)
        return run_uncompiled(self._gm, inputs, self._checkpointed)

    def _switch(self) -> None:
        global _switched
        with self._switch_lock:
            future, self.future = self.future, None
            if future is None:
                return
            problem, report, lost = None, None, False
            try:
                report = future.result()
                if report.aot_autograd.get("autograd_cache_bypass"):
                    problem = "AOTAutograd's cache cannot hold it (the worker's torch logged why)"
            except Exception as error:  # the worker's compile error, or its pool's process gone
                problem = f"{type(error).__name__}: {error}"
                lost = _lost_with_the_pool(error)
            hits = _aot_cache_hits()
            start = time.perf_counter()
            try:
                # Under the state the worker compiled it in: wait_and_load runs outside the step.
                self._compiled = _compile_packed_here(self._packed, self._compile_here, self._state)
            except Exception as error:
                self._stats.worker_failures.append(f"{self._label}: {problem or ''} {type(error).__name__}: {error}".strip())
                warn(f"{self._label} did not compile in a worker ({problem}) nor here, and keeps running uncompiled: {error}")
                return
            with _lock:
                _switched += 1
            seconds = time.perf_counter() - start
            if problem is None and _aot_cache_hits() == hits:
                problem = "what it compiled was not found in AOTAutograd's cache"
            if problem is not None:
                self._stats.worker_failures.append(f"{self._label}: {problem}")
                _compiles_here(f"{self._label} did not compile in a worker ({problem}); compiled in this process "
                               f"({seconds:.1f} s)", lost)
                return
            self._stats.worker_graphs_compiled += 1
            queued = max(0.0, report.started - self._handed_over)
            self._record = {
                "graph": self._label, "queued_s": round(queued, 3), "worker_s": round(report.seconds, 3),
                "load_s": round(seconds, 3), **report.times.as_dict(),
                **_timeline(handed_over=self._handed_over, back=report.started + report.seconds, loaded=time.time()),
            }
            self._stats.worker_compiles.append(self._record)
            logger.info(
                "%s: compiled in a worker in %.1f s after %.1f s in its queue (%s), loaded from the caches in %.1f s "
                "(%d of %d graphs handed to the workers)",
                self._label,
                report.seconds,
                queued,
                report.times.summary(),
                seconds,
                self._stats.worker_graphs_compiled,
                self._stats.worker_graphs_started,
            )


    def run_once_on_stand_ins(self) -> None:
        """Run the compiled graph once, forward and backward, on zeros shaped as its inputs, under
        the state it was handed over in, the random-number state put back: its kernels' first run
        (autotuning, loading) is paid here rather than in the next step, as compiling in this
        process pays it in the first step (benchmarks/results/h200_worker_warm_up/: 0.5-1.4 s).
        A graph handed over with grad runs once more inside a backward (`_in_a_backward`), where a
        checkpoint recomputes it. Each run takes one block's weights (copies) and activations of
        memory, freed after. Not for a graph replayed as a CUDA graph (zeros at other addresses
        than the weights it records), one with integer inputs (indices: zeros may index out of
        bounds, which a kernel asserts), nor one not compiled here. A failure is warned about: the
        graph runs as it is."""
        if self._compiled is None or self._cuda_graphs:
            return
        fakes = [node.meta.get("example_value") for node in self._gm.graph.find_nodes(op="placeholder")]
        if not all(isinstance(fake, torch.Tensor) for fake in fakes):
            return  # (non-tensor inputs: graphs with them are not handed over)
        if any(not (fake.is_floating_point() or fake.dtype == torch.bool) for fake in fakes):
            return
        devices = sorted({fake.device for fake in fakes if fake.device.type == "cuda"}, key=str)
        here = _runtime_state()
        start = time.perf_counter()

        def forward_and_backward() -> None:
            with _in_runtime_state(self._state):
                stand_ins = [_zeros_like(fake) for fake in fakes]
                outputs = [out for out in pytree.tree_leaves(self._compiled(*stand_ins)) if _wants_grad(out)]
                if outputs:
                    torch.autograd.backward(outputs, [torch.ones_like(out) for out in outputs])

        try:
            with torch.random.fork_rng(devices=devices), _unseen_by_checkpoints():
                forward_and_backward()
                if self._state["grad"]:
                    _in_a_backward(forward_and_backward, devices[0] if devices else torch.device("cpu"))
                for device in devices:  # a kernel's error shows here, not in the next step
                    torch.cuda.synchronize(device)
            if self._record is not None:
                self._record["first_run_s"] = round(time.perf_counter() - start, 3)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError):
                torch.cuda.empty_cache()  # what the run took is the training's again
            warn(f"{self._label}: its first run on stand-in inputs failed ({type(error).__name__}: {error}); "
                 "it runs compiled from its next call, which pays its kernels' first run")
        finally:
            _set_flags(here)


class _CallInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, call: Callable[[], None]) -> torch.Tensor:
        ctx.call = call
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.call()
        return grad, None


def _in_a_backward(call: Callable[[], None], device: torch.device) -> None:
    """Call `call` inside a backward, on the thread the autograd engine runs `device`'s backward
    work on: where a checkpoint recomputes a graph's forward. Some of what a first run sets up is
    kept per thread, as ATen keeps cuDNN's attention plans: without this run, sd-scripts' SDXL
    (reentrant checkpoints) had its step after the wait 0.19-0.27 s over the later ones, in its
    attention calls (benchmarks/results/h200_step_after_wait_threads/)."""
    torch.autograd.backward(_CallInBackward.apply(torch.zeros((), device=device, requires_grad=True), call))


def _since_first_step(at: float) -> str:
    return "" if _first_step_start is None else f" ({at - _first_step_start:.1f} s into the first step)"


def _timeline(**times: float) -> dict[str, float]:
    """Each time.time() as seconds since the first step started, named `<name>_at_s` (none before
    a first step: a graph handed over outside the training's steps)."""
    if _first_step_start is None:
        return {}
    return {f"{name}_at_s": round(at - _first_step_start, 3) for name, at in times.items()}


def _zeros_like(fake: torch.Tensor) -> torch.Tensor:
    """A real tensor of `fake`'s shape, strides, dtype and device, zeros, a leaf needing grad as it did."""
    zeros = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype, device=fake.device).zero_()
    return zeros.requires_grad_(fake.requires_grad)


def _wants_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _cache_env() -> dict[str, str]:
    # The worker writes where this process reads.
    return {name: os.environ[name] for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if name in os.environ}


@dataclass
class TracedGraph:
    """A graph dynamo traced, packed for a worker at its trace (`pack_traced`): auto's traced
    step (compile_accel.saved_bytes) runs it uncompiled while a worker partitions it at every
    candidate (`run_in_worker`), and the budget auto then picks compiles it in a worker
    (`hand_over`) without dynamo tracing it again."""

    gm: torch.fx.GraphModule
    packed: bytes
    state: dict[str, Any]  # grad mode, autocast, ... at the trace
    label: str


def pack_traced(gm: torch.fx.GraphModule, example_inputs: list[Any], label: str) -> TracedGraph | None:
    """`gm` packed as it is now, before anything compiles it (None: it cannot go to a worker)."""
    if not should_use_local_autograd_cache():
        return None
    with _unseen_by_checkpoints():
        packed = _pack_graph(gm, example_inputs)
    return None if isinstance(packed, str) else TracedGraph(gm, packed, _runtime_state(), label)


def _submitted(job: Callable, graph: TracedGraph, compiler: Callable) -> concurrent.futures.Future:
    """`job` of a traced graph's compile job in a worker, under the settings in force now; a
    future holding the error where none could take it."""
    try:
        return _submit(job, _job(graph.packed, compiler, graph.state), _cache_env())
    except Exception as error:  # a setting that does not pickle; no pool could start
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(error)
        return future


def run_in_worker(graph: TracedGraph, compiler: Callable) -> concurrent.futures.Future:
    """What `compiler` returns for a traced graph (picklable), from a worker."""
    return _submitted(_compile_job, graph, compiler)


def _compile_packed_here(packed: bytes, compiler: Callable, state: dict[str, Any]) -> Any:
    """_compile_packed in this process under `state` (the graph's at its trace, as its worker
    compiled it: AOTAutograd's cache key holds grad mode and autocast); this process's flags are
    put back after."""
    here = _runtime_state()
    try:
        with _unseen_by_checkpoints(), _in_runtime_state(state):
            return _compile_packed(packed, compiler)
    finally:
        _set_flags(here)


def run_here(graph: TracedGraph, compiler: Callable) -> Any:
    """What `compiler` returns for a traced graph, in this process as a worker would run it (from
    its packed form, under the state of its trace)."""
    return _compile_packed_here(graph.packed, compiler, graph.state)


def hand_over(
    graph: TracedGraph, compiler: Callable, compile_here: Callable, stats: Stats, cuda_graphs: bool
) -> WorkerGraph:
    """A traced graph's compile under the settings in force now, handed to a worker; the graph
    runs uncompiled under a checkpoint until it is back (arguments as `compile_in_workers`). A
    graph no pool takes counts as one whose worker failed: compiled here at its next call."""
    future = _submitted(_compile_in_worker, graph, compiler)
    stats.worker_graphs_started += 1
    return WorkerGraph(graph.gm, graph.packed, compile_here, future, stats, graph.label, True, graph.state, cuda_graphs)


def compile_in_workers(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    compiler: Callable,
    compile_here: Callable[[torch.fx.GraphModule, list[Any]], Callable],
    stats: Stats,
    label: str,
    checkpointed: bool,
    cuda_graphs: bool = False,
) -> Callable:
    """What a region's backend returns for `gm` with workers (`start` first): the graph loaded
    from the caches if they hold it, else a WorkerGraph whose worker compiles it. Once the caches
    missed MISSES_BEFORE_COLD graphs in a row, graphs are handed over without the look-up.

    compiler: the backend a worker compiles with (picklable), under the settings in force now.
    compile_here(gm, inputs): compiles in this process with those settings. checkpointed: run
    the graph under a non-reentrant checkpoint until it is compiled. cuda_graphs: `compiler`
    records CUDA graphs."""
    global _misses_in_a_row
    if not should_use_local_autograd_cache():
        warn(f"{label} compiles in this process: compile workers need AOTAutograd's local cache, which is off")
        return compile_here(gm, example_inputs)
    # Packed before anything compiles: inductor's pre-grad passes may rewrite gm in place.
    with _unseen_by_checkpoints():
        packed = _pack_graph(gm, example_inputs)
    if _misses_in_a_row < MISSES_BEFORE_COLD:
        try:
            with _only_from_cache():
                compiled = compile_here(gm, example_inputs)
        except _NotCached:
            _misses_in_a_row += 1
            if _misses_in_a_row == MISSES_BEFORE_COLD:
                logger.info("the caches held none of the last %d graphs: the next ones go to the compile workers "
                            "without a look-up here", MISSES_BEFORE_COLD)
        else:
            _misses_in_a_row = 0
            return compiled
    try:
        if isinstance(packed, str):
            raise RuntimeError(packed)
        state = _runtime_state()
        future = _submit(_compile_in_worker, _job(packed, compiler, state), _cache_env())
    except Exception as error:  # a graph or setting that does not pickle; no pool could start, or it exited
        _compiles_here(f"{label} could not be handed to a compile worker ({error}); it compiles in this process",
                       isinstance(error, WorkersExited))
        return compile_here(gm, example_inputs)
    stats.worker_graphs_started += 1
    return WorkerGraph(gm, packed, compile_here, future, stats, label, checkpointed, state, cuda_graphs)
