"""The activation memory budget: measured effect, held through recompiles, and the
checkpointing it replaces."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._functorch.config
import torch.nn as nn
from conftest import ONE_BLOCK_CLASS, build, inputs_for
from torch.utils.checkpoint import checkpoint

import compile_accel
from compile_accel import CompileConfig
from compile_accel.backend import FAST_COMPILE_SETTINGS
from compile_accel.memory import SavedActivationMeter


def _saved_bytes(model: nn.Module, res: int) -> int:
    params = [p for p in model.parameters()] + [
        p for net in getattr(model, "_test_network", []) for p in net.parameters()
    ]
    inputs = inputs_for(model, res=res, text_len=16)
    with SavedActivationMeter(params) as meter:
        loss = model(*inputs).square().mean()
    loss.backward()
    return meter.bytes


def test_lower_budget_saves_fewer_activation_bytes_also_after_a_recompile() -> None:
    default_budget = torch._functorch.config.activation_memory_budget
    saved = {}
    for budget in (0.0, 0.5, 1.0):
        torch._dynamo.reset()
        model, _ = build("kohya", None, **ONE_BLOCK_CLASS)
        # The min-cut partitioner without inductor's code generation: the same choice of what to
        # save, compiled in a fraction of the time.
        config = CompileConfig(mode="blocks", activation_memory_budget=budget, backend="aot_eager_decomp_partition")
        acceleration = compile_accel.apply(model, config)
        saved[budget, 16] = _saved_bytes(model, 16)
        graphs = acceleration.stats()["unique_graphs"]
        saved[budget, 24] = _saved_bytes(model, 24)  # a new shape: the blocks compile again
        assert acceleration.stats()["unique_graphs"] > graphs
    for res in (16, 24):
        assert saved[0.0, res] < saved[1.0, res]
        assert saved[0.0, res] <= saved[0.5, res] <= saved[1.0, res]
    # The budget lived inside each region's compiles; the global knob never moved.
    assert torch._functorch.config.activation_memory_budget == default_budget


def test_budget_turns_model_checkpointing_off_and_remove_turns_it_back_on() -> None:
    model, params = build("kohya", "non-reentrant")
    # aot_eager: what is checked here is seen by the backend wrapper before inductor would run
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend="aot_eager")
    acceleration = compile_accel.apply(model, config)
    blocks = [*model.double_blocks, *model.single_blocks]
    assert not any(b.gradient_checkpointing for b in blocks)
    assert acceleration.stats()["checkpointing_switched_off"] == [
        "double_blocks.0",
        "double_blocks.1",
        "single_blocks.0",
        "single_blocks.1",
    ]
    model(*inputs_for(model)).square().mean().backward()
    assert acceleration.stats()["still_checkpointed"] == []
    acceleration.remove()
    assert all(b.gradient_checkpointing for b in blocks)


def test_blocks_without_budget_keep_checkpointing() -> None:
    model, _ = build("kohya", "non-reentrant")
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks"))
    assert all(b.gradient_checkpointing for b in model.double_blocks)
    assert acceleration.stats()["checkpointing_switched_off"] == []


def test_budget_leaves_the_checkpointing_of_excluded_blocks_on() -> None:
    model, _ = build("kohya", "non-reentrant")
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, exclude=["single_blocks.*"])
    acceleration = compile_accel.apply(model, config)
    assert acceleration.stats()["checkpointing_switched_off"] == ["double_blocks.0", "double_blocks.1"]
    assert [b.gradient_checkpointing for b in [*model.double_blocks, *model.single_blocks]] == [False, False, True, True]


class _AlwaysCheckpointed(nn.Module):
    """A block that checkpoints itself with no switch to turn it off."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.lin, x, use_reentrant=False)


class _PlainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _Stack(nn.Module):
    def __init__(self, block: type[nn.Module], checkpoint_outside: bool = False, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.checkpoint_outside = checkpoint_outside
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant) if self.checkpoint_outside else block(x)
        return x


class _OneSwitchStack(_Stack):
    """diffusers' way: one flag on the model checkpoints every block."""

    gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__(_PlainBlock)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.gradient_checkpointing else block(x)
        return x


def test_budget_warns_when_the_switch_it_turns_off_also_checkpoints_excluded_blocks() -> None:
    model = _OneSwitchStack()
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, exclude=["blocks.1"])
    with pytest.warns(RuntimeWarning, match=r"also checkpoint blocks left eager .*\(blocks\.1\)"):
        acceleration = compile_accel.apply(model, config)
    assert acceleration.stats()["checkpointing_switched_off"] == ["_OneSwitchStack"]
    acceleration.remove()
    assert model.gradient_checkpointing is True


@pytest.mark.parametrize(
    "model, where",
    [
        (lambda: _Stack(_AlwaysCheckpointed), "inside"),
        (lambda: _Stack(_PlainBlock, checkpoint_outside=True), "outside"),
    ],
    ids=["checkpoint-inside-block", "checkpoint-around-block"],
)
def test_block_still_under_a_checkpoint_is_named(model, where: str) -> None:
    model = model()
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="still checkpointed"):
        model(x).sum().backward()
    assert acceleration.stats()["still_checkpointed"] == ["blocks.0", "blocks.1"]


def test_validation_without_grad_is_no_checkpoint_and_a_reentrant_recompute_is_one() -> None:
    model = _Stack(_PlainBlock, checkpoint_outside=True, reentrant=True)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # compile_accel's warnings
        model(torch.randn(4, 8))  # validation in training mode: tells nothing either way
    assert acceleration.stats()["still_checkpointed"] == []
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="still checkpointed"):
        model(x).sum().backward()  # reentrant checkpoint: grad off in forward, recompute in backward
    assert sorted(acceleration.stats()["still_checkpointed"]) == ["blocks.0", "blocks.1"]


_SETTINGS_SEEN_BY_BACKEND: list[dict] = []


def _fast_compile_settings() -> dict:
    config = torch._inductor.config.get_config_copy()
    return {name: config[name] for name in FAST_COMPILE_SETTINGS}


@torch._dynamo.register_backend(name="compile_accel_test_recording")
def _recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Stands in for inductor: records the inductor settings in force while it compiles."""
    _SETTINGS_SEEN_BY_BACKEND.append(_fast_compile_settings())
    return gm.forward


@pytest.mark.parametrize("fast_compile", [True, False])
def test_fast_compile_settings_hold_inside_a_regions_compile_only(fast_compile: bool) -> None:
    _SETTINGS_SEEN_BY_BACKEND.clear()
    outside = _fast_compile_settings()
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(2)])
    config = CompileConfig(mode="blocks", backend="compile_accel_test_recording", fast_compile=fast_compile)
    compile_accel.apply(blocks, config, blocks=[blocks])
    blocks[1](blocks[0](torch.randn(2, 4)))  # (the first call of a class runs eager: compile_accel.region_inputs)
    assert _SETTINGS_SEEN_BY_BACKEND == [FAST_COMPILE_SETTINGS if fast_compile else outside]
    assert _fast_compile_settings() == outside
