"""ModelAdapter: what compile_accel knows about one model class, one type for every integration.

The integrations keep a dict of them by class name (`integrations.diffusers.ADAPTERS`,
`integrations.sd_scripts.FAMILIES`); `compile_accel.apply` and each integration's `apply`
hand one to `compile_accel.api.apply_adapter`. An adapter holds knowledge of the model only:
the config, and every check of it, stays with `apply`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from .auto_budget import OffloadLadder
from .blocks import match_block_lists

Undo = Callable[[], None]
# (model, device, on_remove) -> a ladder for auto to climb: see ModelAdapter.offload_ladder.
ModelOffloadLadder = Callable[[nn.Module, torch.device, Callable[[Undo], None]], OffloadLadder]


class UnknownLayout(ValueError):
    """A model of a class an adapter knows has none of the block lists the adapter names: its
    library moved them (the sd-scripts launcher reports this as an unknown sd-scripts layout)."""


@dataclass(frozen=True)
class ModelAdapter:
    """Where one model class keeps its blocks, and what else compiling it needs.

    blocks: glob patterns of the block lists' paths (match_block_lists).
    prepare: rewrites the model so that its blocks compile whole (complex rotary factors in
        real arithmetic, say) and returns the undo; it runs only when something compiles.
    offload_ladder: the model's own way of keeping blocks off the GPU (sd-scripts' block swap),
        called with (model, device, on_remove: registers an undo for Acceleration.remove) as the
        ladder activation_memory_budget="auto" climbs when no budget fits; None: that of a
        BlockOffloadConductor holding the blocks.
    static_shapes: the model's blocks run at a few fixed sizes each (a U-Net's levels), so that
        where CompileConfig.dynamic is None their graphs compile per size (dynamic=False).
    """

    blocks: tuple[str, ...]
    prepare: Callable[[nn.Module], Undo] | None = None
    offload_ladder: ModelOffloadLadder | None = None
    static_shapes: bool = False

    def block_paths(self, model: nn.Module) -> list[str]:
        """The paths of `model`'s block lists; UnknownLayout when none matches."""
        paths = match_block_lists(model, self.blocks)
        if not paths:
            raise UnknownLayout(f"{type(model).__name__} has no ModuleList matching {list(self.blocks)}")
        return paths
