"""The compile-time breakdown: exclusive phases from torch's nested timers, and cold vs warm."""

from __future__ import annotations

import random

import pytest
import torch

from compile_accel.compile_profile import PHASES, CompileClock, compile_times


def test_phases_are_exclusive_and_add_up_to_the_compile_and_the_autotuning() -> None:
    metrics = {
        "_compile.compile_inner": [6.0, 4.0],  # dynamo's entry, around everything else of a forward compile
        "OutputGraph.call_user_compiler": [7.0],
        "build_guards": [0.5],
        "compile_fx_inner": [3.0, 2.5],  # forward and backward graphs
        "async_compile.wait": [1.5],
        "mm_template_autotuning": [0.5],
        "backward._backward_impl": [2.0],  # a backward compiled at the first backward
        "CachingAutotuner.benchmark_all_configs": [0.25],  # at a kernel's first run
        "a_phase_this_torch_adds": [9.0],
    }
    times = compile_times(metrics, {"fx_miss": 2, "fx_hit": 1, "aot_hit": 0})
    assert times.seconds == {
        "dynamo": 10.0 - 7.0 - 0.5,
        "guards": 0.5,
        "aot": 7.0 + 2.0 - 5.5,
        "inductor": 5.5 - 1.5 - 0.5,
        "kernels": 1.5,
        "autotune": 0.5 + 0.25,
    }
    assert times.total_s == pytest.approx(10.0 + 2.0 + 0.25)
    assert times.warm is False and times.lazy_backward_s == 2.0


def test_phases_a_torch_does_not_time_count_as_zero() -> None:
    times = compile_times({"_compile.compile_inner": [1.0]}, {})
    assert times.seconds["dynamo"] == 1.0 and times.total_s == 1.0
    assert times.warm is None and "no inductor graph looked up" in times.summary()


def test_a_first_compile_is_cold_and_the_same_graph_after_a_reset_is_warm() -> None:
    width = random.randrange(10**5, 10**6)  # a shape no other run compiled: cold for sure

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x).square().sum(-1)

    clock = CompileClock()
    torch.compile(step)(torch.randn(2, width))
    cold = clock.since()
    assert cold.warm is False and cold.fx_graphs_compiled >= 1
    assert cold.seconds["dynamo"] > 0 and cold.seconds["inductor"] > 0 and set(cold.seconds) == set(PHASES)
    torch._dynamo.reset()  # dynamo forgets the graph; inductor's cache on disk keeps it
    clock = CompileClock()
    torch.compile(step)(torch.randn(2, width))
    warm = clock.since()
    assert warm.warm is True and warm.fx_graphs_from_cache >= 1
    assert warm.seconds["inductor"] < cold.seconds["inductor"]
    assert "inductor cache warm" in warm.summary()
