"""Rotary embeddings in real arithmetic, for models that apply them in complex numbers.

Inductor has no code generation for complex operators, so a block that multiplies by
complex rotary factors (Lumina 2, Qwen-Image, sd-scripts' NextDiT) cannot become one fused
graph. A table of complex factors e^(i angle) is stored instead as its real view
(..., pairs, 2) = (cos, sin), and the rotation of each interleaved pair (a, b) is written out:
(a cos - b sin, a sin + b cos), which equals view_as_real(view_as_complex(x) * e^(i angle)).
"""

from __future__ import annotations

import torch


def real_table(freqs_cis: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., pairs) complex factors -> (..., pairs, 2) real (cos, sin), in `dtype`."""
    return torch.view_as_real(freqs_cis).to(dtype)


def rotate_interleaved(x: torch.Tensor, table: torch.Tensor, head_axis: int) -> torch.Tensor:
    """Rotate interleaved pairs of `x`'s last dim by `table` (from `real_table`).

    `table` lacks `x`'s head axis: a size-1 axis is inserted into the table at `head_axis`
    (where the complex formulation unsqueezes its factors), and it broadcasts from the right.
    Computed in float32, returned in x's dtype, like the complex formulation.
    """
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    table = table.unsqueeze(head_axis)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = table[..., 0], table[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)
