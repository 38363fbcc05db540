"""Per-row symmetric int8 for streamed frozen weights: quantize once on the host, dequantize on
the GPU every time a block is loaded (twice per training step), so the dequantize is
memory-bound kernel work: read int8 and a row scale, write the weight's dtype. A block's
matrices are dequantized by one kernel launch (`Int8Matrices`): the host time of a launch per
matrix exceeds the copy engine's time per block (benchmarks/results/h200_flux_offload/README.md)."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch

from .stats import warn


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (dim 0) symmetric int8: (int8 values of weight's shape, fp32 scale per row)."""
    rows = weight.detach().reshape(weight.shape[0], -1).float()
    scale = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(weight.shape), scale


def dequantize_int8_(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """out = q * scale per row (dim 0), computed in fp32 and rounded once into out's dtype.
    out (floating point), q (int8, out's shape) and scale (fp32, one per row) are contiguous.
    Plain torch ops, on any device: the reference for `Int8Matrices`' kernel, and its fallback."""
    tensors = (out, q, scale)
    if out.dim() == 0 or q.shape != out.shape or scale.shape != out.shape[:1]:
        raise ValueError(
            "dequantize_int8_ needs q of out's shape and one scale per row, got "
            + ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(("out", "q", "scale"), tensors))
        )
    if q.dtype != torch.int8 or scale.dtype != torch.float32 or not out.is_floating_point():
        raise ValueError(
            f"dequantize_int8_ needs int8 q, fp32 scale, floating out; got {q.dtype}, {scale.dtype}, {out.dtype}"
        )
    if not all(t.is_contiguous() for t in tensors) or len({t.device for t in tensors}) > 1:
        raise ValueError("dequantize_int8_ needs out, q and scale contiguous and on one device")
    rows = out.shape[0]
    torch.mul(q.reshape(rows, -1), scale[:, None], out=out.view(rows, -1))
    return out


def view_bytes(buffer: torch.Tensor, offset: int, like: torch.Tensor | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of a flat uint8 `buffer` from `offset` on, as a contiguous tensor of `like`'s
    shape (a tensor or a size) and `dtype`."""
    shape = like.shape if isinstance(like, torch.Tensor) else like
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


@dataclass(frozen=True)
class Int8Matrix:
    """One quantized matrix inside byte buffers: int8 values and fp32 row scales in the staging
    buffer, the dequantized values in the output buffer (offsets in bytes, each a multiple of 16)."""

    q_offset: int
    scale_offset: int
    out_offset: int
    shape: torch.Size
    dtype: torch.dtype


class Int8Matrices:
    """Dequantizes a fixed set of matrices from a staging buffer into an output buffer (both flat
    uint8, sized in multiples of 16 bytes): on CUDA one Triton launch per output dtype and kind of
    row, elsewhere the matrices one by one with torch ops."""

    def __init__(self, matrices: list[Int8Matrix], device: torch.device) -> None:
        self.matrices = matrices
        # Per launch: output dtype, whether every row is whole 16-element runs, the programs
        # along the tallest matrix, and an int32 table with a row (rows, columns, q offset, scale
        # offset, out offset) per matrix, offsets in elements of their buffer.
        self.launches: list[tuple[torch.dtype, bool, int, torch.Tensor]] = []
        if device.type != "cuda":
            return
        groups: dict[tuple[torch.dtype, bool], list[tuple[int, ...]]] = {}
        for m in matrices:
            if (m.q_offset | m.scale_offset | m.out_offset) % 16:
                raise ValueError(f"Int8Matrices: offsets must be multiples of 16 bytes, got {m}")
            rows, columns = m.shape[0], m.shape.numel() // m.shape[0]
            ends = (
                m.q_offset + rows * columns,
                m.scale_offset // 4 + rows,
                m.out_offset // m.dtype.itemsize + rows * columns,
            )
            if max(ends) >= 2**31:  # the kernel indexes in int32
                raise ValueError("Int8Matrices: buffers of 2**31 elements or more are not supported")
            row = (rows, columns, m.q_offset, m.scale_offset // 4, m.out_offset // m.dtype.itemsize)
            groups.setdefault((m.dtype, columns % 16 == 0), []).append(row)
        for (dtype, rows_of_16), table in groups.items():
            programs = -(-max(rows for rows, *_ in table) // _ROWS)
            self.launches.append((dtype, rows_of_16, programs, torch.tensor(table, dtype=torch.int32, device=device)))

    def __call__(self, staging: torch.Tensor, out: torch.Tensor) -> None:
        kernel = _dequantize_kernel() if out.is_cuda and self.launches else None
        if kernel is None:
            for m in self.matrices:
                dequantize_int8_(
                    view_bytes(out, m.out_offset, m.shape, m.dtype),
                    view_bytes(staging, m.q_offset, m.shape, torch.int8),
                    view_bytes(staging, m.scale_offset, m.shape[:1], torch.float32),
                )
            return
        q, scales = staging.view(torch.int8), staging.view(torch.float32)
        with torch.cuda.device(out.device):
            for dtype, rows_of_16, programs, table in self.launches:
                kernel[(programs, len(table))](
                    q,
                    scales,
                    out.view(dtype),
                    table,
                    ROWS=_ROWS,
                    COLUMNS=_COLUMNS,
                    ROWS_OF_16=rows_of_16,
                    OUT_VECTOR=16 // dtype.itemsize,
                )


_ROWS, _COLUMNS = 8, 1024  # the tile a program dequantizes per step along its rows (tuned on an H200)


@functools.cache
def _dequantize_kernel():
    """`Int8Matrices`' kernel, built on first use: program (i, m) dequantizes rows
    [i * ROWS, (i + 1) * ROWS) of matrix m, a tile of COLUMNS at a time (each row's scale is
    loaded once); programs past a matrix's last row do nothing. None without Triton (CPU-only
    installs, some Windows builds)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        warn(
            "Triton is not installed: int8 weights are dequantized with torch ops, one matrix at a time, "
            f"which is much slower (pip install {'triton-windows' if sys.platform == 'win32' else 'triton'})"
        )
        return None

    @triton.jit
    def dequantize_rows(
        q_ptr,
        scale_ptr,
        out_ptr,
        table_ptr,
        ROWS: tl.constexpr,
        COLUMNS: tl.constexpr,
        ROWS_OF_16: tl.constexpr,
        OUT_VECTOR: tl.constexpr,
    ):
        entry = table_ptr + tl.program_id(1) * 5
        rows, columns = tl.load(entry), tl.load(entry + 1)
        if tl.program_id(0) * ROWS >= rows:
            return
        # Every matrix starts at a multiple of 16 bytes (checked when the table is built); with rows
        # of whole 16-element runs every row does too, so loads and stores can move 16 bytes.
        q_start = tl.multiple_of(tl.load(entry + 2), 16)
        scale_start = tl.load(entry + 3)
        out_start = tl.multiple_of(tl.load(entry + 4), OUT_VECTOR)  # 16 bytes of out's dtype
        if ROWS_OF_16:
            columns = tl.multiple_of(columns, 16)
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_mask = row < rows
        scale = tl.load(scale_ptr + scale_start + row, mask=row_mask)[:, None]
        row_start = row[:, None] * columns
        for start in range(0, columns, COLUMNS):
            column = start + tl.arange(0, COLUMNS)[None, :]
            mask = row_mask[:, None] & (column < columns)
            q = tl.load(q_ptr + q_start + row_start + column, mask=mask).to(tl.float32)
            tl.store(out_ptr + out_start + row_start + column, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)

    return dequantize_rows
