"""What runs in a compile worker: it gets ready as it starts (inductor imported, its kernel pool
started), then compiles the graphs handed to it into the caches the training process reads."""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch._functorch.config
import torch._inductor.config

from ..compile_profile import CompileClock, CompileTimes
from ..preload import preload_inductor
from .packing import compile_packed, in_runtime_state


def get_ready() -> None:
    """In a worker, before its first graph: import inductor's compiler and start inductor's own
    kernel-compile pool, without waiting for it, so that the first graph's compile does neither
    (benchmarks/results/h200_worker_warm_up/)."""
    preload_inductor()
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.use_process_pool()  # starts the pool; True once it is up


def compile_job(job: bytes, env: dict[str, str]) -> Callable:
    """In a worker: compile a `packing.job`'s graph as the training process would."""
    os.environ.update(env)  # the training process's cache directories
    get_ready()  # (where the warm-up job did not reach this worker first)
    packed, compiler, inductor_settings, functorch_settings, state = pickle.loads(job)
    torch._inductor.config.load_config(inductor_settings)
    torch._functorch.config.load_config(functorch_settings)
    with in_runtime_state(state):
        return compile_packed(packed, compiler)


@dataclass
class WorkerCompile:
    """What a worker reports of one graph's compile."""

    aot_autograd: dict[str, int]  # AOTAutograd's cache counters of it (a bypass: the caches cannot hold it)
    started: float  # time.time() when the worker took it up
    seconds: float  # from then until the caches held it
    times: CompileTimes  # where those seconds went, by torch's compile timers in the worker


def compile_in_worker(job: bytes, env: dict[str, str]) -> WorkerCompile:
    """In a worker: compile one graph into the caches the training process reads."""
    started, clock = time.time(), CompileClock()
    counted = torch._dynamo.utils.counters["aot_autograd"].copy()
    compile_job(job, env)
    counters = dict(torch._dynamo.utils.counters["aot_autograd"] - counted)
    return WorkerCompile(counters, started, time.time() - started, clock.since())


def precompile_in_worker(job: bytes, env: dict[str, str]) -> bytes:
    """In a worker: compile one graph as torch's aot_compile does (the job's settings bundle the
    kernels into AOTAutograd's entry) and return it serialized (compile_accel.precompile)."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    return Bundled.serialize_compile_artifacts(Bundled(compile_job(job, env)))


def cache_env() -> dict[str, str]:
    """The training process's cache directories, for a worker to write where it reads."""
    return {name: os.environ[name] for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if name in os.environ}
