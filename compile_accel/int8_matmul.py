"""int8 matrix products with their scales applied in the same kernel: `scaled_int8_mm`.

out = (a · bᵀ) * a_scale[:, None] * b_scale[None, :] (+ bias), for int8 a (m x k) and b (n x k),
each quantized per row with an fp32 scale. On CUDA one Triton kernel multiplies in int8 with
int32 accumulation and applies the scales, the bias and the output dtype before it stores: the
product never goes to memory as int32 (`torch._int_mm` writes 4 bytes per element and three more
kernels read it back, which took most of what int8 gained). Elsewhere (CPUs: a path for tests and
correctness, not speed) and without Triton it is `torch._int_mm` and torch ops.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from .stats import warn

# torch._int_mm on CUDA (the path without Triton): more than 16 rows, inner and outer sizes
# multiples of 8.
CUDA_INT_MM_MIN_ROWS = 17


def _scaled_int8_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(a · bᵀ) * a_scale[:, None] * b_scale[None, :] + bias, in out_dtype: a (m x k) and b (n x k)
    int8, a_scale (m) and b_scale (n) fp32, bias (n) of any floating dtype or None.

    A triton_op: in a compiled graph inductor launches the kernel from its generated code. An
    opaque custom op costs ~0.2 ms of host time per call, more than the kernel's time at SD3's
    sizes on 24 SMs (a 4090's)."""
    a, b = a.contiguous(), b.contiguous()
    kernel = _kernel() if a.is_cuda else None
    m, k = a.shape
    if kernel is None:  # torch._int_mm, then the scales and bias as torch ops
        if a.is_cuda and m < CUDA_INT_MM_MIN_ROWS:  # zero rows, dropped below
            a = torch.nn.functional.pad(a, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - m))
        products = torch._int_mm(a, b.t())[:m].float() * a_scale[:, None] * b_scale[None, :]
        return (products if bias is None else products + bias.float()).to(out_dtype)
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = lambda meta: (_cdiv(m, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    torch.library.wrap_triton(kernel)[grid](
        a, b, a_scale, b_scale, bias if bias is not None else a_scale, out, m, n, k, HAS_BIAS=bias is not None
    )
    return out


# torch logs "Triton not available" as it registers a triton_op where Triton is missing (CPU-only
# installs, which take the torch path); that says nothing to our users.
_registration_log = logging.getLogger("torch._library.triton")
_level = _registration_log.level
_registration_log.setLevel(logging.ERROR)
try:
    scaled_int8_mm = torch.library.triton_op("compile_accel::scaled_int8_mm", _scaled_int8_mm, mutates_args=())
finally:
    _registration_log.setLevel(_level)


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


# Tiles for Ada and Hopper with int8 operands.
_CONFIGS = [
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 128, 128, 8, 3),
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3),
    (128, 128, 64, 4, 4),
    (64, 128, 128, 4, 4),
    (128, 64, 128, 4, 4),
    (64, 64, 128, 4, 3),
]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path
    triton = None

# At module level: torch's precompiled graphs (compile_accel.precompile) find a Triton kernel
# again by its module and name, so a kernel made inside a function is not found at the next start.
scaled_int8_mm_kernel = None
if triton is not None:

    # Tuned once per (n, k), a weight's shape; the row count changes with every aspect-ratio bucket.
    @triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in _CONFIGS
        ],
        key=["n", "k"],
    )
    @triton.jit
    def scaled_int8_mm_kernel(
        a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr,
        m, n, k,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # Program ids in groups of GROUP_M row tiles, so that neighbouring programs share b's tiles in L2.
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
        tile_n = (pid % (GROUP_M * tiles_n)) // group_rows

        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        inner = tl.arange(0, BLOCK_K)
        # Both operands are k-contiguous (a's rows, b's rows), the layout int8 tensor cores take.
        a_tile = a_ptr + (rows % m)[:, None].to(tl.int64) * k + inner[None, :]
        b_tile = b_ptr + (columns % n)[None, :].to(tl.int64) * k + inner[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for step in range(0, tl.cdiv(k, BLOCK_K)):
            left = k - step * BLOCK_K
            a = tl.load(a_tile, mask=inner[None, :] < left, other=0)
            b = tl.load(b_tile, mask=inner[:, None] < left, other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_tile += BLOCK_K
            b_tile += BLOCK_K

        row_mask, column_mask = rows < m, columns < n
        a_scale = tl.load(a_scale_ptr + rows, mask=row_mask, other=0.0)
        b_scale = tl.load(b_scale_ptr + columns, mask=column_mask, other=0.0)
        out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + columns, mask=column_mask, other=0.0).to(tl.float32)[None, :]
        out_tile = out_ptr + rows[:, None].to(tl.int64) * n + columns[None, :]
        tl.store(out_tile, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & column_mask[None, :])


@functools.cache
def _kernel():
    """The Triton kernel; None without Triton (CPU-only installs), warned about once."""
    if scaled_int8_mm_kernel is None:
        warn(
            "Triton is not installed: int8 base matmuls run as torch._int_mm and separate scale kernels, "
            f"which is much slower (pip install {'triton-windows' if sys.platform == 'win32' else 'triton'})"
        )
    return scaled_int8_mm_kernel
