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
the GPU (`slots.py`). The weights kept as they are come first, at the same offsets in the slot
and in the host copy, so that one copy moves them all out of the staging buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..int8 import Int8Matrices, Int8Matrix, quantize_int8, view_bytes

ALIGN = 16  # bytes; every view starts at a multiple of this and never at offset 0


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class WeightEntry:
    """Where one frozen parameter sits: in the GPU slot, and in the host copy."""

    param: nn.Parameter
    offset: int  # bytes into the slot
    quantized: bool = False
    host_offset: int = 0  # bytes into the host copy (the int8 values when quantized)
    scale_offset: int = 0  # quantized: bytes into the host copy of the fp32 row scales

    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()


class BlockWeights:
    """One block's frozen parameters: their layout, where they live, and their views there."""

    def __init__(self, index: int, name: str, module: nn.Module, quantize: bool) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.quantize = quantize  # int8 mode
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        self.others = [p for p in module.parameters() if p.requires_grad] + list(module.buffers())
        self.entries = [
            WeightEntry(p, 0, quantize and p.dim() >= 2 and p.is_floating_point() and p.numel() > 0)
            for p in self.frozen
        ]
        offset = ALIGN
        for entry in (e for e in self.entries if not e.quantized):
            entry.offset = entry.host_offset = offset
            offset = aligned(offset + entry.nbytes())
        self.unquantized_end = host = offset
        for entry in (e for e in self.entries if e.quantized):
            entry.offset, offset = offset, aligned(offset + entry.nbytes())
            entry.host_offset, host = host, aligned(host + entry.param.numel())
            entry.scale_offset, host = host, aligned(host + entry.param.shape[0] * 4)
        self.nbytes = offset  # slot bytes
        self.host_nbytes = host
        self.int8: Int8Matrices | None = None  # int8 mode, streamed: how to dequantize the staging buffer
        self.streamed = False
        self.slot: int | None = None
        self.host: torch.Tensor | None = None  # pinned (or pageable) copy, streamed blocks only
        self.home: torch.Tensor | None = None  # GPU buffer of a block that stays resident
        self.device_views: list[torch.Tensor] = []
        self.host_views: list[torch.Tensor] = []
        self.loaded: torch.cuda.Event | None = None  # copy into the slot (int8: staging), not yet waited for

    def bind(self, views: list[torch.Tensor]) -> None:
        for entry, view in zip(self.entries, views, strict=True):
            entry.param.data = view

    def place(self, device_buffer: torch.Tensor, device: torch.device) -> None:
        """Copy the frozen weights into their new home and point the parameters there: a resident
        block's into `device_buffer` (its `home`), a streamed block's into its host copy, with
        views of `device_buffer` (its slot) for when it is loaded."""
        self.device_views = [view_bytes(device_buffer, e.offset, e.param, e.param.dtype) for e in self.entries]
        if not self.streamed:
            for entry, view in zip(self.entries, self.device_views, strict=True):
                view.copy_(entry.param.data)
            self.bind(self.device_views)
            return
        if self.quantize:
            matrices = [
                Int8Matrix(e.host_offset, e.scale_offset, e.offset, e.param.shape, e.param.dtype)
                for e in self.entries
                if e.quantized
            ]
            self.int8 = Int8Matrices(matrices, device)
        self.host_views = []
        for entry in self.entries:
            p = entry.param
            if entry.quantized:
                q, scale = quantize_int8(p.data)
                view_bytes(self.host, entry.host_offset, q, torch.int8).copy_(q)
                view_bytes(self.host, entry.scale_offset, scale, torch.float32).copy_(scale)
                # The bf16 original is dropped; while evicted the parameter is an empty placeholder.
                self.host_views.append(torch.zeros((), dtype=p.dtype).expand(p.shape))
            else:
                view = view_bytes(self.host, entry.host_offset, p, p.dtype)
                view.copy_(p.data)
                self.host_views.append(view)
        self.bind(self.host_views)


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
