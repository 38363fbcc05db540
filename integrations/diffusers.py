"""diffusers transformers: which block lists to compile, and what to rewrite so they compile whole.

Lumina 2 and Qwen-Image multiply q and k by complex rotary factors inside every block, which
inductor cannot generate code for; their adapters hand the blocks the factors' real view and
rotate in real arithmetic instead (checked against the complex form in the tests).

    from compile_accel.integrations import diffusers as accel_diffusers
    acceleration = accel_diffusers.apply(transformer, CompileConfig(mode="blocks", activation_memory_budget=0.5))

The model's own `gradient_checkpointing` flag (diffusers checkpoints blocks from the model's
loop) is what compile_accel switches off when a budget replaces it, and `remove()` undoes
everything done here. Other diffusers models work with `compile_accel.apply` directly: their
`_repeated_blocks` / `_no_split_modules` name the blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from compile_accel import Acceleration, CompileConfig
from compile_accel.adapters import ModelAdapter, Undo
from compile_accel.api import apply_adapter
from compile_accel.blocks import UNET_BLOCK_LISTS
from compile_accel.patching import ModuleFunctionPatch
from compile_accel.regions import restore_forward
from compile_accel.rotary import real_table, rotate_interleaved


def _real_or_complex_rotary(head_axis: int) -> Callable[[Callable], Callable]:
    """A stand-in for a model's rotary function: a real table (from the wrapped embedder) is
    rotated in real arithmetic, anything else goes to the original."""

    def make(original: Callable) -> Callable:
        def rotary(x: torch.Tensor, freqs_cis: Any, use_real: bool = True, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not use_real and isinstance(freqs_cis, torch.Tensor) and not freqs_cis.is_complex():
                return rotate_interleaved(x, freqs_cis, head_axis)
            return original(x, freqs_cis, use_real, *args, **kwargs)

        return rotary

    return make


def _complex_to_real(value: Any) -> Any:
    return real_table(value) if isinstance(value, torch.Tensor) and value.is_complex() else value


def _real_rope(embedder_name: str, rotary: ModuleFunctionPatch) -> Callable[[nn.Module], Undo]:
    """Adapter step for models that multiply q and k by complex factors inside every block:
    the model's rotary embedder hands the blocks the factors' real view instead, and the
    model's rotary function rotates in real arithmetic (compile_accel.rotary)."""

    def prepare(model: nn.Module) -> Undo:
        embedder = model.get_submodule(embedder_name)
        original = embedder.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            return pytree.tree_map(_complex_to_real, original(*args, **kwargs))

        embedder.forward = forward
        rotary.install()

        def undo() -> None:
            restore_forward(embedder, original)
            rotary.uninstall()

        return undo

    return prepare


# Lumina 2 rotates (batch, tokens, heads, head_dim) with factors (batch, tokens, pairs);
# Qwen-Image rotates (batch, tokens, heads, head_dim) with factors (tokens, pairs).
_LUMINA2_ROTARY = ModuleFunctionPatch(
    "diffusers.models.transformers.transformer_lumina2", "apply_rotary_emb", _real_or_complex_rotary(head_axis=2)
)
_QWEN_ROTARY = ModuleFunctionPatch(
    "diffusers.models.transformers.transformer_qwenimage", "apply_rotary_emb_qwen", _real_or_complex_rotary(head_axis=1)
)

ADAPTERS: dict[str, ModelAdapter] = {
    "Lumina2Transformer2DModel": ModelAdapter(
        ("context_refiner", "noise_refiner", "layers"), _real_rope("rope_embedder", _LUMINA2_ROTARY)
    ),
    "QwenImageTransformer2DModel": ModelAdapter(("transformer_blocks",), _real_rope("pos_embed", _QWEN_ROTARY)),
    "FluxTransformer2DModel": ModelAdapter(("transformer_blocks", "single_transformer_blocks")),
    "SD3Transformer2DModel": ModelAdapter(("transformer_blocks",)),
    "WanTransformer3DModel": ModelAdapter(("blocks",)),
    "UNet2DConditionModel": ModelAdapter(UNET_BLOCK_LISTS),
}


def apply(model: nn.Module, config: CompileConfig | None = None) -> Acceleration:
    """compile_accel.apply with the model's adapter; ValueError for a model without one."""
    adapter = ADAPTERS.get(type(model).__name__)
    if adapter is None:
        raise ValueError(
            f"no diffusers adapter for {type(model).__name__} (adapters: {sorted(ADAPTERS)}); "
            "compile_accel.apply(model, config) finds the blocks of other diffusers models"
        )
    return apply_adapter(model, config, adapter)
