"""Block discovery: the repeated transformer blocks a model loops over."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch.nn as nn


@dataclass(frozen=True)
class BlockList:
    """One list of repeated blocks and where it sits in the model."""

    path: str
    blocks: nn.ModuleList

    def named_blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"{self.path}.{i}", block) for i, block in enumerate(self.blocks)]


def _is_repeated(modules: nn.ModuleList) -> bool:
    return len(modules) >= 2 and len({type(m) for m in modules}) == 1


def _outermost(lists: list[BlockList]) -> list[BlockList]:
    """Drop lists nested inside another list's blocks (e.g. a pair of Linears inside each block)."""
    paths = [bl.path for bl in lists]
    return [bl for bl in lists if not any(bl.path.startswith(p + ".") for p in paths if p != bl.path)]


def find_block_lists(model: nn.Module) -> list[BlockList]:
    """ModuleLists of two or more modules of one class, outermost first in model order.

    Where the model names its blocks (diffusers' `_repeated_blocks`, else `_no_split_modules`),
    only lists of those classes count, so embedders that happen to repeat are left alone.
    """
    lists = _outermost(
        [BlockList(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and _is_repeated(m)]
    )
    for hint in ("_repeated_blocks", "_no_split_modules"):
        names = set(getattr(model, hint, None) or ())
        named = [bl for bl in lists if type(bl.blocks[0]).__name__ in names]
        if named:
            return named
    return lists


# diffusers-style U-Nets (diffusers' UNet2DConditionModel, sd-scripts' SD1/SD2 copy of it): the
# ResBlocks, transformers and resamplers of each down, mid and up block, as globs for
# match_block_lists.
UNET_BLOCK_LISTS = ("*.resnets", "*.attentions", "*.downsamplers", "*.upsamplers")


def match_block_lists(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Paths of the ModuleLists whose names match a glob pattern, outermost only (a `*` also
    matches dots, so `input_blocks.*` would match lists inside those blocks too), in model order."""
    matched = [
        BlockList(name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and any(fnmatchcase(name, p) for p in patterns)
    ]
    return [bl.path for bl in _outermost(matched)]


def resolve_block_lists(model: nn.Module, spec: Sequence[str | nn.ModuleList] | None) -> list[BlockList]:
    """Turn `apply(..., blocks=...)` into BlockLists; raise ValueError naming what was wrong."""
    found = find_block_lists(model)
    if spec is None:
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no repeated blocks (no ModuleList of two or more modules of one class); "
                "name them: apply(model, config, blocks=[...]) takes their attribute paths, "
                "BlockOffloadConductor.attach() a ModuleList or a list of blocks"
            )
        return found
    if isinstance(spec, (str, nn.ModuleList)):
        spec = [spec]
    if len(spec) == 0:
        raise ValueError("blocks=[] names no block list; pass None to find the repeated blocks")
    candidates = [bl.path for bl in found]
    path_of = {id(m): name for name, m in model.named_modules()}
    resolved = []
    for item in spec:
        if isinstance(item, nn.ModuleList):
            if id(item) not in path_of:
                raise ValueError(f"blocks: a ModuleList given is not a submodule of {type(model).__name__}")
            path, modules = path_of[id(item)], item
        elif isinstance(item, str):
            try:
                modules = model.get_submodule(item)
            except AttributeError:
                raise ValueError(
                    f"blocks: {type(model).__name__} has no submodule {item!r}; repeated block lists found: {candidates}"
                ) from None
            path = item
            if not isinstance(modules, nn.ModuleList):
                raise ValueError(
                    f"blocks: {item!r} is a {type(modules).__name__}, not a ModuleList; "
                    f"repeated block lists found: {candidates}"
                )
        else:
            raise ValueError(f"blocks: entries must be attribute paths or ModuleLists, got {type(item).__name__}")
        if len(modules) == 0:
            raise ValueError(f"blocks: {path!r} is empty")
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError(f"blocks: {path!r} holds the same module more than once")
        if any(bl.path == path for bl in resolved):
            raise ValueError(f"blocks: {path!r} is given twice")
        resolved.append(BlockList(path, modules))
    return resolved
