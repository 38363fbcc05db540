"""Stand-ins shared by the compile-worker tests (tests/test_worker_graphs.py,
tests/test_worker_pool.py): dynamo's graph of a small function, a worker's report, and a
compile_here that loads a graph as from the workers' cache entry."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable

import torch

from compile_accel.compile_profile import CompileClock
from compile_accel.compile_workers import WorkerCompile


def traced_graph(fn: Callable, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """dynamo's graph module of `fn` and the inputs it hands a backend."""
    traced: list = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        traced.append((gm, list(example_inputs)))
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True)(*inputs)
    return traced[0]


def as_traced(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A compiler that runs the graph as dynamo traced it."""
    return gm.forward


def sine(t: torch.Tensor) -> torch.Tensor:
    return t.sin() * 2.0 + 1.0


class WorkerError(RuntimeError):
    pass


def worker_report(**aot_autograd: int) -> WorkerCompile:
    return WorkerCompile(aot_autograd, time.time(), 1.0, CompileClock().since())


def loaded_by_hand(runs: list, fails: bool = False) -> Callable:
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


def returned_future() -> concurrent.futures.Future:
    """A worker's job, back: its compile found in the caches."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(worker_report())
    return future
