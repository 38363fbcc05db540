"""kohya sd-scripts: run any of its training scripts with compile_accel, the checkout unchanged.

    compile-accel sd-scripts [--sd-scripts DIR] lumina_train_network.py ARGS...
    python -m compile_accel.integrations.sd_scripts [--sd-scripts DIR] lumina_train_network.py ARGS...
    accelerate launch -m compile_accel.integrations.sd_scripts [--sd-scripts DIR] lumina_train_network.py ARGS...

The script runs as `__main__` (runpy) after these functions are wrapped in memory:

- `library.train_util.add_training_arguments`, which every training script calls to build its
  parser: that parser's `parse_known_args` adds the compile flags at its first call, after the
  script's own (so `--help` lists them, and sd-scripts' own `--compile*` flags, where the script
  has them, are known: see `add_arguments`), and checks them at every call, also when
  `--config_file` re-parses with the file's values.
- `accelerate.Accelerator.prepare`, which every trainer calls on the DiT/U-Net after LoRA's
  `apply_to` and `enable_gradient_checkpointing` and before the first step (it is where
  sd-scripts' own `--torch_compile` compiles): the first sd-scripts model passed to it is
  accelerated in place before the original prepare runs.
- `accelerate.Accelerator.backward`, which every trainer calls once per step: after the first
  one the launcher prints what compiling took (and what `auto` chose); the counters again at exit.

sd-scripts' NextDiT (Lumina 2) multiplies q and k by complex rotary factors in every block;
its adapter hands the blocks the factors' real view and rotates in real arithmetic
(compile_accel.rotary), so its blocks compile whole. It also marks padding masks that pad
nothing, so that compiled attention runs without them.
"""

from __future__ import annotations

import argparse
import atexit
import os
import runpy
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from compile_accel import Acceleration, CompileConfig, compile_workers
from compile_accel.adapters import ModelAdapter, ModelOffloadLadder, Undo, UnknownLayout
from compile_accel.api import apply_adapter
from compile_accel.auto_budget import OffloadLadder, spaced_levels
from compile_accel.base_compute import base_compute_refusal
from compile_accel.blocks import UNET_BLOCK_LISTS
from compile_accel.compile_cache import RunCompileCache
from compile_accel.config import CUDA_GRAPH_MODES, cuda_graph_refusal
from compile_accel.dynamo_settings import HAS_BUDGET_KNOB, HAS_CACHE_ARTIFACTS, cpp_compiler, dynamic_shapes_refusal
from compile_accel.first_step import end_first_step
from compile_accel.memory import gib_argument, spill_warning
from compile_accel.patching import ModuleFunctionPatch
from compile_accel.preload import start_preloading, wait_for_preload
from compile_accel.rotary import real_table, rotate_interleaved
from compile_accel.stats import warn

SELECTIVE_ENV = "SDSCRIPTS_SELECTIVE_TORCH_COMPILE"
BUDGET_ENV = "SDSCRIPTS_TORCH_COMPILE_ACTIVATION_MEMORY_BUDGET"


class LaunchError(Exception):
    """The launcher cannot run this script as asked; the message says why."""


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
    length: the model trims the text to the longest) makes parameters without a mask, as the
    original's attention then trims nothing and runs SDPA without one; compiled attention without
    a mask runs flash or cuDNN attention instead of the memory-efficient kernel."""

    class AttentionParams(original):  # type: ignore[misc, valid-type]
        @staticmethod
        def create_attention_params_from_mask(attn_mode: Any, split_attn: bool, img_len: Any, attention_mask: Any) -> Any:
            if attention_mask is not None and bool(attention_mask.all()):  # a host sync, once a forward
                attention_mask = None
            return original.create_attention_params_from_mask(attn_mode, split_attn, img_len, attention_mask)

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
    # 1.x's compile per size: with automatic dynamic shapes 3 of its 24 graphs (train_network.py,
    # 128x128, torch 2.14) were symbolic ones specialized again to a size by AOTAutograd's cache
    # and compiled twice; per size, the same 24 and none twice. (SDXL's graphs, measured with
    # automatic dynamic shapes, keep them.)
    "SdxlUNet2DConditionModel": ModelAdapter(("input_blocks.*", "middle_block", "output_blocks.*")),
    "UNet2DConditionModel": ModelAdapter(UNET_BLOCK_LISTS, static_shapes=True),
}


def is_sd_scripts_model(module: Any) -> bool:
    return isinstance(module, nn.Module) and type(module).__module__.startswith("library.")


def apply(model: nn.Module, config: CompileConfig) -> Acceleration:
    """compile_accel.apply on an sd-scripts model: its family's block lists (and adapter), or
    the repeated blocks compile_accel finds for a class without one. Call it after LoRA's
    apply_to, before the first step; `remove()` undoes the adapter too. With
    activation_memory_budget="auto", a model with block swap (Flux, SD3, Lumina 2) swaps more
    blocks when no budget fits (see block_swap_ladder). UnknownLayout for a family's class
    without its block lists."""
    return apply_adapter(model, config, FAMILIES.get(type(model).__name__))


# ---- command-line flags -------------------------------------------------------------------


def _budget(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] or auto, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


_DYNAMIC = {"auto": None, "true": True, "false": False}
# A first step that compiled this long without --compile_workers gets a hint to use them: with
# workers sd-scripts' models reached their first step in 5-15 s (benchmarks/results/
# h200_workers_every_family/), compiling in process took 20-294 s.
WORKERS_HINT_SECONDS = 20.0
# At the end of training, how long to wait for graphs still being precompiled in the workers
# (compile_accel.precompile; on an H200 they were written 9-11 s after the first step).
PRECOMPILE_WAIT_SECONDS = 60.0


# sd-scripts' own per-block compile (Anima's, library/compile_utils.py after the sd3 branch):
# --compile turns it on; the others configure it. --compile_dynamic is also ours, with the same
# values and meaning: where the script defines it, both compilers read the script's flag.
SD_SCRIPTS_COMPILE = "--compile"
SD_SCRIPTS_COMPILE_SETTINGS = (
    "--compile_backend",
    "--compile_mode",
    "--compile_fullgraph",
    "--compile_cache_size_limit",
)
SHARED_DYNAMIC = "--compile_dynamic"


def add_arguments(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Add the compile_accel flags to an sd-scripts parser, after the script's own; returns the
    flags of sd-scripts' own compile that the parser has, with their defaults (`config_from_args`
    takes them)."""
    defined = parser._option_string_actions  # argparse's table of option strings
    theirs = {
        flag: defined[flag].default
        for flag in (SD_SCRIPTS_COMPILE, *SD_SCRIPTS_COMPILE_SETTINGS, SHARED_DYNAMIC)
        if flag in defined
    }
    group = parser.add_argument_group("compile_accel (per-block torch.compile)")
    try:
        group.add_argument(
            "--selective_torch_compile",
            action="store_true",
            default=os.environ.get(SELECTIVE_ENV, "0") == "1",
            help=f"compile the compute modules inside each DiT/U-Net block and keep --gradient_checkpointing "
            f"(also on with {SELECTIVE_ENV}=1)",
        )
        group.add_argument(
            "--activation_memory_budget",
            type=_budget,
            default=os.environ.get(BUDGET_ENV),  # a string default goes through type=, as typed
            help="compile each whole block and keep this fraction (0..1) of its activations for backward, "
            "recomputing the rest; replaces --gradient_checkpointing for those blocks (0: least memory). "
            "auto: the fastest budget whose peak fits --vram_limit_gib, timed on the first step; with block "
            "swap (Flux, SD3, Lumina 2) it swaps more blocks than --blocks_to_swap when none fits "
            f"(also set by {BUDGET_ENV}, the name of the original sd-scripts pull request)",
        )
        group.add_argument(
            "--vram_limit_gib",
            type=gib_argument,
            default=None,
            help="the peak memory --activation_memory_budget auto must fit (default: the GPU's free memory "
            "less a margin)",
        )
        group.add_argument(
            "--no_compile_cache",
            action="store_true",
            help="do not keep the compiled graphs of this run in the compile_accel cache directory "
            "($COMPILE_ACCEL_CACHE_DIR, default ~/.cache/compile_accel/compiled), from which the next run of the same "
            "training loads them instead of compiling",
        )
        if SHARED_DYNAMIC not in theirs:
            group.add_argument(
                SHARED_DYNAMIC,
                choices=sorted(_DYNAMIC),
                default="auto",
                help="true: one graph for all aspect-ratio buckets (symbolic shapes); false: one graph per shape; "
                "auto: static first, dynamic on the first new shape (default)",
            )
        group.add_argument(
            "--compile_recompile_limit",
            type=_positive_int,
            default=CompileConfig.recompile_limit,
            help=f"graphs per block function before dynamo runs new inputs eager "
            f"(default {CompileConfig.recompile_limit}; raise it for many buckets)",
        )
        group.add_argument(
            "--compile_workers",
            type=_positive_int,
            default=None,
            metavar="N",
            help="compile the graphs in N worker processes while the first steps run them uncompiled: the first "
            "step takes seconds instead of minutes; each worker holds ~0.5 GiB of GPU memory until every graph is "
            "back (on Windows the training script's start must be under if __name__ == '__main__', as sd-scripts' are)",
        )
        group.add_argument(
            "--compile_workers_wait",
            action="store_true",
            help="with --compile_workers: the first step waits until every graph is back from the workers, which "
            "compile them at the same time, so that every step after it runs compiled",
        )
        group.add_argument(
            "--base_compute",
            choices=["int8", "fp8"],
            default=None,
            help="run the frozen base model's matmuls inside the compiled blocks in 8 bits, forward and input "
            "gradient, the LoRA in its own dtype (int8: CUDA GPUs of compute capability 8.0 or newer; fp8: 8.9 or "
            "newer, --fp8_base weights multiplied as they are)",
        )
        group.add_argument(
            "--compile_cuda_graphs",
            action="store_true",
            help="with --activation_memory_budget B or auto: replay each compiled block as a CUDA graph (inductor's "
            "reduce-overhead mode), one launch instead of hundreds, for steps bound by kernel launches (SDXL with "
            "LoRA); with --selective_torch_compile: the forward of each block under a reentrant checkpoint (SDXL), "
            "the recompute and backward without; not with --blocks_to_swap (moved weights are recorded again at "
            "every move)",
        )
    except argparse.ArgumentError as error:
        raise LaunchError(
            f"this sd-scripts already defines {error.argument_name}: it has compile flags of its own that the "
            "compile_accel launcher would shadow; run the script without the launcher"
        ) from None
    return theirs


def config_from_args(args: argparse.Namespace, theirs: dict[str, Any] | None = None) -> CompileConfig | None:
    """The CompileConfig the flags ask for, None for none; LaunchError for combinations that cannot
    work. `theirs`: the flags of sd-scripts' own compile the script defines, with their defaults
    (`add_arguments`)."""
    theirs = theirs or {}
    budget, selective = args.activation_memory_budget, args.selective_torch_compile
    dynamic = "auto" if args.compile_dynamic is None else args.compile_dynamic  # (None: sd-scripts' default)
    if dynamic not in _DYNAMIC:
        raise LaunchError(f"--compile_dynamic {dynamic}: compile_accel takes {', '.join(sorted(_DYNAMIC))}")
    if args.vram_limit_gib is not None and budget != "auto":
        raise LaunchError("--vram_limit_gib is the limit of --activation_memory_budget auto; give that too")
    if budget is None and not selective:
        if (
            (dynamic != "auto" and SHARED_DYNAMIC not in theirs)
            or args.compile_recompile_limit != CompileConfig.recompile_limit
            or args.no_compile_cache
            or args.compile_workers
            or args.compile_workers_wait
            or args.compile_cuda_graphs
            or args.base_compute
        ):
            raise LaunchError(
                "--compile_dynamic, --compile_recompile_limit, --no_compile_cache, --compile_workers(_wait), "
                "--compile_cuda_graphs and --base_compute need --selective_torch_compile or --activation_memory_budget"
            )
        return None
    asked = "--activation_memory_budget" if budget is not None else f"--selective_torch_compile ({SELECTIVE_ENV})"
    if budget is not None and selective:
        raise LaunchError(
            "--selective_torch_compile and --activation_memory_budget are two ways to compile the blocks; "
            f"choose one (is {SELECTIVE_ENV}=1 set?)"
        )
    if getattr(args, "torch_compile", False):
        raise LaunchError(
            f"--torch_compile compiles the whole model through accelerate; {asked} compiles its blocks instead. "
            "Drop --torch_compile"
        )
    if getattr(args, "deepspeed", False):
        raise LaunchError(f"{asked} does not support --deepspeed (its model wrapper hides the blocks)")
    for flag in SD_SCRIPTS_COMPILE_SETTINGS:
        dest = flag.removeprefix("--")
        if flag in theirs and getattr(args, dest) != theirs[flag]:
            raise LaunchError(
                f"{flag} configures sd-scripts' own --compile, which {asked} replaces on the blocks it compiles; "
                f"drop {flag}"
            )
    if args.compile_workers_wait:
        auto = "--activation_memory_budget auto" if budget == "auto" else None
        flags = ("--compile_workers_wait", "--compile_workers")
        refusal = compile_workers.wait_refusal(args.compile_workers, auto, *flags)
        if refusal:
            raise LaunchError(refusal)
    if args.compile_workers and not compile_workers.SUPPORTED:
        raise LaunchError(
            f"--compile_workers {compile_workers.UNSUPPORTED_WHY} (this is torch {torch.__version__} on "
            f"{sys.platform}); drop the flag"
        )
    if budget is not None and not HAS_BUDGET_KNOB:
        raise LaunchError(f"--activation_memory_budget needs torch >= 2.4 (this is {torch.__version__})")
    refusal = dynamic_shapes_refusal() if dynamic != "false" else None
    if refusal and dynamic == "true":
        raise LaunchError(f"--compile_dynamic true: {refusal}; or give --compile_dynamic false (a graph per size)")
    if refusal:  # auto: a graph per size, which compiles without MSVC
        _say(f"compiling a graph per input size (--compile_dynamic false): {refusal}")
        dynamic = "false"
    config = CompileConfig(
        mode="blocks" if budget is not None else "selective",
        activation_memory_budget=budget,
        vram_limit_gib=args.vram_limit_gib,
        dynamic=_DYNAMIC[dynamic],
        recompile_limit=args.compile_recompile_limit,
        compile_workers=args.compile_workers or 0,
    )
    if args.base_compute:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where sd-scripts trains
        refusal = base_compute_refusal(args.base_compute, {device})
        if refusal is None and args.compile_cuda_graphs:
            refusal = "does not run under --compile_cuda_graphs yet; drop one of the two"
        if refusal:
            raise LaunchError(f"--base_compute {args.base_compute}: {refusal}")
        config.base_compute = args.base_compute
    if args.compile_cuda_graphs:
        refusal = cuda_graph_refusal(config, "--blocks_to_swap" if getattr(args, "blocks_to_swap", None) else None)
        if refusal:
            raise LaunchError(f"--compile_cuda_graphs: {refusal}")
        config.compile_mode = "reduce-overhead"
    return config


# ---- the launch ---------------------------------------------------------------------------


def _say(message: str) -> None:
    print(f"compile_accel: {message}", file=sys.stderr, flush=True)


def _missing_compiler(device: torch.device) -> str | None:
    """Why inductor cannot generate code for `device` here, or None."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "triton is not installed (pip install triton; triton-windows on Windows)"
    missing = cpp_compiler()[1]
    return None if missing is None else f"no C++ compiler for inductor's CPU code ({missing})"


class Launch:
    """One run of a training script: the flags it parsed and the model it accelerated."""

    def __init__(self) -> None:
        self.args: argparse.Namespace | None = None
        self.config: CompileConfig | None = None
        self.acceleration: Acceleration | None = None
        self.compile_cache: RunCompileCache | None = None
        self._reported_first_step = False
        self._can_swap_blocks = False  # the trained model has sd-scripts' block swap
        self._warned_of_spill = False
        # Graphs out in the compile workers at the first step: once as many are back and running
        # compiled, the run's cache file is saved again (the first step's save lacks them).
        self._resave_after: int | None = None

    def watch(self, parser: argparse.ArgumentParser) -> None:
        """Add the compile flags to `parser` at its first parse, when the script has added its own,
        and check them after every parse (the command line, then --config_file's)."""
        parse_known_args = parser.parse_known_args
        theirs: dict[str, Any] | None = None  # sd-scripts' own compile flags (add_arguments)

        def checked(*args: Any, **kwargs: Any) -> tuple[argparse.Namespace, list[str]]:
            nonlocal theirs
            if theirs is None:
                theirs = add_arguments(parser)
            namespace, rest = parse_known_args(*args, **kwargs)
            try:
                self.config = config_from_args(namespace, theirs)
            except LaunchError as error:
                parser.error(str(error))
            if self.config is not None and getattr(namespace, "compile", False) and SD_SCRIPTS_COMPILE in theirs:
                namespace.compile = False  # never two compilers on one block
                _say(f"sd-scripts' own --compile is off: compile_accel compiles the blocks ({self.config.mode} mode)")
            self.args = namespace
            if self.config is not None:
                # The script's own set-up (weights, latents, text encoders) runs beside the
                # preload and the compile workers' start until accelerate(), at Accelerator.prepare.
                start_preloading()
            if self.config is not None and self.config.compile_workers:
                compile_workers.start(self.config.compile_workers)
            else:  # (a --config_file that compiles nothing after a command line that did)
                compile_workers.stop()
            return namespace, rest

        parser.parse_known_args = checked

    def accelerate(self, model: nn.Module, device: torch.device) -> None:
        """Accelerate the run's model, once, if the flags asked for it."""
        self._can_swap_blocks = hasattr(model, "enable_block_swap")
        if self.config is None or self.acceleration is not None:
            return
        wait_for_preload()  # _missing_compiler imports triton and inductor's C++ builder
        if self.config.compile_mode in CUDA_GRAPH_MODES and device.type != "cuda":
            raise LaunchError(f"--compile_cuda_graphs records CUDA graphs, and this run's device is {device}")
        missing = _missing_compiler(device)
        if missing:
            if self.config.activation_memory_budget is not None:
                raise LaunchError(f"--activation_memory_budget needs inductor, which cannot run here: {missing}")
            _say(f"{missing}; training continues eager")
            self.config = None
            compile_workers.stop()
            return
        try:
            self.acceleration = apply(model, self.config)
        except UnknownLayout as error:  # this checkout's models are not the ones the launcher knows
            raise unknown_layout(str(error)) from None
        if HAS_CACHE_ARTIFACTS and not self.args.no_compile_cache:
            self.compile_cache = RunCompileCache(model, self.acceleration.signature, self.acceleration)
            self.acceleration.on_remove(self.compile_cache.remove)
        switched = self.acceleration.stats()["checkpointing_switched_off"]
        _say(
            f"{self.config.mode} compile of {type(model).__name__} "
            f"{[b.path for b in self.acceleration.block_lists]}: {len(self.acceleration.regions)} regions"
        )
        if switched:
            _say(
                f"--activation_memory_budget {self.config.activation_memory_budget} replaces gradient "
                f"checkpointing of the compiled blocks: {len(switched)} checkpoint switches (the "
                f"gradient_checkpointing flags of the model and its blocks) turned off: {', '.join(switched[:4])}"
                f"{', ...' if len(switched) > 4 else ''}"
            )
        atexit.register(self.report)

    def step_done(self, device: torch.device) -> None:
        """After every backward: a warning if the step spilled out of the GPU's memory; the first
        step's report, then the run's cache file saved again once the graphs that were in the
        compile workers at the first step run compiled."""
        if device.type == "cuda" and not self._warned_of_spill:
            self._warn_of_spill(device)
        if self.acceleration is None:
            return
        if not self._reported_first_step:
            self.first_step_done()
        elif (
            self._resave_after is not None
            and self._graphs_back() >= self._resave_after
            and self._auto_waiting_for() is None
        ):
            self._resave()

    def _warn_of_spill(self, device: torch.device) -> None:
        """Once a run: the step reserved more than the GPU has (memory.spill_warning), and the flag
        that keeps it within."""
        if self.config is not None and self.config.activation_memory_budget == "auto":
            fix = "a lower --vram_limit_gib than auto's (the first step's report says which) leaves the rest more room"
        else:
            swapping = ", swapping more blocks where no budget fits" if self._can_swap_blocks else ""
            fix = f"--activation_memory_budget auto keeps the steps within the GPU's memory{swapping}"
        message = spill_warning(device, fix)
        if message is not None:
            self._warned_of_spill = True
            warn(message)

    def _auto_waiting_for(self) -> str | None:
        """What auto's calibration waits for from the compile workers, if anything."""
        auto = self.acceleration.auto_budget
        return None if auto is None else auto.waiting_for

    def _graphs_back(self) -> int:
        """Graphs handed to the compile workers that run compiled now (or failed there)."""
        stats = self.acceleration.stats()
        return stats["worker_graphs_compiled"] + len(stats["worker_failures"])

    def _resave(self) -> None:
        self._resave_after = None
        stats = self.acceleration.stats()
        saved = self.compile_cache.save()
        said = [f"compiled graphs saved to {self.compile_cache.path}"] if saved else []
        if stats["worker_graphs_started"]:
            compiled = f"{stats['worker_graphs_compiled']} of {stats['worker_graphs_started']}"
            said.insert(0, f"{compiled} graphs from the compile workers run compiled")
        if said:
            _say("; ".join(said))

    def first_step_done(self) -> None:
        """Once, after the first backward: what compiling cost, and what auto chose."""
        if self.acceleration is None or self._reported_first_step:
            return
        self._reported_first_step = True
        # (Before the stats and the cache's save below: they see the workers' graphs compiled.)
        waiting_asked = self.args is not None and self.args.compile_workers_wait
        waited_for = compile_workers.wait_and_load() if waiting_asked else 0
        stats = self.acceleration.stats()
        has_cache = self.compile_cache is not None and self.compile_cache.path is not None
        ended = end_first_step(self.acceleration, self.compile_cache if has_cache else None)
        auto = stats.get("auto_budget")
        auto_waiting = self._auto_waiting_for()
        chose = ""
        if auto:
            offload = f" at {auto['offload_name']} {auto['offload']:g}" if auto["offload_name"] else ""
            chose = f"; auto chose budget {auto['budget']}{offload}{' (cached)' if auto['cached'] else ''}"
        elif auto_waiting is not None:
            chose = f"; auto goes on once {auto_waiting} are back from the compile workers"
        waiting = stats["worker_graphs_started"] - self._graphs_back()
        cache = ""
        if has_cache:
            loaded = "loaded from" if self.compile_cache.loaded else "not yet in"
            saved = ", saved there" if ended.saved_bytes else ""
            if waiting or auto_waiting is not None:  # the file lacks them: saved again once back
                self._resave_after = stats["worker_graphs_started"]
                compiled = "auto has chosen" if auto_waiting else "the compile workers' graphs run compiled"
                saved += f" (again once {compiled})"
            cache = f"; compiled graphs {loaded} {self.compile_cache.path}{saved}"
            precompiled = sum(f.precompiled.used for f in self.acceleration.functions)
            if precompiled:
                cache += f", {precompiled} of them precompiled at an earlier start (run without dynamo's trace)"
        times = self.acceleration.compile_times()
        could_use_workers = not self.acceleration.config.compile_workers and compile_workers.SUPPORTED
        if waited_for:
            workers = f"; waited for the {waited_for} graphs compiling in the workers (--compile_workers_wait)"
        elif waiting:
            workers = (
                f"; {waiting} graphs from the compile workers not running compiled yet (run uncompiled until then; "
                "the compile_accel log says when each does)"
            )
        elif could_use_workers and times.total_s >= WORKERS_HINT_SECONDS:
            workers = (
                f"; --compile_workers {max(1, min(8, (os.cpu_count() or 2) // 2))} would compile the graphs in worker "
                "processes while the first steps run them uncompiled"
            )
        else:
            workers = ""
        _say(
            f"first step done: {times.summary()}; {stats['unique_graphs']} "
            f"graphs, {stats['recompiles']} recompiles, {len(stats['fallbacks'])} fallbacks{chose}{cache}{workers}"
        )
        if ended.frozen is not None:
            _say(
                f"{ended.frozen} Python objects frozen out of the garbage collector's passes (a full pass over what "
                "compiling leaves takes a step's time; gc.unfreeze() undoes it)"
            )

    def report(self) -> None:
        if self._auto_waiting_for() is not None:
            _say(
                f"auto did not finish: training ended while it waited for {self._auto_waiting_for()} from the "
                "compile workers; nothing was cached, and the next run calibrates again"
            )
        if self._resave_after is not None:  # training ended before the workers' graphs ran compiled
            self._resave()
        precompiling = None if self.compile_cache is None else self.compile_cache.precompiling
        if precompiling is not None and precompiling.join(PRECOMPILE_WAIT_SECONDS) is None:
            _say(
                f"the graphs precompiled for the next start were not back from the compile workers after "
                f"{PRECOMPILE_WAIT_SECONDS} s more; the next start compiles as usual"
            )
        stats = self.acceleration.stats()
        keys = ("compiled_regions", "unique_graphs", "recompiles", "graph_breaks", "compile_seconds", "fallbacks")
        _say(", ".join(f"{k}={stats[k]:.1f}" if k == "compile_seconds" else f"{k}={stats[k]}" for k in keys))


# The sd-scripts the launcher is tested against (.ci/e2e pins it).
KNOWN_TO_WORK = "sd3 branch at 3265f2ed (2026-02-16)"


def unknown_layout(what: str) -> LaunchError:
    """The error that stops a launch, before training, at a checkout whose hook points differ."""
    return LaunchError(
        f"unknown sd-scripts layout: {what}. Nothing was trained; the launcher is known to work with sd-scripts' "
        f"{KNOWN_TO_WORK}"
    )


def _install_hooks(launch: Launch) -> None:
    """Wrap add_training_arguments, Accelerator.prepare and Accelerator.backward (see the module docstring)."""
    try:
        from library import train_util
    except ImportError as error:
        raise unknown_layout(f"cannot import library.train_util ({error})") from None
    if not hasattr(train_util, "add_training_arguments"):
        raise unknown_layout("library/train_util.py has no add_training_arguments")
    from accelerate import Accelerator

    add_training_arguments = train_util.add_training_arguments
    prepare = Accelerator.prepare
    backward = Accelerator.backward

    def add_training_arguments_and_ours(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        add_training_arguments(parser, *args, **kwargs)
        launch.watch(parser)

    def prepare_accelerated(accelerator: Accelerator, *args: Any, **kwargs: Any) -> Any:
        model = next((a for a in args if is_sd_scripts_model(a)), None)
        if model is not None:
            launch.accelerate(model, accelerator.device)
        return prepare(accelerator, *args, **kwargs)

    def backward_reported(accelerator: Accelerator, *args: Any, **kwargs: Any) -> Any:
        result = backward(accelerator, *args, **kwargs)
        launch.step_done(accelerator.device)
        return result

    train_util.add_training_arguments = add_training_arguments_and_ours
    Accelerator.prepare = prepare_accelerated
    Accelerator.backward = backward_reported


def _resolve(script: str, sd_scripts: str | None) -> tuple[Path, Path]:
    """(script path, checkout directory); LaunchError naming what was looked for."""
    path = Path(script)
    if sd_scripts is not None and not path.is_file():
        path = Path(sd_scripts) / script
    if not path.is_file():
        raise LaunchError(f"no training script at {path}")
    root = Path(sd_scripts) if sd_scripts is not None else path.resolve().parent
    if not (root / "library" / "train_util.py").is_file():
        raise LaunchError(
            f"{root} is not an sd-scripts checkout (looked for library/train_util.py); pass --sd-scripts DIR"
        )
    return path.resolve(), root.resolve()


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's own arguments: everything after the script goes to the script."""
    parser.add_argument("--sd-scripts", metavar="DIR", help="the sd-scripts checkout (default: the script's directory)")
    parser.add_argument("script", help="an sd-scripts training script, e.g. lumina_train_network.py")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="the script's arguments; its --help lists the compile flags"
    )


def run(script: str, args: list[str], sd_scripts: str | None = None) -> None:
    """Run `script` with `args` as `__main__`, with the compile flags added to its parser."""
    path, root = _resolve(script, sd_scripts)
    sys.path.insert(0, str(root))
    _install_hooks(Launch())
    sys.argv = [str(path), *args]
    runpy.run_path(str(path), run_name="__main__")


def launch(options: argparse.Namespace, prog: str) -> int:
    """Run the parsed launcher arguments; exit status 2 with one line for a LaunchError."""
    try:
        run(options.script, options.args, options.sd_scripts)
    except LaunchError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


DESCRIPTION = "run a kohya sd-scripts training script with per-block torch.compile, the checkout unchanged"


def main(argv: list[str] | None = None) -> int:
    prog = "python -m compile_accel.integrations.sd_scripts"
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_launcher_arguments(parser)
    return launch(parser.parse_args(argv), prog)


if __name__ == "__main__":
    sys.exit(main())
