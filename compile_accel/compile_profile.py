"""Where compile time goes, read from PyTorch's own compile timers and cache counters.

torch times every compile phase (`torch._dynamo.utils.compilation_time_metrics`, cumulative
seconds per phase name, nested) and counts inductor's and AOTAutograd's cache hits. A
`CompileClock` takes a snapshot of both; `CompileClock.since()` turns the difference into
exclusive phases that add up to the compile time:

    dynamo     tracing the Python bytecode into a graph (compile_inner less the backend and guards)
    guards     building the guards that decide which graph a later call runs
    aot        AOTAutograd: the joint forward+backward trace, the partitioner (activation budget),
               wrappers; the backend call less inductor's compiles
    inductor   inductor lowering and code generation of the forward and backward graphs, less
               the waits below
    kernels    compiling the generated kernels (Triton on a GPU, C++ on a CPU): in the process,
               or waiting for inductor's worker processes
    autotune   benchmarking kernel configs, at compile (templates) or at a kernel's first run

`lazy_backward_s` is the part of aot, inductor and kernels spent at the first backward (a graph
whose backward was not compiled with its forward). Phase names missing from a torch version
count as zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

PHASES = ("dynamo", "guards", "aot", "inductor", "kernels", "autotune")

_RUNTIME_AUTOTUNE = ("CachingAutotuner.benchmark_all_configs", "CachingAutotuner.coordinate_descent_tuning")


def _total(metrics: Mapping[str, list[float]], *names: str) -> float:
    return sum((sum(metrics.get(name, ())) for name in names), 0.0)


def _template_autotune(metrics: Mapping[str, list[float]]) -> float:
    return sum((sum(v) for k, v in metrics.items() if k.endswith(("_template_autotuning", "_template_precompiling"))), 0.0)


@dataclass
class CompileTimes:
    """Compile seconds per phase (exclusive, module docstring) and cache use over some span."""

    seconds: dict[str, float]
    lazy_backward_s: float
    fx_graphs_compiled: int  # inductor graphs code-generated (inductor FX graph cache misses)
    fx_graphs_from_cache: int
    aot_graphs_from_cache: int  # AOTAutograd cache hits: forward+backward without tracing

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def warm(self) -> bool | None:
        """True when every inductor graph came from the cache, False when one was compiled,
        None when no graph was looked up."""
        if not self.fx_graphs_compiled + self.fx_graphs_from_cache:
            return None
        return self.fx_graphs_compiled == 0

    def as_dict(self) -> dict[str, object]:
        return {
            **{f"{phase}_s": round(self.seconds[phase], 3) for phase in PHASES},
            "total_s": round(self.total_s, 3),
            "lazy_backward_s": round(self.lazy_backward_s, 3),
            "fx_graphs_compiled": self.fx_graphs_compiled,
            "fx_graphs_from_cache": self.fx_graphs_from_cache,
            "aot_graphs_from_cache": self.aot_graphs_from_cache,
            "warm": self.warm,
        }

    def summary(self) -> str:
        """One line: total, the phases over 0.05 s, and the cache state."""
        phases = ", ".join(f"{p} {self.seconds[p]:.1f}" for p in PHASES if self.seconds[p] >= 0.05)
        looked_up = self.fx_graphs_compiled + self.fx_graphs_from_cache
        cache = (
            "no inductor graph looked up"
            if not looked_up
            else f"inductor cache {'warm' if self.warm else 'cold'}: {self.fx_graphs_from_cache} of {looked_up} graphs from it"
        )
        return f"{self.total_s:.1f} s compiling ({phases or 'nothing'}); {cache}"


def _read() -> tuple[dict[str, float], dict[str, int]]:
    metrics = torch._dynamo.utils.compilation_time_metrics
    counters = torch._dynamo.utils.counters
    return (
        {name: sum(values) for name, values in metrics.items()},
        {
            "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        },
    )


class CompileClock:
    """A snapshot of torch's compile timers; `since()` is what was compiled after it, in this
    process (every compile, not only compile_accel's)."""

    def __init__(self) -> None:
        self._seconds, self._counts = _read()

    def since(self) -> CompileTimes:
        seconds, counts = _read()
        delta = {name: [value - self._seconds.get(name, 0.0)] for name, value in seconds.items()}
        return compile_times(delta, {k: counts[k] - self._counts[k] for k in counts})


def compile_times(metrics: Mapping[str, list[float]], counts: Mapping[str, int]) -> CompileTimes:
    """Exclusive phases from torch's nested timers (`metrics`: phase name -> seconds per event)
    and cache counts (fx_miss, fx_hit, aot_hit)."""
    dynamo_entry = _total(metrics, "_compile.compile_inner")
    backend = _total(metrics, "OutputGraph.call_user_compiler")
    guards = _total(metrics, "build_guards")
    lazy_backward = _total(metrics, "backward._backward_impl")
    inductor_graphs = _total(metrics, "compile_fx_inner")
    kernels = _total(metrics, "async_compile.wait", "async_compile.precompile")
    template_autotune = _template_autotune(metrics)
    seconds = {
        "dynamo": dynamo_entry - backend - guards,
        "guards": guards,
        "aot": backend + lazy_backward - inductor_graphs,
        "inductor": inductor_graphs - kernels - template_autotune,
        "kernels": kernels,
        "autotune": template_autotune + _total(metrics, *_RUNTIME_AUTOTUNE),
    }
    return CompileTimes(
        {phase: max(value, 0.0) for phase, value in seconds.items()},
        lazy_backward,
        counts.get("fx_miss", 0),
        counts.get("fx_hit", 0),
        counts.get("aot_hit", 0),
    )
