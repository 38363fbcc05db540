"""Where a block's frozen weights live while a conductor holds them: their layout in flat byte
buffers, the block's own host copy (the arena a streamed block is copied from), and which
blocks stay on the GPU.

Only frozen parameters move: trainable ones (LoRA) and buffers stay on the GPU, so gradients
and optimizer state never travel. Every parameter of a block sits at a fixed byte offset, a
multiple of ALIGN and never 0, the same for every block of a class: a parameter rebound to a
view (`param.data = view`) keeps its device, dtype, shape, stride and a non-zero storage
offset on every load, so swapping recompiles nothing (a view at offset 0 would let dynamo
specialise the offset).

offload_dtype="int8": the host copy of a streamed frozen weight matrix is per-row symmetric int8
plus an fp32 scale per row (lossy; the bf16 original is dropped), dequantized into the slot on
the GPU (`slots.py`). The weight of a base Linear whose block is compiled with
base_compute="int8" stays in int8 in the slot too ("held"): its layer's parameter is replaced
by an Int8Weight (compile_accel/int8_weight.py) over the slot's int8 values and scales, which
the compiled block multiplies as they are. The bytes kept as they are (weights not quantized,
held ones) come first, at the same offsets in the slot and in the host copy, so that one copy
moves them all out of the staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..base_compute import adopt_weight, multiplied_in_int8
from ..int8 import Int8Matrices, Int8Matrix, quantize_int8, view_bytes
from ..int8_weight import Int8Weight

ALIGN = 16  # bytes; every view starts at a multiple of this and never at offset 0


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class WeightEntry:
    """Where one frozen parameter sits: in the GPU slot, and in the host copy."""

    param: nn.Parameter  # the module's own (a held one's stands aside while the conductor holds it)
    owner: tuple[nn.Module, str]  # the module that registers it, and its name there
    quantized: bool = False
    held: bool = False  # quantized, and kept in int8 on the GPU as `held_as`
    offset: int = 0  # bytes into the slot (held: of the int8 values, as in the host copy)
    host_offset: int = 0  # bytes into the host copy (the int8 values when quantized)
    scale_offset: int = 0  # quantized: bytes into the host copy of the fp32 row scales (held: the slot's too)
    held_as: Int8Weight | None = None  # held: the parameter in the module while attached

    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    def int8_nbytes(self) -> int:
        """Bytes of its int8 values and row scales, each from an aligned offset."""
        return aligned(self.param.numel()) + aligned(self.param.shape[0] * 4)


class BlockWeights:
    """One block's frozen parameters: their layout, where they live, and their views there."""

    def __init__(self, index: int, name: str, module: nn.Module, quantize: bool) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.quantize = quantize  # int8 mode
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        self.others = [p for p in module.parameters() if p.requires_grad] + list(module.buffers())
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for _, sub in module.named_modules(remove_duplicate=False):
            for attribute, p in sub.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append((sub, attribute))
        self.entries = []
        for p in self.frozen:
            quantized = quantize and p.dim() >= 2 and p.is_floating_point() and p.numel() > 0
            # (a parameter registered twice in the block, tied, cannot be replaced in one place)
            held = quantized and p.dim() == 2 and len(owners[id(p)]) == 1 and multiplied_in_int8(p)
            self.entries.append(WeightEntry(p, owners[id(p)][0], quantized, held))
        self.int8: Int8Matrices | None = None  # int8 mode, streamed: how to dequantize the staging buffer
        self.streamed = False
        self.slot: int | None = None
        self._lay_out()
        self.host: torch.Tensor | None = None  # pinned (or pageable) copy, streamed blocks only
        self.home: torch.Tensor | None = None  # GPU buffer of a block that stays resident
        self.device_views: list[torch.Tensor] = []
        self.host_views: list[torch.Tensor] = []
        self.loaded: torch.cuda.Event | None = None  # copy into the slot (int8: staging), not yet waited for

    def stream(self, slot: int) -> None:
        """Make it a streamed block that takes turns in `slot`."""
        self.streamed, self.slot = True, slot
        self._lay_out()

    def _lay_out(self) -> None:
        """Offsets in the slot (a resident block's: its GPU buffer) and in the host copy: first the
        bytes kept as they are (every weight of a resident block), then the dequantized ones."""
        streamed = self.streamed
        offset = ALIGN
        for entry in self.entries:
            if not (streamed and entry.quantized):
                entry.offset = entry.host_offset = offset
                offset = aligned(offset + entry.nbytes())
        for entry in self.entries:
            if streamed and entry.held:
                entry.offset = entry.host_offset = offset
                entry.scale_offset = offset + aligned(entry.param.numel())
                offset += entry.int8_nbytes()
        self.kept_end = host = offset  # bytes copied as they are from the staging buffer
        for entry in self.entries:
            if streamed and entry.quantized and not entry.held:
                entry.offset, offset = offset, aligned(offset + entry.nbytes())
                entry.host_offset = host
                entry.scale_offset = host + aligned(entry.param.numel())
                host += entry.int8_nbytes()
        self.nbytes = offset  # slot bytes
        self.host_nbytes = host

    def bind(self, views: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point the parameters at `views` (a held one's Int8Weight at its values and scales)."""
        for entry, view in zip(self.entries, views, strict=True):
            if entry.held_as is not None:
                entry.held_as.q, entry.held_as.scale = view
            else:
                entry.param.data = view

    def release_held(self) -> None:
        """Put the held parameters back in their modules (their values: the caller's)."""
        for entry in self.entries:
            if entry.held_as is not None:
                setattr(*entry.owner, entry.param)
                adopt_weight(entry.held_as, entry.param)
                entry.held_as = None

    def place(self, device_buffer: torch.Tensor, device: torch.device) -> None:
        """Copy the frozen weights into their new home and point the parameters there: a resident
        block's into `device_buffer` (its `home`), a streamed block's into its host copy, with
        views of `device_buffer` (its slot) for when it is loaded; a held weight's layer gets an
        Int8Weight made on `device` in its parameter's place."""
        self.device_views = [
            _views(device_buffer, e)
            if e.held and self.streamed
            else view_bytes(device_buffer, e.offset, e.param, e.param.dtype)
            for e in self.entries
        ]
        if not self.streamed:
            for entry, view in zip(self.entries, self.device_views, strict=True):
                view.copy_(entry.param.data)
            self.bind(self.device_views)
            return
        if self.quantize:
            matrices = [
                Int8Matrix(e.host_offset, e.scale_offset, e.offset, e.param.shape, e.param.dtype)
                for e in self.entries
                if e.quantized and not e.held
            ]
            self.int8 = Int8Matrices(matrices, device)
        self.host_views = []
        for entry in self.entries:
            p = entry.param
            if entry.quantized:
                q, scale = quantize_int8(p.data)
                host_views = _views(self.host, entry)
                for view, values in zip(host_views, (q, scale)):
                    view.copy_(values)
                # The bf16 original is dropped; while evicted the parameter is an empty placeholder.
                p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)
                if entry.held:
                    entry.held_as = nn.Parameter(Int8Weight(*host_views, p.dtype, device), requires_grad=False)
                    setattr(*entry.owner, entry.held_as)
                    adopt_weight(p, entry.held_as)
                self.host_views.append(host_views if entry.held else p.data)
            else:
                view = view_bytes(self.host, entry.host_offset, p, p.dtype)
                view.copy_(p.data)
                self.host_views.append(view)
        self.bind(self.host_views)


def _views(buffer: torch.Tensor, entry: WeightEntry) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized weight's int8 values and fp32 row scales in `buffer` (its host copy; a held
    one's slot), each with a version counter of its own (`.data`), as a parameter rebound to a
    view has: a compiled block saves them for backward, and copies of other blocks into the slot
    in between must not count as changes (the conductor loads the block again before its backward)."""
    shape = entry.param.shape
    q = view_bytes(buffer, entry.host_offset, shape, torch.int8)
    return q.data, view_bytes(buffer, entry.scale_offset, shape[:1], torch.float32).data


def spread_resident(sizes: list[int], count: int) -> set[int]:
    """Which `count` blocks stay on the GPU: the smallest (fewest bytes), and among blocks of one
    size evenly spread over the execution order, so that copies keep going while they compute."""
    resident: set[int] = set()
    for size in sorted(set(sizes)):
        need = count - len(resident)
        if need <= 0:
            break
        members = [i for i, s in enumerate(sizes) if s == size]
        resident.update(
            members
            if len(members) <= need
            else (members[(2 * k + 1) * len(members) // (2 * need)] for k in range(need))
        )
    return resident
