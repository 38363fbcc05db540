"""What the launcher knows of each sd-scripts model family: where its blocks are, how its block
swap becomes auto's offload ladder, and the rewrites its blocks need to compile whole.

sd-scripts' NextDiT (Lumina 2) multiplies q and k by complex rotary factors in every block;
its adapter hands the blocks the factors' real view and rotates in real arithmetic
(compile_accel.rotary), so its blocks compile whole. It also marks padding masks that pad
nothing, so that compiled attention runs without them. Anima's and HunyuanImage's attention goes
through sd-scripts' library.attention.attention, which compiled code runs as a stand-in dynamo
traces.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from compile_accel import Acceleration, CompileConfig
from compile_accel.adapters import ModelAdapter, ModelOffloadLadder, Undo
from compile_accel.api import apply_adapter
from compile_accel.auto_budget import OffloadLadder, spaced_levels
from compile_accel.blocks import UNET_BLOCK_LISTS
from compile_accel.patching import ModuleFunctionPatch
from compile_accel.rotary import real_table, rotate_interleaved


def _double_single_most_swapped(model: nn.Module) -> int:
    """Flux and HunyuanImage swap n // 2 double blocks and twice the rest in single blocks, keeping
    two of each."""
    double, single = model.num_double_blocks, model.num_single_blocks
    return max(n for n in range(double + single) if n // 2 <= double - 2 and 2 * (n - n // 2) <= single - 2)


# ---- block swap as auto's offload ladder -----------------------------------------------------


def _set_blocks_to_swap(model: nn.Module, count: int, device: torch.device, options: dict[str, Any]) -> None:
    """sd-scripts' block swap at `count`, set up as the trainers do (enable_block_swap with the
    trainer's `options`, then prepare_block_swap_before_forward). The previous offloaders finish
    their moves and lose their backward hooks first, so only the new ones act."""
    for offloader in [v for v in vars(model).values() if hasattr(v, "remove_handles") and hasattr(v, "futures")]:
        for index in list(offloader.futures):
            offloader._wait_blocks_move(index)
        for handle in offloader.remove_handles:
            handle.remove()
        offloader.remove_handles.clear()
    model.enable_block_swap(count, device, **options)
    if count:
        model.prepare_block_swap_before_forward()
    else:
        model.to(device)  # prepare does nothing at 0 swapped: bring every block's weights back


def _prepare_swap_after_no_grad_forwards(model: nn.Module) -> Undo:
    """A forward without backward (sampling, validation) leaves swapped blocks where backward
    would have put them back; trainers call prepare_block_swap_before_forward after one only
    when they swap themselves. These hooks do it when auto swapped blocks the trainer did not."""
    stale = [False]

    def before(module: nn.Module, args: tuple) -> None:
        if stale[0]:
            stale[0] = False
            module.prepare_block_swap_before_forward()

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        stale[0] = stale[0] or not torch.is_grad_enabled()

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


def block_swap_ladder(most_swapped: Callable[[nn.Module], int], **options: Any) -> ModelOffloadLadder:
    """A family's ModelAdapter.offload_ladder, given the most blocks its `enable_block_swap`
    accepts (and the options its trainer passes it): blocks swapped, from what the trainer set up
    (--blocks_to_swap, 0 without) to that most, the ladder activation_memory_budget="auto" climbs
    when no budget fits."""

    def ladder(model: nn.Module, device: torch.device, on_remove: Callable[[Undo], None]) -> OffloadLadder:
        start = model.blocks_to_swap or 0
        hooked: list[Undo] = []

        def set_level(count: float) -> None:
            _set_blocks_to_swap(model, int(count), device, options)
            if count and not start and not hooked:
                hooked.append(_prepare_swap_after_no_grad_forwards(model))
                on_remove(hooked[0])

        levels = spaced_levels(start, max(start, most_swapped(model)), whole=True)
        return OffloadLadder("blocks_to_swap", levels, set_level)

    return ladder


def _real_or_complex_rope(original: Callable) -> Callable:
    """Stand-in for lumina_models.apply_rope: a flattened real table (from the wrapped rope
    embedder) is rotated in real arithmetic, complex factors go to the original."""

    def apply_rope(x_in: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        if freqs_cis.is_complex():
            return original(x_in, freqs_cis)
        return rotate_interleaved(x_in, freqs_cis.unflatten(-1, (-1, 2)), head_axis=2)

    return apply_rope


_LUMINA_ROPE = ModuleFunctionPatch("library.lumina_models", "apply_rope", _real_or_complex_rope)


def _lumina_real_rope(model: nn.Module) -> Undo:
    """NextDiT's rope embedder (a plain object, not a module) returns (batch, tokens, pairs)
    complex factors that patchify_and_embed copies into zero tensors of the same last dim; the
    stand-in returns them as a (batch, tokens, pairs * 2) real table, which copies the same way."""
    original = model.rope_embedder
    model.rope_embedder = lambda ids: real_table(original(ids)).flatten(-2)
    _LUMINA_ROPE.install()

    def undo() -> None:
        model.rope_embedder = original
        _LUMINA_ROPE.uninstall()

    return undo


def _all_true_view(mask: torch.Tensor) -> torch.Tensor:
    """An all-True mask of `mask`'s shape with stride 0, which `_sdpa_without_mask_marks` drops."""
    return torch.ones((), dtype=torch.bool, device=mask.device).expand(mask.shape)


def _sdpa_without_mask_marks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor:
    """scaled_dot_product_attention without a boolean mask that has stride 0 along the keys.

    Such a mask gives every key of a query row one value: all True is no mask, and all False
    leaves the row nothing to attend to (nothing computes that on purpose). SDPA with a mask
    runs the memory-efficient kernel instead of flash/cuDNN, and a stride-0 mask even the math
    kernel. Compiled, the stride is part of dynamo's guards, so the test costs nothing there.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.stride(-1) == 0:
        attn_mask = None
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, **kwargs)


def _lumina_masks_only_when_padded(model: nn.Module) -> Undo:
    """NextDiT hands its blocks padding masks even when nothing is padded: the joint mask is all
    True at batch 1 and whenever a batch's captions have the same length, the caption mask when
    no caption is padded, and the noise refiner's mask always (a batch's images have one size).
    The stand-ins pass those as stride-0 all-True views, and attention drops them; diffusers'
    Lumina 2 skips the mask in the same cases. A padded batch keeps its masks."""

    def patchify_and_embed(
        self: nn.Module, x: torch.Tensor, cap_feats: torch.Tensor, cap_mask: torch.Tensor, t: torch.Tensor
    ) -> tuple:
        if bool(cap_mask.all()):  # a host sync, as patchify_and_embed's own .tolist() of the lengths
            cap_mask = _all_true_view(cap_mask)
        x, mask, freqs_cis, cap_lengths, seq_lengths = type(self).patchify_and_embed(self, x, cap_feats, cap_mask, t)
        if len(set(seq_lengths)) == 1:
            mask = _all_true_view(mask)
        return x, mask, freqs_cis, cap_lengths, seq_lengths

    def image_mask_marked(block: nn.Module, args: tuple) -> tuple:
        # All True by construction: patchify_and_embed makes it with torch.ones, since the images
        # of a batch are one tensor and so have one token count.
        x, x_mask, *rest = args
        return (x, _all_true_view(x_mask), *rest)

    # A method of the instance (not a closure over it), so that a deepcopy calls its own model.
    model.patchify_and_embed = types.MethodType(patchify_and_embed, model)
    hooks = [block.register_forward_pre_hook(image_mask_marked) for block in model.noise_refiner]
    attentions = [
        m for m in model.modules() if getattr(m, "attention_processor", None) is F.scaled_dot_product_attention
    ]
    for attention in attentions:  # sage and flash attention users keep theirs
        attention.attention_processor = _sdpa_without_mask_marks

    def undo() -> None:
        vars(model).pop("patchify_and_embed", None)
        for hook in hooks:
            hook.remove()
        for attention in attentions:
            if attention.attention_processor is _sdpa_without_mask_marks:  # not one set since
                attention.attention_processor = F.scaled_dot_product_attention

    return undo


def _prepare_lumina(model: nn.Module) -> Undo:
    undos = [_lumina_real_rope(model), _lumina_masks_only_when_padded(model)]

    def undo() -> None:
        for step in reversed(undos):
            step()

    return undo


def _traceable_attention(original: Callable) -> Callable:
    """Stand-in for sd-scripts' library.attention.attention (Anima, HunyuanImage) in compiled
    code: PyTorch SDPA (--attn_mode torch) without a per-sample split, with the boolean padding
    mask where the call has one. The original deletes names its comprehensions capture, a bytecode
    dynamo does not handle, and with a mask branches on its values: each call broke a compiled
    block in pieces. Where the original, given a mask whose samples are all of one length, trims
    the padding off and pads zeros back, the mask hides the padding keys instead: the same values
    at every unpadded token (the blocks these models compile get such masks only all True, which
    `_masks_only_when_padded` drops). Eager calls and other attention modes go to the original."""

    def attention(
        qkv_or_q: torch.Tensor | list,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        attn_params: Any = None,
        drop_rate: float = 0.0,
    ) -> torch.Tensor:
        params = attn_params
        if not torch.compiler.is_compiling() or (params is not None and (params.attn_mode != "torch" or params.split_attn)):
            return original(qkv_or_q, k, v, attn_params, drop_rate)
        if isinstance(qkv_or_q, list):
            q, k, v = qkv_or_q
            qkv_or_q.clear()  # as the original: the caller's list no longer holds them
        else:
            q = qkv_or_q
        mask = None if params is None else params.attention_mask  # (batch, 1, 1, keys) booleans
        # (batch, tokens, heads, head_dim) in and (batch, tokens, heads * head_dim) out
        x = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, dropout_p=drop_rate
        )
        return x.transpose(1, 2).flatten(2)

    return attention


def _masks_only_when_padded(original: type) -> type:
    """Stand-in for the AttentionParams class HunyuanImage's model makes its blocks' attention
    parameters with: a text mask that pads nothing (every caption at batch 1, or captions of one
    length: the model trims the text to the longest) makes the original's parameters less the
    mask, as the original's attention then trims nothing and runs SDPA without one; compiled
    attention without a mask runs flash or cuDNN attention instead of the memory-efficient kernel.
    The sequence lengths stay: the text refiner averages each caption over its own."""

    class AttentionParams(original):  # type: ignore[misc, valid-type]
        @staticmethod
        def create_attention_params_from_mask(attn_mode: Any, split_attn: bool, img_len: Any, attention_mask: Any) -> Any:
            params = original.create_attention_params_from_mask(attn_mode, split_attn, img_len, attention_mask)
            if attention_mask is not None and bool(attention_mask.all()):  # a host sync, once a forward
                params = dataclasses.replace(params, attention_mask=None)
            return params

    return AttentionParams


_PATCHES = {
    "Anima": [ModuleFunctionPatch("library.attention", "attention", _traceable_attention)],
    # hunyuan_image_modules imports the function by name
    "HYImageDiffusionTransformer": [
        ModuleFunctionPatch("library.hunyuan_image_modules", "attention", _traceable_attention),
        ModuleFunctionPatch("library.hunyuan_image_models", "AttentionParams", _masks_only_when_padded),
    ],
}


def _install_patches(model: nn.Module) -> Undo:
    """The module patches of `model`'s family, in place while it is accelerated."""
    patches = _PATCHES[type(model).__name__]
    for patch in patches:
        patch.install()

    def undo() -> None:
        for patch in reversed(patches):
            patch.uninstall()

    return undo


# Keyed by class name; only classes defined in sd-scripts' library/ are looked up. The models
# with block swap (the most blocks each accepts) climb it under auto.
FAMILIES: dict[str, ModelAdapter] = {
    "NextDiT": ModelAdapter(
        ("context_refiner", "noise_refiner", "layers"),
        prepare=_prepare_lumina,
        offload_ladder=block_swap_ladder(lambda model: len(model.layers) - 2),
    ),
    "Flux": ModelAdapter(("double_blocks", "single_blocks"), offload_ladder=block_swap_ladder(_double_single_most_swapped)),
    "MMDiT": ModelAdapter(("joint_blocks",), offload_ladder=block_swap_ladder(lambda model: model.num_blocks - 2)),
    # Anima: its DiT blocks (selective compiles the body each of its three checkpoints runs); the
    # LLM adapter's blocks, which run once a step without gradients, stay eager.
    "Anima": ModelAdapter(
        ("blocks",), prepare=_install_patches, offload_ladder=block_swap_ladder(lambda model: model.num_blocks - 2)
    ),
    # HunyuanImage 2.1: its double and single blocks (the text refiner's blocks stay eager); its
    # trainer swaps blocks for the backward too.
    "HYImageDiffusionTransformer": ModelAdapter(
        ("double_blocks", "single_blocks"),
        prepare=_install_patches,
        offload_ladder=block_swap_ladder(_double_single_most_swapped, supports_backward=True),
    ),
    # U-Nets: every layer the model's loop calls (ResBlocks, transformers, down/upsamplers). SD
    # 1.x's compile per size: with automatic dynamic shapes AOTAutograd's cache specializes some of
    # its symbolic graphs to a size again and they compile twice (docs/sd-scripts.md). SDXL's keep
    # automatic dynamic shapes.
    "SdxlUNet2DConditionModel": ModelAdapter(("input_blocks.*", "middle_block", "output_blocks.*")),
    "UNet2DConditionModel": ModelAdapter(UNET_BLOCK_LISTS, static_shapes=True),
}


def is_sd_scripts_model(module: Any) -> bool:
    return isinstance(module, nn.Module) and type(module).__module__.startswith("library.")


def apply(model: nn.Module, config: CompileConfig) -> Acceleration:
    """compile_accel.apply on an sd-scripts model: its family's block lists (and adapter), or
    the repeated blocks compile_accel finds for a class without one. Call it after LoRA's
    apply_to, before the first step; `remove()` undoes the adapter too. With
    activation_memory_budget="auto", a model with block swap (Flux, SD3, Lumina 2, Anima,
    HunyuanImage) swaps more blocks when no budget fits (see block_swap_ladder). UnknownLayout
    for a family's class without its block lists."""
    return apply_adapter(model, config, FAMILIES.get(type(model).__name__))
