"""A small Flux-style DiT with what makes real ones hard to compile.

Double-stream blocks (image and text streams, joint attention) and single-stream blocks,
RMSNorm, adaLN modulation, complex-valued RoPE (as Lumina 2 and Qwen-Image compute it),
a text padding mask, and a trainer-style checkpoint mixin (reentrant or not) on every block.
The rotary module is the only place with complex arithmetic; `COMPILE_EXCLUDE` names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# What an adapter leaves eager in this model: inductor has no code generation for complex ops.
COMPILE_EXCLUDE = ["*.rope"]


@dataclass
class TinyDiTConfig:
    in_channels: int = 4
    patch: int = 2
    dim: int = 64
    heads: int = 4
    text_dim: int = 48
    double_blocks: int = 2
    single_blocks: int = 2
    mlp_ratio: float = 2.0
    rope: str = "complex"  # or "real": the same rotation in real arithmetic


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Modulation(nn.Module):
    """adaLN: shift/scale/gate triples from the conditioning vector."""

    def __init__(self, dim: int, triples: int) -> None:
        super().__init__()
        self.triples = triples
        self.lin = nn.Linear(dim, 3 * triples * dim)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(3 * self.triples, dim=-1)


class QKVProjection(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = RMSNorm(dim // heads)
        self.k_norm = RMSNorm(dim // heads)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.q_norm(q), self.k_norm(k), v


class ComplexRotary(nn.Module):
    """Rotary embedding in complex arithmetic (the Lumina 2 / Qwen-Image formulation)."""

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis).flatten(-2).type_as(x)


class RealRotary(nn.Module):
    """ComplexRotary's rotation in real arithmetic (Flux's formulation): each interleaved pair
    times a 2x2 rotation matrix [[cos, -sin], [sin, cos]]."""

    def forward(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
        return (rotation[..., 0] * pairs[..., 0] + rotation[..., 1] * pairs[..., 1]).flatten(-2).type_as(x)


ROTARY = {"complex": ComplexRotary, "real": RealRotary}


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


class CheckpointMixin(nn.Module):
    """The way trainers checkpoint blocks: a flag on the block, `_forward` under checkpoint."""

    gradient_checkpointing = False
    checkpoint_reentrant = False

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.training and self.gradient_checkpointing:
            return checkpoint(self._forward, *args, use_reentrant=self.checkpoint_reentrant)
        return self._forward(*args)


class DoubleStreamBlock(CheckpointMixin):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, rope: str) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.img_mod, self.txt_mod = Modulation(dim, 2), Modulation(dim, 2)
        self.img_norm1, self.txt_norm1 = RMSNorm(dim), RMSNorm(dim)
        self.img_qkv, self.txt_qkv = QKVProjection(dim, heads), QKVProjection(dim, heads)
        self.rope = ROTARY[rope]()
        self.img_out, self.txt_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.img_norm2, self.txt_norm2 = RMSNorm(dim), RMSNorm(dim)
        self.img_mlp, self.txt_mlp = FeedForward(dim, hidden), FeedForward(dim, hidden)

    def _forward(
        self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = self.img_mod(vec)
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt_mod(vec)
        iq, ik, iv = self.img_qkv(self.img_norm1(img) * (1 + i_scale1) + i_shift1)
        tq, tk, tv = self.txt_qkv(self.txt_norm1(txt) * (1 + t_scale1) + t_shift1)
        q = self.rope(torch.cat([tq, iq], dim=2), freqs_cis)
        k = self.rope(torch.cat([tk, ik], dim=2), freqs_cis)
        attn = _attention(q, k, torch.cat([tv, iv], dim=2), mask)
        n_txt = txt.shape[1]
        txt = txt + t_gate1 * self.txt_out(attn[:, :n_txt])
        img = img + i_gate1 * self.img_out(attn[:, n_txt:])
        img = img + i_gate2 * self.img_mlp(self.img_norm2(img) * (1 + i_scale2) + i_shift2)
        txt = txt + t_gate2 * self.txt_mlp(self.txt_norm2(txt) * (1 + t_scale2) + t_shift2)
        return img, txt


class SingleStreamBlock(CheckpointMixin):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, rope: str) -> None:
        super().__init__()
        self.heads, self.dim = heads, dim
        self.hidden = int(dim * mlp_ratio)
        self.mod = Modulation(dim, 1)
        self.norm = RMSNorm(dim)
        self.linear1 = nn.Linear(dim, 3 * dim + self.hidden)
        self.q_norm, self.k_norm = RMSNorm(dim // heads), RMSNorm(dim // heads)
        self.rope = ROTARY[rope]()
        self.linear2 = nn.Linear(dim + self.hidden, dim)

    def _forward(self, x: torch.Tensor, vec: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(vec)
        qkv, mlp = self.linear1(self.norm(x) * (1 + scale) + shift).split([3 * self.dim, self.hidden], dim=-1)
        b, n, _ = x.shape
        q, k, v = qkv.view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.rope(self.q_norm(q), freqs_cis), self.rope(self.k_norm(k), freqs_cis)
        attn = _attention(q, k, v, mask)
        return x + gate * self.linear2(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))


def _rope_table(positions: torch.Tensor, head_dim: int, rope: str, theta: float = 10000.0) -> torch.Tensor:
    """Rotary factors for 3 position axes (text index, row, column), like Flux/Lumina: complex
    e^(i angle) for ComplexRotary, 2x2 rotation matrices for RealRotary."""
    axes = [head_dim // 2 - 2 * (head_dim // 6), head_dim // 6, head_dim // 6]
    parts = []
    for axis, width in enumerate(axes):
        freqs = 1.0 / theta ** (torch.arange(0, width, device=positions.device).float() / width)
        parts.append(torch.outer(positions[:, axis].float(), freqs))
    angles = torch.cat(parts, dim=-1)
    if rope == "complex":
        return torch.polar(torch.ones_like(angles), angles)
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))


class TinyDiT(nn.Module):
    def __init__(self, config: TinyDiTConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or TinyDiTConfig()
        self.img_in = nn.Linear(c.in_channels * c.patch**2, c.dim)
        self.txt_in = nn.Linear(c.text_dim, c.dim)
        self.time_in = nn.Sequential(nn.Linear(256, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(c.dim, c.heads, c.mlp_ratio, c.rope) for _ in range(c.double_blocks)
        )
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(c.dim, c.heads, c.mlp_ratio, c.rope) for _ in range(c.single_blocks)
        )
        self.final_mod = Modulation(c.dim, 1)
        self.final_norm = RMSNorm(c.dim)
        self.final = nn.Linear(c.dim, c.in_channels * c.patch**2)

    def enable_gradient_checkpointing(self, use_reentrant: bool = False) -> None:
        for block in [*self.double_blocks, *self.single_blocks]:
            block.gradient_checkpointing = True
            block.checkpoint_reentrant = use_reentrant

    def forward(
        self, latents: torch.Tensor, t: torch.Tensor, txt: torch.Tensor, txt_mask: torch.Tensor
    ) -> torch.Tensor:
        c = self.config
        b, ch, h, w = latents.shape
        gh, gw = h // c.patch, w // c.patch
        patches = latents.view(b, ch, gh, c.patch, gw, c.patch).permute(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, -1)
        img, txt = self.img_in(patches), self.txt_in(txt)
        half = 128
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        angles = 1000.0 * t[:, None].float() * freqs[None]
        vec = self.time_in(torch.cat([angles.cos(), angles.sin()], dim=-1).to(img.dtype))

        n_txt = txt.shape[1]
        rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        positions = torch.cat(
            [
                torch.stack(
                    [torch.arange(n_txt), torch.zeros(n_txt, dtype=torch.long), torch.zeros(n_txt, dtype=torch.long)],
                    -1,
                ),
                torch.stack([torch.full((gh * gw,), n_txt), rows.flatten(), cols.flatten()], -1),
            ]
        ).to(latents.device)
        freqs_cis = _rope_table(positions, c.dim // c.heads, c.rope)
        keep = torch.cat([txt_mask.bool(), torch.ones(b, gh * gw, dtype=torch.bool, device=latents.device)], dim=1)
        mask = keep[:, None, None, :]

        reentrant = any(blk.gradient_checkpointing and blk.checkpoint_reentrant for blk in self.double_blocks)
        if self.training and reentrant and not img.requires_grad:
            # Reentrant checkpoint only back-propagates through inputs that require grad.
            img.requires_grad_(True)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, freqs_cis, mask)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            x = block(x, vec, freqs_cis, mask)
        shift, scale, _ = self.final_mod(vec)
        out = self.final(self.final_norm(x[:, n_txt:]) * (1 + scale) + shift)
        return out.view(b, gh, gw, ch, c.patch, c.patch).permute(0, 3, 1, 4, 2, 5).reshape(b, ch, h, w)


def make_inputs(
    config: TinyDiTConfig, batch: int = 2, res: int = 16, text_len: int = 8, device: str = "cpu", dtype=torch.float32
) -> tuple[torch.Tensor, ...]:
    """Random latents (res x res), timesteps, text features and a mask padding the last quarter of the text."""
    latents = torch.randn(batch, config.in_channels, res, res, device=device, dtype=dtype)
    t = torch.rand(batch, device=device)
    txt = torch.randn(batch, text_len, config.text_dim, device=device, dtype=dtype)
    mask = torch.ones(batch, text_len, dtype=torch.bool, device=device)
    mask[:, text_len - max(1, text_len // 4) :] = False
    return latents, t, txt, mask
