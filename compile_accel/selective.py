"""Which modules become compiled regions: whole blocks, or the compute children of each block."""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch.nn as nn

from .blocks import BlockList

# Children with no compute worth a graph.
_TRIVIAL = (nn.Identity, nn.Dropout)


def is_excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def compute_children(name: str, block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The direct children of a block that do its compute (attention, feed-forward, norms,
    modulation); containers are looked into, dropout and identities skipped. So are children
    without a forward of their own (sd-scripts' SD3 blocks call methods of such halves, never
    their forward), whose own children are the regions instead."""
    children = []
    for child_name, child in block.named_children():
        qualified = f"{name}.{child_name}"
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or type(child).forward is nn.Module.forward:
            children.extend(compute_children(qualified, child))
        elif not isinstance(child, _TRIVIAL):
            children.append((qualified, child))
    return children


def region_modules(mode: str, block_lists: list[BlockList], exclude: list[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every region for `mode`, minus the excluded ones."""
    blocks = [nb for bl in block_lists for nb in bl.named_blocks()]
    if mode == "blocks":
        regions = blocks
    elif mode == "selective":
        regions = [child for name, block in blocks for child in compute_children(name, block)]
    else:
        regions = []
    return [(name, module) for name, module in regions if not is_excluded(name, exclude)]
