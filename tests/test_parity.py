"""Loss and every LoRA gradient match eager, for each mode, with kohya-style and peft LoRA.

Budgets 0.5 (part of each block recomputed in the backward) and 1.0 (nothing recomputed). Budget
0.0, the partitioner's other extreme, is compiled and checked for what it saves in test_budget;
its parity here cost a minute of the suite's time.

Tolerance: relative error (L2 norm of the difference over the norm of the eager value)
below 1e-4 in float32; inductor reorders reductions, so bit-equality is not expected.
Inputs and weights are drawn fresh on every run.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error

import compile_accel
from compile_accel import CompileConfig
from compile_accel.benchmarks.tiny_dit import COMPILE_EXCLUDE

TOLERANCE = 1e-4

CASES = {
    "off": (CompileConfig(mode="off"), None),
    "selective-reentrant": (CompileConfig(mode="selective"), "reentrant"),
    "selective-non-reentrant": (CompileConfig(mode="selective"), "non-reentrant"),
    "blocks-budget-0.5": (CompileConfig(mode="blocks", activation_memory_budget=0.5), "non-reentrant"),
    "blocks-budget-1.0": (CompileConfig(mode="blocks", activation_memory_budget=1.0), None),
}


@pytest.mark.parametrize("lora", ["kohya", "peft"])
@pytest.mark.parametrize("case", list(CASES))
def test_lora_gradients_match_eager(case: str, lora: str) -> None:
    config, checkpointing = CASES[case]
    torch.manual_seed(torch.seed())
    model, params = build(lora, checkpointing)
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)

    acceleration = compile_accel.apply(model, config)
    for _ in range(2):  # the compiling step, then a step on the compiled graphs
        loss, grads = lora_step(model, params, inputs)
        assert relative_error(loss, expected_loss) < TOLERANCE
        for grad, expected in zip(grads, expected_grads, strict=True):
            assert expected.abs().max() > 0
            assert relative_error(grad, expected) < TOLERANCE

    stats = acceleration.stats()
    assert stats["fallbacks"] == []
    if config.mode == "off":
        assert stats["regions"] == 0
    else:
        assert stats["compiled_regions"] == stats["regions"] > 0
        assert stats["unique_graphs"] > 0


def test_complex_rope_excluded_matches_eager() -> None:
    """Complex RoPE left eager behind a graph break (the bench's setting) still matches eager
    (one block class: these graphs are this test's alone)."""
    model, params = build("kohya", rope="complex", **ONE_BLOCK_CLASS)
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)
    acceleration = compile_accel.apply(
        model, CompileConfig(mode="blocks", activation_memory_budget=0.5, exclude=COMPILE_EXCLUDE)
    )
    loss, grads = lora_step(model, params, inputs)
    assert relative_error(loss, expected_loss) < TOLERANCE
    assert all(relative_error(g, e) < TOLERANCE for g, e in zip(grads, expected_grads, strict=True))
    stats = acceleration.stats()
    assert stats["fallbacks"] == [] and stats["graph_breaks"] > 0
