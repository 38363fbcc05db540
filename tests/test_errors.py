"""Bad input: a clear error naming the field, and the model left exactly as it was."""

from __future__ import annotations

import copy
import pickle
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from conftest import build

import compile_accel
from compile_accel import CompileConfig, api
from compile_accel.adapters import ModelAdapter
from compile_accel.integrations import diffusers as accel_diffusers
from compile_accel.integrations import sd_scripts as accel_sd_scripts


def _untouched(model: nn.Module, flags: list[bool]) -> None:
    assert not any("forward" in m.__dict__ and not hasattr(m.__dict__["forward"], "__self__") for m in model.modules())
    assert "_compile_accel" not in model.__dict__
    assert [b.gradient_checkpointing for b in model.double_blocks] == flags


BAD_CONFIGS = [
    (dict(mode="blocks", activation_memory_budget=-0.1), "activation_memory_budget must be in"),
    (dict(mode="blocks", activation_memory_budget=1.5), "activation_memory_budget must be in"),
    (dict(mode="blocks", activation_memory_budget="0.5"), "activation_memory_budget must be a number"),
    (dict(mode="blocks", activation_memory_budget=float("nan")), "activation_memory_budget must be a number"),
    (dict(mode="blocks", activation_memory_budget=True), "activation_memory_budget must be a number"),
    (dict(mode="selective", activation_memory_budget=0.5), "applies to mode='blocks' only"),
    (dict(mode="fast"), "mode must be one of"),
    (dict(mode="blocks", recompile_limit=0), "recompile_limit must be an int"),
    (dict(mode="blocks", compile_mode="turbo"), "compile_mode must be one of"),
    (dict(mode="blocks", backend="aot_eager", compile_mode="max-autotune"), "applies to backend='inductor' only"),
    (dict(mode="blocks", exclude="*.rope"), "exclude must be a list"),
    (dict(mode="blocks", exclude=None), "exclude must be a list"),
    (dict(mode="blocks", backend="no_such_backend"), "is not a torch.compile backend"),
    # 1 == True: an int passed a membership test, then torch.compile asserted.
    (dict(mode="blocks", dynamic=1), "dynamic must be None, True or False"),
    (dict(mode="blocks", dynamic=0), "dynamic must be None, True or False"),
    (dict(mode="blocks", fullgraph=1), "fullgraph must be True or False"),
    (dict(mode="blocks", fast_compile=None), "fast_compile must be True or False"),
    (dict(mode="blocks", activation_memory_budget="auto", vram_limit_gib=float("inf")), "vram_limit_gib must be a"),
    (dict(mode="blocks", activation_memory_budget="auto", vram_limit_gib=float("nan")), "vram_limit_gib must be a"),
    (dict(mode="blocks", activation_memory_budget="auto", vram_limit_gib=0), "vram_limit_gib must be a"),
    # Finite, but its bytes overflowed auto's int at the first step.
    (dict(mode="blocks", activation_memory_budget="auto", vram_limit_gib=1e300), "vram_limit_gib .* at most 1048576"),
    (dict(mode="blocks", base_compute="int4"), "base_compute must be one of"),
    (dict(mode="blocks", base_compute=8), "base_compute must be one of"),
    (dict(mode="off", base_compute="int8"), "base_compute='int8' applies inside compiled regions"),
]


@pytest.mark.parametrize("fields, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_is_refused_and_changes_nothing(fields: dict, message: str) -> None:
    model, _ = build("kohya", "non-reentrant")
    with pytest.raises(ValueError, match=message):
        compile_accel.apply(model, CompileConfig(**fields))
    _untouched(model, [True, True])


@pytest.mark.parametrize("fields, message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_is_refused_before_the_adapters_rewrite_runs(fields: dict, message: str) -> None:
    model, _ = build("kohya", "non-reentrant")
    rewritten: list[nn.Module] = []

    def rewrite(model: nn.Module) -> Callable[[], None]:
        rewritten.append(model)
        return lambda: None

    with pytest.raises(ValueError, match=message):
        api.apply_adapter(model, CompileConfig(**fields), ModelAdapter(("double_blocks",), rewrite))
    assert rewritten == []
    _untouched(model, [True, True])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


def _model(module: str, name: str, blocks: str) -> nn.Module:
    """An instance of a class `name` defined in `module`, with two blocks at `blocks`: what the
    integrations recognise a model by."""
    model = type(name, (nn.Module,), {"__module__": module})()
    model.add_module(blocks, nn.ModuleList([_Block(), _Block()]))
    return model


APPLY_PATHS = {
    "apply finding the blocks": lambda config: compile_accel.apply(_model("mine", "Model", "blocks"), config),
    "apply with blocks given": lambda config: compile_accel.apply(
        _model("library.sd3_models", "MMDiT", "joint_blocks"), config, ["joint_blocks"]
    ),
    "apply on a model an integration knows": lambda config: compile_accel.apply(
        _model("library.sd3_models", "MMDiT", "joint_blocks"), config
    ),
    "the sd-scripts integration": lambda config: accel_sd_scripts.apply(
        _model("library.sd3_models", "MMDiT", "joint_blocks"), config
    ),
    "the diffusers integration": lambda config: accel_diffusers.apply(
        _model("diffusers.models", "SD3Transformer2DModel", "transformer_blocks"), config
    ),
}


@pytest.mark.parametrize("path", APPLY_PATHS)
def test_every_way_to_apply_checks_the_config_and_the_model_once(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    for name in ("_check_model", "_check_backend"):
        check = getattr(api, name)
        monkeypatch.setattr(api, name, lambda arg, name=name, check=check: checked.append(name) or check(arg))
    validate = CompileConfig.validate
    monkeypatch.setattr(CompileConfig, "validate", lambda config: checked.append("validate") or validate(config))
    acceleration = APPLY_PATHS[path](CompileConfig(mode="blocks", backend="eager"))
    assert sorted(checked) == ["_check_backend", "_check_model", "validate"]
    assert acceleration.stats()["regions"] == 2


def test_unknown_block_path_lists_candidates() -> None:
    model, _ = build("kohya", None)
    with pytest.raises(ValueError, match=r"no submodule 'layers'.*\['double_blocks', 'single_blocks'\]"):
        compile_accel.apply(model, CompileConfig(mode="blocks"), blocks=["layers"])
    with pytest.raises(ValueError, match="not a ModuleList"):
        compile_accel.apply(model, CompileConfig(mode="blocks"), blocks=["img_in"])
    with pytest.raises(ValueError, match="names no block list"):
        compile_accel.apply(model, CompileConfig(mode="blocks"), blocks=[])
    with pytest.raises(ValueError, match="'double_blocks' is given twice"):
        compile_accel.apply(model, CompileConfig(mode="blocks"), blocks=["double_blocks", "double_blocks"])
    with pytest.raises(TypeError, match="takes a CompileConfig, got str"):
        compile_accel.apply(model, "blocks")
    _untouched(model, [False, False])


def test_model_without_repeated_blocks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no repeated blocks"):
        compile_accel.apply(model, CompileConfig(mode="selective"))


def test_model_on_meta_device() -> None:
    with torch.device("meta"):
        model, _ = build("kohya", None)
    with pytest.raises(ValueError, match="meta device"):
        compile_accel.apply(model, CompileConfig(mode="blocks"))


def test_apply_twice_is_an_error() -> None:
    model, _ = build("kohya", None)
    compile_accel.apply(model, CompileConfig(mode="blocks"))
    with pytest.raises(RuntimeError, match="already called"):
        compile_accel.apply(model, CompileConfig(mode="selective"))


def test_blocks_given_as_paths_or_modulelists() -> None:
    model, _ = build("kohya", None)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks"), blocks=[model.single_blocks])
    assert [bl.path for bl in acceleration.block_lists] == ["single_blocks"]
    assert acceleration.stats()["regions"] == 2


def test_in_place_change_of_a_view_input_is_an_error() -> None:
    """Regions get view inputs as plain tensors (no dynamo guard on the base), which autograd
    would not connect to an in-place change; such a change is an error, not a wrong gradient."""

    class Doubling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.mul_(2))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Doubling(), Doubling()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x[:, :4])
            return x

    model = Model()
    compile_accel.apply(model, CompileConfig(mode="blocks", backend="aot_eager"))
    with pytest.raises(RuntimeError, match="changed a view or non-contiguous input in place"):
        model(torch.randn(2, 6, requires_grad=True) * 1)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copied_region_says_the_compiled_regions_stay_with_the_original(how: str) -> None:
    """A region is this process's compile state: pickled (dynamo's saved guards pickle the blocks
    they traced) or deep-copied, it becomes a stand-in that raises when called."""
    model, _ = build()
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks"))
    region = acceleration.regions[0]
    installed = getattr(region.module, region.method)
    copied = pickle.loads(pickle.dumps(installed)) if how == "pickle" else copy.deepcopy(installed)
    with pytest.raises(RuntimeError, match=rf"{re.escape(region.name)} belongs to a copy of an accelerated model"):
        copied(torch.randn(2, 4))
    acceleration.remove()
