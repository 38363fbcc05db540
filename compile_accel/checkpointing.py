"""Switching a model's own gradient checkpointing off for blocks that get a memory budget.

A checkpoint inside (or around) a budgeted block makes the partitioner's choice moot: it
discards every activation and recomputes the whole block. Trainers switch checkpointing with
a `gradient_checkpointing` flag, either on each block (kohya sd-scripts' mixins) or on the
module that loops over the blocks (diffusers models); both are turned off here and put back
by `Acceleration.remove()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

logger = logging.getLogger("compile_accel")


@dataclass
class CheckpointSwitch:
    name: str
    module: nn.Module

    def turn_off(self) -> None:
        self.module.gradient_checkpointing = False

    def restore(self) -> None:
        self.module.gradient_checkpointing = True


def _ancestors(model: nn.Module, path: str) -> list[tuple[str, str, nn.Module]]:
    """(path, display name, module) of every module above `path`, the model first."""
    parts = path.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts))]
    return [(prefix, prefix or type(model).__name__, model.get_submodule(prefix)) for prefix in prefixes]


def find_checkpoint_switches(
    model: nn.Module, units: list[str], compiled: set[str]
) -> tuple[list[CheckpointSwitch], list[str]]:
    """The `gradient_checkpointing` flags that are True on a compiled region's module (its path
    in `compiled`), on a module inside it, or on a module above it; and the regions `units`
    holds that are left uncompiled below one of those flags, which lose their checkpointing
    with it."""
    switches: dict[int, CheckpointSwitch] = {}
    above: set[str] = set()  # paths of the switched modules above compiled regions
    for unit in (u for u in units if u in compiled):
        for path, name, module in _ancestors(model, unit):
            if getattr(module, "gradient_checkpointing", None) is True:
                switches.setdefault(id(module), CheckpointSwitch(name, module))
                above.add(path)
        # The region's own flag, or one inside it (diffusers' Transformer2DModel checkpoints
        # each of its transformer blocks).
        for name, module in model.get_submodule(unit).named_modules(prefix=unit):
            if getattr(module, "gradient_checkpointing", None) is True:
                switches.setdefault(id(module), CheckpointSwitch(name, module))
    uncompiled = [u for u in units if u not in compiled and any(p == "" or u.startswith(p + ".") for p in above)]
    return list(switches.values()), uncompiled


def turn_off(switches: list[CheckpointSwitch]) -> None:
    for switch in switches:
        switch.turn_off()
    if switches:
        logger.info(
            "activation memory budget replaces checkpointing: turned gradient_checkpointing off on %s",
            ", ".join(s.name for s in switches),
        )


def under_saved_tensor_checkpoint() -> bool:
    """True inside a non-reentrant torch.utils.checkpoint region (its saved-tensor hooks are on)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = hooks[0] if hooks else None
    return pack is not None and "checkpoint" in getattr(pack, "__module__", "")
