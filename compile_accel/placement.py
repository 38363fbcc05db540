"""Model-parallel placement of a model's blocks across devices (e.g. two consumer GPUs).

`split_blocks(model, ["cuda:0", "cuda:1"])` puts the blocks before the split point on the
first device and the rest on the second (the split balances parameter bytes unless given),
everything else on the first device. Tensors cross devices at module boundaries, in hooks
that run outside compiled code: each block's inputs (and every tensor the model's loop passes
to it: timestep embedding, rotary tables, masks) are moved to the block's device before it
runs, and the outputs of the last block of each block list go back to the first device for
the model code that follows. A compiled block class gets one graph per device.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .blocks import resolve_block_lists


def to_device(value: Any, device: torch.device) -> Any:
    """`value` with every tensor in it (through tuples, lists and dicts) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def balanced_split(sizes: Sequence[int], parts: int) -> list[int]:
    """Indices where each part after the first starts, so the parts' sums are as equal as a
    cut between items allows."""
    total, cuts, running = sum(sizes), [], list(itertools.accumulate(sizes))
    for k in range(1, parts):
        target = total * k / parts
        cut = min(range(1, len(sizes)), key=lambda i: abs(running[i - 1] - target))
        cuts.append(max(cut, cuts[-1] + 1 if cuts else 1))
    return cuts


@dataclass
class BlockPlacement:
    """Where each block went, and the hooks that move tensors; `remove()` puts it all back."""

    devices: list[torch.device]
    block_devices: dict[str, torch.device]
    original_device: torch.device
    model: nn.Module
    handles: list[RemovableHandle] = field(default_factory=list)
    delegates: list[nn.Module] = field(default_factory=list)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for module in [self.model, *self.delegates]:
            module.to(self.original_device)


def _delegates(block: nn.Module) -> list[nn.Module]:
    """Modules outside `block` that its submodules hand their forward to (kohya-style LoRA
    replaces a Linear's forward with a bound method of a LoRA module kept outside the model):
    they must sit on the block's device too."""
    inside = {id(m) for m in block.modules()}
    forwards = (inspect.unwrap(m.__dict__["forward"]) for m in block.modules() if "forward" in m.__dict__)
    owners = (getattr(forward, "__self__", None) for forward in forwards)  # through compiled regions
    return [o for o in owners if isinstance(o, nn.Module) and id(o) not in inside]


def _check_devices(devices: Sequence[torch.device | str]) -> list[torch.device]:
    devices = [torch.device(d) for d in devices]
    if len(devices) < 2:
        raise ValueError(f"split_blocks needs two or more devices, got {devices}")
    for device in devices:
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{device} is not visible (this process sees {torch.cuda.device_count()} CUDA devices)")
    return devices


def split_blocks(
    model: nn.Module,
    devices: Sequence[torch.device | str],
    split: Sequence[int] | None = None,
    blocks: Sequence[str | nn.ModuleList] | None = None,
) -> BlockPlacement:
    """Place `model`'s blocks across `devices` (in execution order) and install the hooks that
    move tensors between them. split: the index (over all blocks, in order) where each device
    after the first starts; None balances parameter bytes. Raises before moving anything."""
    devices = _check_devices(devices)
    named = [(bl, name, block) for bl in resolve_block_lists(model, blocks) for name, block in bl.named_blocks()]
    cuts = list(split) if split is not None else balanced_split([_bytes(b) for _, _, b in named], len(devices))
    if len(cuts) != len(devices) - 1 or cuts != sorted(cuts) or not all(0 < c < len(named) for c in cuts):
        raise ValueError(
            f"split must give {len(devices) - 1} increasing block indices in 1..{len(named) - 1}, got {list(cuts)}"
        )
    original = next(model.parameters()).device
    model.to(devices[0])
    placement = BlockPlacement(devices, {}, original, model)
    for index, (block_list, name, block) in enumerate(named):
        device = devices[sum(index >= c for c in cuts)]
        block.to(device)
        for delegate in _delegates(block):
            delegate.to(device)
            placement.delegates.append(delegate)
        placement.block_devices[name] = device
        placement.handles.append(block.register_forward_pre_hook(_inputs_to(device), with_kwargs=True))
        if block is block_list.blocks[-1]:
            placement.handles.append(block.register_forward_hook(_outputs_to(devices[0])))
    return placement


def _inputs_to(device: torch.device):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return to_device(args, device), to_device(kwargs, device)

    return hook


def _outputs_to(device: torch.device):
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return to_device(output, device)

    return hook
