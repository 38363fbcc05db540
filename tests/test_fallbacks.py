"""Regions that cannot compile (forward or backward graph) run eager with a warning; recompile
limits are loud and apply in every thread; an interrupted compile counts no graph."""

from __future__ import annotations

import copy
import re
import threading
import warnings

from typing import Callable

import pytest
import torch
import torch.nn as nn
from conftest import build, inputs_for, lora_step, relative_error
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import register_backend

import compile_accel
from compile_accel import CompileConfig


def test_complex_rope_regions_fall_back_with_one_warning_per_block_class() -> None:
    model, params = build("kohya", None, rope="complex")
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss, grads = lora_step(model, params, inputs)
    ours = [str(w.message) for w in caught if "compile_accel" in str(w.message)]
    assert len(ours) == 2 and all("complex" in message for message in ours)
    assert "double_blocks.0" in ours[0] and "single_blocks.0" in ours[1]
    stats = acceleration.stats()
    assert {f["region"] for f in stats["fallbacks"]} == {
        "double_blocks.0",
        "double_blocks.1",
        "single_blocks.0",
        "single_blocks.1",
    }
    assert all("complex" in f["reason"] for f in stats["fallbacks"])
    assert stats["compiled_regions"] == 0
    assert relative_error(loss, expected_loss) < 1e-6
    assert all(relative_error(g, e) < 1e-6 for g, e in zip(grads, expected_grads, strict=True))


def test_checkpointed_block_that_dynamo_runs_eager_is_a_fallback() -> None:
    """A graph break inside torch.utils.checkpoint (here the excluded complex rotary) makes
    dynamo run the whole checkpointed call eager: no graph at all, which must not pass for compiled."""
    model, params = build("kohya", "non-reentrant", rope="complex")
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)
    config = CompileConfig(mode="blocks", exclude=["*.rope"], backend="aot_eager")
    acceleration = compile_accel.apply(model, config)
    with pytest.warns(RuntimeWarning, match="compiled no graph for its forward .*graph break"):
        loss, grads = lora_step(model, params, inputs)
    stats = acceleration.stats()
    assert stats["compiled_regions"] == 0 and stats["unique_graphs"] == 0
    assert len(stats["fallbacks"]) == 4 and stats["graph_breaks"] >= 1
    assert relative_error(loss, expected_loss) < 1e-6
    assert all(relative_error(g, e) < 1e-6 for g, e in zip(grads, expected_grads, strict=True))


def test_no_graph_fallback_is_per_block_class_and_checked_again_when_grad_mode_changes() -> None:
    """Both block classes share one forward (the checkpoint mixin's). Only the double blocks'
    rotary is excluded (a graph break), so only they compile no graph once checkpointed in
    training; an earlier eval call without grad compiled graphs for both and must not hide that."""
    model, params = build("kohya", "non-reentrant")
    inputs = inputs_for(model)
    expected_loss, expected_grads = lora_step(model, params, inputs)
    config = CompileConfig(mode="blocks", exclude=["double_blocks.*.rope"], backend="aot_eager")
    acceleration = compile_accel.apply(model, config)
    model.eval()
    with torch.no_grad():
        model(*inputs)
    model.train()
    with pytest.warns(RuntimeWarning, match="compiled no graph"):
        loss, grads = lora_step(model, params, inputs)
    stats = acceleration.stats()
    assert {f["region"] for f in stats["fallbacks"]} == {"double_blocks.0", "double_blocks.1"}
    assert stats["compiled_regions"] == 2
    assert relative_error(loss, expected_loss) < 1e-6
    assert all(relative_error(g, e) < 1e-6 for g, e in zip(grads, expected_grads, strict=True))


class _Talkative(nn.Module):
    """Graph-breaks on purpose (a print), which fullgraph=True turns into a compile error."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        print("", end="")
        return torch.relu(y)


class _Tagged(nn.Module):
    """Reads a per-instance string in forward: dynamo specialises on it, one graph per instance."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if self.tag.endswith("0") else 1.0)


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_region_whose_compile_raises_falls_back() -> None:
    model = _Stack([_Talkative() for _ in range(3)])
    x = torch.randn(4, 8)
    expected = model(x)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", fullgraph=True, backend="aot_eager"))
    with pytest.warns(RuntimeWarning, match="could not be compiled and runs eager"):
        out = model(x)
    torch.testing.assert_close(out, expected)
    fallbacks = acceleration.stats()["fallbacks"]
    assert [f["region"] for f in fallbacks] == ["blocks.0", "blocks.1", "blocks.2"]


class CppCompileError(RuntimeError):
    """Inductor's, as far as the reason reads it: its type's name and its text."""


@register_backend(name="compile_accel_test_failing_cpp")
def _failing_cpp_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    command = "g++ /tmp/kernel.cpp -shared -fPIC -O3 -Werror=ignored-optimization-argument -o /tmp/kernel.so"
    output = "collect2: error: ld returned 1 exit status\n/tmp/kernel.cpp:14:37: error: 'at::vec' has not been declared"
    raise CppCompileError(f"C++ compile error\n\nCommand:\n{command}\n\nOutput:\n{output}")


def test_a_compiler_error_falls_back_with_the_compilers_first_error_line() -> None:
    """A first line of "C++ compile error" alone tells a user nothing: the warning and the
    fallback's reason carry the compiler's first error line too (not the command's flags)."""
    model = _Stack([nn.Linear(8, 8) for _ in range(2)])
    x = torch.randn(4, 8)
    expected = model(x)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", backend="compile_accel_test_failing_cpp"))
    reason = "CppCompileError: C++ compile error (/tmp/kernel.cpp:14:37: error: 'at::vec' has not been declared)"
    with pytest.warns(RuntimeWarning, match=re.escape(reason)):
        out = model(x)
    torch.testing.assert_close(out, expected)
    assert {f["reason"] for f in acceleration.stats()["fallbacks"]} == {reason}


def test_recompile_limit_hit_is_loud_and_counted() -> None:
    model = _Stack([_Tagged(f"t{i}") for i in range(5)])
    x = torch.randn(4, 8)
    expected = model(x)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", recompile_limit=2, backend="aot_eager"))
    with pytest.warns(RuntimeWarning, match="hit recompile_limit=2"):
        out = model(x)
    torch.testing.assert_close(out, expected)
    stats = acceleration.stats()
    assert stats["recompile_limit_hits"] >= 1
    assert stats["recompiles"] >= 1  # same inputs, new graph: the per-instance string


def test_recompile_limit_applies_in_other_threads() -> None:
    """Reentrant checkpoint recompute compiles on autograd worker threads, whose dynamo config
    (torch >= 2.12) starts from the defaults: a limit of 8 there would cut this off at 8."""
    model = _Stack([_Tagged(f"t{i}") for i in range(10)])
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", recompile_limit=16, backend="aot_eager"))
    caught: list[warnings.WarningMessage] = []

    def run() -> None:
        with warnings.catch_warnings(record=True) as inner:
            warnings.simplefilter("always")
            for _ in range(2):  # (the first block's first call runs eager: compile_accel.region_inputs)
                model(torch.randn(4, 8))
        caught.extend(inner)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    stats = acceleration.stats()
    assert stats["recompile_limit_hits"] == 0
    assert stats["unique_graphs"] + stats["recompiles"] == 10  # every instance ran compiled
    assert not [w for w in caught if "recompile_limit" in str(w.message)]


class _Affine(nn.Module):
    """Compute of its own (not a lone built-in layer, which selective leaves eager)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight) + 1


class _Half(nn.Module):
    """Half of a block without a forward: the block calls its methods (sd-scripts' SD3 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = _Affine(), _Affine()

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x))


class _Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = _Affine()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def twice(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.lin(x)


def _twice(projection: _Projection, x: torch.Tensor) -> torch.Tensor:
    return projection.twice(x)


class _MethodBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.part, self.projection, self.reached = _Half(), _Projection(), _Projection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `reached` is used only through its method: its children are the regions. `projection`
        # is handed to a function, which the block's code does not show: it stays a region of
        # its own, whose forward is never called.
        return self.reached.twice(_twice(self.projection, self.part.pre(x)))


class _MethodModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MethodBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_selective_looks_into_forwardless_children_and_warns_about_uncalled_regions() -> None:
    model = _MethodModel()
    x = torch.randn(3, 8)
    expected = model(x)
    acceleration = compile_accel.apply(model, CompileConfig(mode="selective", backend="aot_eager"))
    names = [region.name for region in acceleration.regions]
    children = ("part.norm", "part.lin", "projection", "reached.lin")
    assert names == [f"blocks.{i}.{child}" for i in range(2) for child in children]
    with pytest.warns(RuntimeWarning, match="2 of 8 regions were not called"):
        out = model(x)
    torch.testing.assert_close(out, expected)
    stats = acceleration.stats()
    assert stats["uncalled_regions"] == ["blocks.0.projection", "blocks.1.projection"]
    assert stats["unique_graphs"] == 1  # one _Affine graph, for every child that was called


def test_a_wrong_call_raises_its_own_error_and_leaves_compiling_on() -> None:
    model = _Stack([nn.Linear(8, 8) for _ in range(3)])
    x = torch.randn(4, 8)
    expected = model(x)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", backend="aot_eager"))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        model(torch.randn(4, 5))  # eager's own error, not a compile failure
    torch.testing.assert_close(model(x), expected)
    stats = acceleration.stats()
    assert stats["fallbacks"] == [] and stats["compiled_regions"] == 3 and stats["unique_graphs"] >= 1


def _backward_compiler_failing_at_width_16(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    if any(16 in value.shape for value in example_inputs):
        raise RuntimeError("injected backward compile failure")
    return gm


# Forward graphs and backward graphs without a 16-wide tensor compile (run as traced).
torch._dynamo.register_backend(
    aot_autograd(fw_compiler=lambda gm, example_inputs: gm, bw_compiler=_backward_compiler_failing_at_width_16),
    name="compile_accel_test_failing_backward",
)


class _Widening(nn.Linear):
    """Another block class with nn.Linear's forward: one compiled function serves both classes."""


def _parameter_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Every parameter gradient of one step (cleared afterwards)."""
    model(x).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_block_class_whose_backward_graph_fails_to_compile_runs_eager_and_training_goes_on() -> None:
    """AOTAutograd compiles a backward lazily, at the first backward, where its error would reach
    loss.backward() on every step. It must be a fallback like a forward's, for that class only,
    with eager's gradients on the step it happened."""
    model = _Stack([nn.Linear(8, 8), nn.Linear(8, 8), _Widening(8, 16)])
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    expected = _parameter_grads(reference, x)
    config = CompileConfig(mode="blocks", backend="compile_accel_test_failing_backward")
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = [_parameter_grads(model, x) for _ in range(2)]
    ours = [str(w.message) for w in caught if "compile_accel" in str(w.message)]
    assert len(ours) == 1 and "blocks.2" in ours[0] and "injected backward compile failure" in ours[0]
    stats = acceleration.stats()
    assert [f["region"] for f in stats["fallbacks"]] == ["blocks.2"] and stats["compiled_regions"] == 2
    for grads in steps:
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    for ours_, theirs in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(ours_, theirs)


class _InterruptedOnce:
    """A backend whose first compile is stopped by Ctrl-C; later compiles run the graph as traced."""

    def __init__(self) -> None:
        self.interrupted = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return gm.forward


torch._dynamo.register_backend(_InterruptedOnce(), name="compile_accel_test_interrupted_once")


def test_a_compile_interrupted_by_ctrl_c_is_not_a_recompile_when_retried() -> None:
    model = _Stack([nn.Linear(8, 8) for _ in range(2)])
    x = torch.randn(4, 8)
    expected = model(x)
    config = CompileConfig(mode="blocks", backend="compile_accel_test_interrupted_once")
    acceleration = compile_accel.apply(model, config)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    torch.testing.assert_close(model(x), expected)
    stats = acceleration.stats()
    assert (stats["unique_graphs"], stats["recompiles"], stats["fallbacks"]) == (1, 0, [])
