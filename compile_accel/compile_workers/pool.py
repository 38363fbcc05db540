"""The compile workers' pool: started once (`start`) or at the first graph handed over, stopped
when idle, given up when its process exits unasked.

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

GPU memory: a worker that compiled a graph holds a CUDA context of its own (about half a GiB:
benchmarks/results/h100_compile_workers/README.md), outside the training process's memory. The
pool stops once every job handed to it is back and the first step is done (`first_step_done`;
before that, after IDLE_SECONDS_BEFORE_FIRST_STEP_DONE without a job back) and nobody keeps it
(`keep_running`); a later graph (new input shapes) starts a new pool. At the interpreter's exit a
pool still up (jobs out: a run shorter than their compile) is stopped as asked, its jobs dropped.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable
from unittest import mock

from ..stats import warn
from .worker import WorkerCompile, get_ready

logger = logging.getLogger("compile_accel")

# Torch's subprocess pool hands its process pipes as inherited file descriptors, which Windows
# has not: there the pool is _SpawnedPool.
SPAWNED_POOL = sys.platform == "win32"
# Each worker's inductor compiles its kernels in a pool of its own, sized as if this many graphs
# compiled at once (a DiT's blocks make 2-3 graphs), so that a few graphs get the training
# process's share of the CPU; more (SDXL's dozens) share it
# (benchmarks/results/h200_worker_warm_up/).
GRAPHS_AT_ONCE = 4
# Until the first step is done, an idle pool waits this long for more graphs: a first step hands
# its graphs over in waves, tens of seconds apart, and a new pool takes seconds to start
# (benchmarks/results/h100_workers_every_mode/README.md).
IDLE_SECONDS_BEFORE_FIRST_STEP_DONE = 60.0
# A wait on the workers checks this often that their pool's process is alive.
LIVENESS_CHECK_SECONDS = 1.0


class WorkersExited(RuntimeError):
    """The compile workers' pool process exited though nobody stopped it: graphs compile in the
    training process from then on."""


class WorkerPool:
    """The compile workers of this process (one: POOL). Its lock is never taken on the pool's
    reader thread, which runs the futures' callbacks holding the pool's own lock, which submit()
    takes; the idle check's lock is taken there too, never with the lock held."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0  # the pool's size, from the first start() that asked for workers
        self.pool: Any = None  # up from start() or the first job until idle (_stop_if_idle)
        self.out: list[concurrent.futures.Future] = []  # the running pool's jobs not yet back
        self.after_first_step = False  # set by first_step_done(), for the rest of the process
        self.exited: str | None = None  # why the pool's process exited unasked: then graphs compile here
        self.kept: weakref.WeakSet = weakref.WeakSet()  # the holders keep_running keeps it up for
        # Look-ups in the caches before hand-overs that missed in a row (compile_in_workers); a
        # worker's cache hit says the caches are warm after all.
        self.misses_in_a_row = 0
        self._last_back = 0.0  # time.monotonic() when a job last came back
        self._idle_check: threading.Timer | None = None  # the pending _stop_if_idle
        self._idle_check_lock = threading.Lock()
        atexit.register(self._stop_at_exit)

    def start(self, count: int) -> None:
        """Start the pool of `count` workers now (a later count is ignored; more than the CPU
        cores is that many, with a warning)."""
        with self.lock, contextlib.suppress(WorkersExited):  # (warned about once: graphs compile here)
            self.count = self.count or _at_most_one_per_core(count)
            self._running_pool()

    def _running_pool(self) -> Any:
        # Called with the lock held. WorkersExited once a pool's process exited unasked.
        self._check_alive()
        if self.exited is not None:
            raise WorkersExited(self.exited)
        if self.pool is None:
            from torch._inductor.compile_worker.subproc_pool import SubprocKind, SubprocPool

            # (Every training process on this host has workers: DDP's share the cores too.)
            processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            threads = str(max(1, (os.cpu_count() or 1) // (min(self.count, GRAPHS_AT_ONCE) * processes)))
            # Read by each worker's inductor when it is imported there; the processes take the
            # environment as it is when they start: the pool's (and a _SpawnedPool's workers, at
            # the submits that start them) here.
            with mock.patch.dict(os.environ, {"TORCHINDUCTOR_COMPILE_THREADS": threads}):
                pool = _SpawnedPool(self.count) if SPAWNED_POOL else SubprocPool(self.count, kind=SubprocKind.SPAWN)
                self.pool = pool
                _close_its_pipe_ends(pool)
                logger.info("started %d compile workers", self.count)
                # One per worker, as each starts (not in `out`, which is the graphs' jobs).
                for _ in range(self.count):
                    pool.submit(get_ready).add_done_callback(_log_not_ready)
        return self.pool

    def _check_alive(self) -> None:
        """Give the pool up if its process exited though nobody stopped it (stopping sets `pool`
        to None first). Called with the lock held."""
        pool = self.pool
        if pool is not None and not (pool.running and pool.process.poll() is None):
            self._give_up(pool)

    def check_alive(self) -> None:
        with self.lock:
            self._check_alive()

    def _give_up(self, pool: Any) -> None:
        """The pool's process exited, or its pipe broke: its jobs still out fail, and graphs
        compile here from now on, with one warning. Called with the lock held."""
        # (Once torch's reader found the pipe closed, the process is exiting: its exit code comes.)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pool.process.wait(LIVENESS_CHECK_SECONDS)
        code = pool.process.returncode
        self.pool = None
        self.exited = "its pipe broke" if code is None else f"exit code {code}"
        for future in self.out:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # (done meanwhile)
                future.set_exception(WorkersExited(self.exited))
        # Not shut down (at exit neither): its process is gone, and a write to its pipe might never return.
        warn(f"the compile workers' pool process exited ({self.exited}: killed, out of memory or crashed): the "
             "graphs it had and every later one compile in this process")

    def lost_with_the_pool(self, error: BaseException) -> bool:
        """Whether a job failed because its pool's process exited (warned about once), not in its worker."""
        from torch._inductor.compile_worker.subproc_pool import SubprocException

        with self.lock:
            self._check_alive()
            if self.exited is None:
                return False
        # A worker's own error: SubprocPool wraps it; a _SpawnedPool passes it on as it was raised.
        if SPAWNED_POOL:
            return isinstance(error, (BrokenProcessPool, WorkersExited))
        return not isinstance(error, SubprocException)

    def as_completed(self, futures: list[concurrent.futures.Future]) -> Iterator[concurrent.futures.Future]:
        """Each of `futures` as it is done, the pool's process checked every
        LIVENESS_CHECK_SECONDS: once it exited, its jobs fail and the wait ends."""
        waiting = set(futures)
        while waiting:
            done, waiting = concurrent.futures.wait(
                waiting, LIVENESS_CHECK_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED
            )
            yield from done
            if not done:
                self.check_alive()

    def wait_all(self, futures: list[concurrent.futures.Future]) -> None:
        """Until every one of `futures` is done, or failed with the pool's process; then the
        process is checked once more, so that jobs torch failed when it saw the process go are
        warned about as its end."""
        for _ in self.as_completed(futures):
            pass
        self.check_alive()

    def submit(self, *args: Any) -> concurrent.futures.Future:
        """Hand one job to the pool (started again if it was shut down); WorkersExited once its
        process exited unasked."""
        with self.lock:
            pool = self._running_pool()
            try:
                future = pool.submit(*args)
            except (OSError, BrokenProcessPool) as error:  # its process exited as this was written
                self._give_up(pool)
                raise WorkersExited(self.exited) from error
            self.out.append(future)
        future.add_done_callback(self._back)
        return future

    def _back(self, future: concurrent.futures.Future) -> None:
        # On the pool's reader thread, so not under the lock: the idle check runs on a timer's thread.
        self._last_back = time.monotonic()
        report = future.result() if future.exception() is None else None
        if isinstance(report, WorkerCompile) and report.aot_autograd.get("autograd_cache_hit"):
            self.misses_in_a_row = 0
        self._stop_when_idle()

    def _stop_when_idle(self) -> None:
        """Check whether the pool is idle once the last job has been back for the idle time, in a
        timer that replaces the pending one: one waiting thread, not one per job back."""
        if self.pool is None:  # stopped (at exit too, where no thread may start): nothing to check
            return
        idle_seconds = 0.0 if self.after_first_step else IDLE_SECONDS_BEFORE_FIRST_STEP_DONE
        with self._idle_check_lock:
            if self._idle_check is not None:
                self._idle_check.cancel()
            delay = max(0.0, self._last_back + idle_seconds - time.monotonic())
            self._idle_check = threading.Timer(delay, self._stop_if_idle, args=(self.pool, idle_seconds))
            self._idle_check.name = "compile_accel-workers-idle-check"
            self._idle_check.daemon = True
            self._idle_check.start()

    def first_step_done(self) -> None:
        """The training's first step is done: the pool stops now if no job is out (and nobody
        keeps it), else as soon as the last one is back."""
        self.after_first_step = True
        self._stop_if_idle(self.pool, 0.0)

    def keep_running(self, holder: object, kept: bool) -> None:
        """While kept for some holder (held weakly), the pool does not stop when nothing is out
        in it; released, it stops once idle as usual."""
        with self.lock:
            released = not kept and holder in self.kept
            (self.kept.add if kept else self.kept.discard)(holder)
        if released:
            self._stop_when_idle()

    def _stop_if_idle(self, pool: Any, idle_seconds: float) -> None:
        """Shut `pool` down if it is still the pool, nobody keeps it, no job is out in it, and
        none came back in the last `idle_seconds` (a later job back arms the check again)."""
        with self.lock:
            self._check_alive()
            self.out[:] = [future for future in self.out if not future.done()]
            # (A timer may fire a hair early: 10 ms of slack.)
            if (
                pool is None
                or pool is not self.pool
                or self.kept
                or self.out
                or time.monotonic() - self._last_back < idle_seconds - 0.01
            ):
                return
            self.pool = None
        self._shut_down(pool)
        logger.info("no graph is out in the compile workers: workers stopped, their GPU memory freed")

    def stop(self) -> None:
        """Stop the pool now, if one runs."""
        with self.lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            self._shut_down(pool)

    @staticmethod
    def _shut_down(pool: Any) -> None:
        # In a thread of its own: shutdown() joins the pool's reader thread.
        threading.Thread(target=pool.shutdown, name="compile_accel-workers-shutdown", daemon=True).start()

    def _stop_at_exit(self) -> None:
        """At the interpreter's exit, with jobs still out (a run shorter than their compile): the
        pool stops as asked, not as a pool whose process exited unasked, which the jobs it fails
        would otherwise report."""
        with self.lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown()

    def running(self) -> bool:
        with self.lock:
            self._check_alive()
            return self.pool is not None


POOL = WorkerPool()  # the process-wide pool: one per training process


def _at_most_one_per_core(count: int) -> int:
    # Each worker is a process that imports torch, and more than the cores compile no faster; a
    # count such as 100000 would keep apply() starting processes.
    cores = os.cpu_count() or 1
    if count <= cores:
        return count
    warn(f"CompileConfig.compile_workers={count} is more than this machine's {cores} CPU cores: "
         f"using compile_workers={cores}")
    return cores


def _log_not_ready(future: concurrent.futures.Future) -> None:
    # A graph's compile in that worker gets ready again first, and fails there with the error.
    if future.exception() is not None:
        logger.debug("a compile worker could not get ready: %r", future.exception())


def compiles_here(message: str, pool_exited: bool) -> None:
    """Say that a graph compiles in this process: a warning, or a log line where that is because
    the pool's process exited (warned about once)."""
    if pool_exited:
        logger.info(message)
    else:
        warn(message)


class _SpawnedPool:
    """The compile workers as spawned processes of a ProcessPoolExecutor in this process (Windows:
    see the module docstring), with what WorkerPool uses of torch's SubprocPool: submit,
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
