"""diffusers transformers: which block lists to compile, and what to rewrite so they compile whole.

    from compile_accel.integrations import diffusers as accel_diffusers
    acceleration = accel_diffusers.apply(transformer, CompileConfig(mode="blocks", activation_memory_budget=0.5))

The model's own `gradient_checkpointing` flag (diffusers checkpoints blocks from the model's
loop) is what compile_accel switches off when a budget replaces it, and `restore()` undoes
everything done here. Other diffusers models work with `compile_accel.apply` directly: their
`_repeated_blocks` / `_no_split_modules` name the blocks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

import compile_accel
from compile_accel import Acceleration, CompileConfig
from compile_accel.regions import restore_forward
from compile_accel.rotary import real_table, rotate_interleaved

Undo = Callable[[], None]


@dataclass(frozen=True)
class Adapter:
    blocks: tuple[str, ...]
    prepare: Callable[[nn.Module], Undo] | None = None


class _ModuleFunctionPatch:
    """Replace a function in a module's namespace while any model needs it (reference counted)."""

    def __init__(self, module_name: str, name: str, make: Callable[[Callable], Callable]) -> None:
        self.module_name, self.name, self.make = module_name, name, make
        self.original: Callable | None = None
        self.users = 0

    def install(self) -> None:
        module = sys.modules[self.module_name]
        if self.users == 0:
            self.original = getattr(module, self.name)
            setattr(module, self.name, self.make(self.original))
        self.users += 1

    def uninstall(self) -> None:
        self.users -= 1
        if self.users == 0:
            setattr(sys.modules[self.module_name], self.name, self.original)


def _real_or_complex_rotary(original: Callable) -> Callable:
    def apply_rotary_emb(
        x: torch.Tensor, freqs_cis: Any, use_real: bool = True, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        # Lumina 2 passes complex factors with use_real=False; the adapter hands it their real view.
        if not use_real and isinstance(freqs_cis, torch.Tensor) and not freqs_cis.is_complex():
            return rotate_interleaved(x, freqs_cis, head_dim=2)  # x is (batch, tokens, heads, head_dim)
        return original(x, freqs_cis, use_real, *args, **kwargs)

    return apply_rotary_emb


_LUMINA2_ROTARY = _ModuleFunctionPatch(
    "diffusers.models.transformers.transformer_lumina2", "apply_rotary_emb", _real_or_complex_rotary
)


def _lumina2_real_rope(model: nn.Module) -> Undo:
    """Lumina 2 multiplies q and k by complex factors inside every block: hand the blocks the
    factors' real view instead, and rotate in real arithmetic (compile_accel.rotary)."""
    embedder = model.rope_embedder
    original = embedder.forward

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> tuple:
        hidden, cap_freqs, img_freqs, freqs, cap_lengths, seq_lengths = original(hidden_states, attention_mask)
        return hidden, real_table(cap_freqs), real_table(img_freqs), real_table(freqs), cap_lengths, seq_lengths

    embedder.forward = forward
    _LUMINA2_ROTARY.install()

    def undo() -> None:
        restore_forward(embedder, original)
        _LUMINA2_ROTARY.uninstall()

    return undo


ADAPTERS: dict[str, Adapter] = {
    "Lumina2Transformer2DModel": Adapter(("context_refiner", "noise_refiner", "layers"), _lumina2_real_rope),
    "FluxTransformer2DModel": Adapter(("transformer_blocks", "single_transformer_blocks")),
}


def apply(model: nn.Module, config: CompileConfig | None = None) -> Acceleration:
    """compile_accel.apply with the model's adapter; ValueError for a model without one."""
    adapter = ADAPTERS.get(type(model).__name__)
    if adapter is None:
        raise ValueError(
            f"no diffusers adapter for {type(model).__name__} (adapters: {sorted(ADAPTERS)}); "
            "compile_accel.apply(model, config) finds the blocks of other diffusers models"
        )
    undo = adapter.prepare(model) if adapter.prepare else None
    try:
        acceleration = compile_accel.apply(model, config, blocks=list(adapter.blocks))
    except Exception:
        if undo:
            undo()
        raise
    if undo:
        acceleration.on_restore(undo)
    return acceleration
