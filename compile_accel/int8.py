"""Per-row symmetric int8 for streamed frozen weights: quantize once on the host, dequantize on
the GPU every time a block is loaded (twice per training step), so the dequantize is one
memory-bound kernel per matrix: read int8 and a row scale, write the weight's dtype."""

from __future__ import annotations

import functools

import torch


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (dim 0) symmetric int8: (int8 values of weight's shape, fp32 scale per row)."""
    rows = weight.detach().reshape(weight.shape[0], -1).float()
    scale = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(weight.shape), scale


def dequantize_int8_(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """out = q * scale per row, computed in fp32 and rounded once into out's dtype. out, q and
    scale are contiguous."""
    rows = out.shape[0]
    if out.is_cuda and out.numel():
        # torch.mul with mixed dtypes and a broadcast row scale runs far below memory speed
        # (in a profile of a Flux step it was the largest cost int8 added to the compute stream).
        n = out.numel()
        _dequantize_kernel()[((n + _BLOCK - 1) // _BLOCK,)](q, scale, out, n, n // rows, BLOCK=_BLOCK)
    else:
        torch.mul(q.reshape(rows, -1), scale[:, None], out=out.view(rows, -1))
    return out


_BLOCK = 4096  # elements per program


@functools.cache
def _dequantize_kernel():
    """Built on first use: CPU-only installs have no Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def dequantize(q_ptr, scale_ptr, out_ptr, n, columns, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        q = tl.load(q_ptr + offsets, mask=mask).to(tl.float32)
        scale = tl.load(scale_ptr + offsets // columns, mask=mask)
        tl.store(out_ptr + offsets, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)

    return dequantize
