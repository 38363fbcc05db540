"""The models `compile-accel bench` trains: each with LoRA, a batch, and how to accelerate it."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.nn as nn

import compile_accel
from compile_accel import Acceleration, CompileConfig

from .lora import TINY_DIT_LORA_TARGETS, KohyaStyleLoRANetwork
from .tiny_dit import COMPILE_EXCLUDE, TinyDiT, TinyDiTConfig, make_inputs

# Sized so that a step is dominated by the model on each device, and compiles in seconds on a CPU.
TINY_CONFIGS = {
    "cpu": TinyDiTConfig(dim=64, heads=4, text_dim=64, double_blocks=2, single_blocks=4),
    "cuda": TinyDiTConfig(dim=1536, heads=16, text_dim=1024, double_blocks=4, single_blocks=8),
}
TINY_SHAPES = {"cpu": {"batch": 2, "res": 32, "text_len": 32}, "cuda": {"batch": 2, "res": 128, "text_len": 256}}


def _nothing() -> None:
    pass


@dataclass
class BenchModel:
    description: str
    model: nn.Module
    lora_params: list[nn.Parameter]
    forward: Callable[[nn.Module], torch.Tensor]  # the model's inputs, given to `model` or its DDP wrapper
    target: torch.Tensor
    enable_checkpointing: Callable[[], None]
    accelerate: Callable[[nn.Module, CompileConfig], Acceleration] = compile_accel.apply
    exclude: list[str] = field(default_factory=list)
    wrapper: nn.Module | None = None  # DistributedDataParallel around `model`, when the mode asks for it
    # sd-scripts' prepare_block_swap_before_forward with --blocks-to-swap: the swapped blocks back
    # where a forward starts, after a step cut short (a forward's backward brings them back itself).
    reset_block_swap: Callable[[], None] = _nothing

    def predict(self) -> torch.Tensor:
        return self.forward(self.model if self.wrapper is None else self.wrapper)


def tiny(device: str, lora_rank: int, batch: int | None, res: int | None) -> BenchModel:
    config = TINY_CONFIGS[device]
    shape = dict(TINY_SHAPES[device])
    shape["batch"] = batch or shape["batch"]
    shape["res"] = res // 8 if res else shape["res"]  # --res is in pixels, as for the real models
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = TinyDiT(config).to(device=device, dtype=dtype).requires_grad_(False)
    network = KohyaStyleLoRANetwork(model, TINY_DIT_LORA_TARGETS, rank=lora_rank, alpha=lora_rank).to(device)
    model._bench_network = [network]  # kohya keeps the network outside the model
    inputs = make_inputs(config, shape["batch"], shape["res"], shape["text_len"], device=device, dtype=dtype)
    return BenchModel(
        f"embedded DiT (dim {config.dim}, {config.double_blocks}+{config.single_blocks} blocks, "
        f"{shape['res']}x{shape['res']} latents, batch {shape['batch']}), kohya-style LoRA r{lora_rank}",
        model,
        list(network.parameters()),
        lambda module: module(*inputs),
        torch.randn_like(inputs[0]),
        model.enable_gradient_checkpointing,
        exclude=COMPILE_EXCLUDE,
    )


ATTENTION_PROJECTIONS = ["to_q", "to_k", "to_v", "to_out.0"]
JOINT_ATTENTION_PROJECTIONS = [*ATTENTION_PROJECTIONS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def _peft_lora(model: nn.Module, targets: list[str], rank: int) -> list[nn.Parameter]:
    """Freeze the model, add a peft LoRA with fp32 weights (as trainers keep them); its parameters."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


def _diffusers_bench(description: str, model: nn.Module, params: list[nn.Parameter], inputs: dict) -> BenchModel:
    """A diffusers transformer called with keyword inputs, accelerated through its adapter."""
    from compile_accel.integrations import diffusers as accel_diffusers

    return BenchModel(
        description,
        model,
        params,
        lambda module: module(**inputs, return_dict=False)[0],
        torch.randn_like(inputs["hidden_states"]),
        model.enable_gradient_checkpointing,
        accel_diffusers.apply,
    )


def lumina2(device: str, lora_rank: int, batch: int | None, res: int | None) -> BenchModel:
    """diffusers' Lumina2Transformer2DModel at full size (26 layers, hidden 2304), random bf16
    weights, peft LoRA on to_q/to_k/to_v/to_out.0 (fp32), 256 caption tokens."""
    from diffusers import Lumina2Transformer2DModel

    batch, res = batch or 2, res or 1024
    with torch.device(device):
        model = Lumina2Transformer2DModel(num_layers=26, cap_feat_dim=2304).to(torch.bfloat16)
    params = _peft_lora(model, ATTENTION_PROJECTIONS, lora_rank)
    inputs = dict(
        hidden_states=torch.randn(batch, 16, res // 8, res // 8, device=device, dtype=torch.bfloat16),
        timestep=torch.rand(batch, device=device),
        encoder_hidden_states=torch.randn(batch, 256, 2304, device=device, dtype=torch.bfloat16),
        encoder_attention_mask=torch.ones(batch, 256, device=device, dtype=torch.bool),
    )
    description = f"diffusers Lumina2Transformer2DModel full size, batch {batch}, {res}x{res}, peft LoRA r{lora_rank}"
    return _diffusers_bench(description, model, params, inputs)


def flux(device: str, lora_rank: int, batch: int | None, res: int | None) -> BenchModel:
    """diffusers' FluxTransformer2DModel at its default (Flux-dev, ~12B) size with guidance
    embedding, random bf16 weights, peft LoRA on the attention projections (fp32), 512 text tokens."""
    from diffusers import FluxTransformer2DModel

    batch, res = batch or 1, res or 1024
    # Seen on an H200 with torch 2.11+cu130: cuDNN attention fails on Flux's shapes
    # (mha_graph.execute, then CUBLAS_STATUS_EXECUTION_FAILED); flash attention does not.
    torch.backends.cuda.enable_cudnn_sdp(False)
    with torch.device(device):
        model = FluxTransformer2DModel(guidance_embeds=True).to(torch.bfloat16)
    params = _peft_lora(model, JOINT_ATTENTION_PROJECTIONS, lora_rank)
    side = res // 16  # 8x VAE, then 2x2 patches packed into 64 channels
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    inputs = dict(
        hidden_states=torch.randn(batch, side * side, 64, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(batch, 512, 4096, device=device, dtype=torch.bfloat16),
        pooled_projections=torch.randn(batch, 768, device=device, dtype=torch.bfloat16),
        timestep=torch.rand(batch, device=device),
        guidance=torch.full((batch,), 3.5, device=device),
        img_ids=torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float().to(device),
        txt_ids=torch.zeros(512, 3, device=device),
    )
    description = (
        f"diffusers FluxTransformer2DModel (Flux-dev size), batch {batch}, {res}x{res}, peft LoRA r{lora_rank}"
    )
    return _diffusers_bench(description, model, params, inputs)


def sd3(device: str, lora_rank: int, batch: int | None, res: int | None) -> BenchModel:
    """diffusers' SD3Transformer2DModel at SD3-medium size (24 joint blocks, hidden 1536), random
    bf16 weights, peft LoRA on the attention projections of both streams (fp32), 333 text tokens
    (77 CLIP + 256 T5)."""
    from diffusers import SD3Transformer2DModel

    batch, res = batch or 2, res or 1024
    with torch.device(device):
        model = SD3Transformer2DModel(
            num_layers=24,
            num_attention_heads=24,
            attention_head_dim=64,
            caption_projection_dim=1536,
            joint_attention_dim=4096,
            pooled_projection_dim=2048,
            pos_embed_max_size=192,
        ).to(torch.bfloat16)
    params = _peft_lora(model, JOINT_ATTENTION_PROJECTIONS, lora_rank)
    inputs = dict(
        hidden_states=torch.randn(batch, 16, res // 8, res // 8, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(batch, 333, 4096, device=device, dtype=torch.bfloat16),
        pooled_projections=torch.randn(batch, 2048, device=device, dtype=torch.bfloat16),
        timestep=torch.rand(batch, device=device) * 1000,
    )
    description = (
        f"diffusers SD3Transformer2DModel (SD3-medium size), batch {batch}, {res}x{res}, peft LoRA r{lora_rank}"
    )
    return _diffusers_bench(description, model, params, inputs)


# diffusers' defaults are Wan 2.1 14B (40 layers, hidden 5120); tests swap in a small config.
WAN_CONFIG: dict = {}
WAN_LATENT_FRAMES = 21  # 81 video frames through Wan's 4x temporal VAE


def wan(device: str, lora_rank: int, batch: int | None, res: int | None) -> BenchModel:
    """diffusers' WanTransformer3DModel at its default (Wan 2.1 14B text-to-video) size, random
    bf16 weights, peft LoRA on the attention projections (fp32), 512 text tokens, 81 frames of
    res x res video (21 latent frames)."""
    from diffusers import WanTransformer3DModel

    batch, res = batch or 1, res or 480
    with torch.device(device):
        model = WanTransformer3DModel(**WAN_CONFIG).to(torch.bfloat16)
    params = _peft_lora(model, ATTENTION_PROJECTIONS, lora_rank)
    config = model.config
    inputs = dict(
        hidden_states=torch.randn(
            batch, config.in_channels, WAN_LATENT_FRAMES, res // 8, res // 8, device=device, dtype=torch.bfloat16
        ),
        timestep=torch.rand(batch, device=device) * 1000,
        encoder_hidden_states=torch.randn(batch, 512, config.text_dim, device=device, dtype=torch.bfloat16),
    )
    description = (
        f"diffusers WanTransformer3DModel ({config.num_layers} layers, hidden "
        f"{config.num_attention_heads * config.attention_head_dim}), batch {batch}, {WAN_LATENT_FRAMES} latent "
        f"frames of {res}x{res}, peft LoRA r{lora_rank}"
    )
    return _diffusers_bench(description, model, params, inputs)


# ---- kohya sd-scripts' own models and LoRA networks, imported from $SD_SCRIPTS_DIR ----------

# Tests swap in small configs: FLUX_CONFIG overrides fields of sd-scripts' configs["dev"].params,
# SD3_CONFIG fields of SD3_MEDIUM (the SD3Params sd3_utils.analyze_state_dict_state reads from the
# SD3 medium checkpoint). The SDXL U-Net takes its size from sd-scripts' module constants.
FLUX_CONFIG: dict = {}
SD3_MEDIUM: dict = dict(
    patch_size=2,
    depth=24,
    num_patches=192 * 192,
    pos_embed_max_size=192,
    adm_in_channels=2048,
    qk_norm=None,
    x_block_self_attn_layers=[],
    context_embedder_in_features=4096,
    context_embedder_out_features=1536,
    model_type="medium",
)
SD3_CONFIG: dict = {}
# Anima (Cosmos-Predict2 2B with its LLM adapter), as anima_utils.load_anima_model builds it from
# its checkpoint; the adapter turns Qwen3-0.6B's hidden states (QWEN3_FEATURES) into T5 tokens'
# embeddings for the blocks' cross-attention. Tests swap in small ones.
ANIMA_CONFIG: dict = dict(
    max_img_h=512,
    max_img_w=512,
    max_frames=128,
    in_channels=16,
    out_channels=16,
    patch_spatial=2,
    patch_temporal=1,
    concat_padding_mask=True,
    model_channels=2048,
    num_blocks=28,
    num_heads=16,
    crossattn_emb_channels=1024,
    pos_emb_cls="rope3d",
    pos_emb_learnable=True,
    use_adaln_lora=True,
    adaln_lora_dim=256,
    rope_h_extrapolation_ratio=4.0,
    rope_w_extrapolation_ratio=4.0,
    rope_enable_fps_modulation=False,
    use_llm_adapter=True,
)
QWEN3_FEATURES = 1024
# HunyuanImage 2.1's sizes are fixed in its __init__; its text input is Qwen2.5-VL 7B's hidden
# states (a caption's tokens, here 256) and byT5's 128 tokens of quoted text (here 16 of them).
# Tests swap in a small width.
HUNYUAN_IMAGE_TEXT_FEATURES = 3584


@dataclass(frozen=True)
class SdScriptsOptions:
    """sd-scripts' own memory options, as `compile-accel bench` passes them to the sd-scripts models."""

    fp8_base: bool = False  # --fp8_base
    blocks_to_swap: int | None = None  # --blocks_to_swap
    fp8_scaled: bool = False  # --fp8_scaled (HunyuanImage)


@dataclass
class SdScriptsModel:
    """What differs between the sd-scripts models: the rest (casting, LoRA, placement) is the trainers'."""

    description: str
    make: Callable[[], nn.Module]  # the base model at random weights, as the trainer's loader builds it
    network: str  # sd-scripts' LoRA module, networks/<network>.py
    text_encoders: int  # how many its create_network is given (none gets LoRA: the U-Net/DiT alone trains)
    call: Callable[[nn.Module], torch.Tensor]  # the forward, as the trainer calls the model
    latents: torch.Tensor  # the noisy input; the prediction has its shape
    conditions: list[torch.Tensor]  # the other float inputs the trainer makes require grad
    swap_options: dict = field(default_factory=dict)  # what the trainer passes enable_block_swap besides (N, device)
    # The trainers with --fp8_scaled: the module of their loader, whose FP8_OPTIMIZATION_TARGET_KEYS
    # and FP8_OPTIMIZATION_EXCLUDE_KEYS say which layers it quantizes; None without.
    fp8_scaled_loader: ModuleType | None = None


def _sd_scripts_path() -> None:
    """Make sd-scripts' `library` and `networks` importable (default: .sd-scripts/ in this repository)."""
    root = os.environ.get("SD_SCRIPTS_DIR", str(Path(__file__).resolve().parent.parent / ".sd-scripts"))
    if root not in sys.path:
        sys.path.insert(0, root)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _sd_scripts_base(spec: SdScriptsModel, device: str, options: SdScriptsOptions) -> nn.Module:
    """The frozen base model as the trainers load it. Built in bf16 (a full-size fp32 copy would not
    fit where the bf16 one does). fp8_base casts the whole model, every float parameter and buffer,
    to float8_e4m3fn, as flux/sd3/lumina_train_network.py's load_target_model do
    (`model.to(torch.float8_e4m3fn)`) and train_network.py does for --fp8_base
    (`unet.to(dtype=unet_weight_dtype)`); the forward then relies on bf16 autocast to compute
    in bf16. fp8_scaled quantizes the weights of the Linear layers its loader quantizes, as
    hunyuan_image_models' loader does (sd-scripts' own optimize_state_dict_with_fp8
    and apply_fp8_monkey_patch: float8_e4m3fn with a bf16 scale per 64 inputs of each output, the
    forward dequantizing to bf16 before each matmul); the rest stays bf16. blocks_to_swap calls
    enable_block_swap(N, device), as they do; the swapped blocks' weights go to the host when the
    model is placed."""
    # Random weights are drawn on the device: initialising a 12B model on the host takes minutes
    # per mode. bf16 Flux-dev (22.2 GiB) still fits a 24 GiB cap before the fp8 cast halves it.
    with torch.device(device), _default_dtype(torch.bfloat16):
        model = spec.make()
    model.to(torch.float8_e4m3fn if options.fp8_base else torch.bfloat16).requires_grad_(False)
    if options.fp8_scaled:
        _fp8_scaled(model, spec, device)
    if options.blocks_to_swap:
        model.enable_block_swap(options.blocks_to_swap, torch.device(device), **spec.swap_options)
    return model


@torch.no_grad()
def _fp8_scaled(model: nn.Module, spec: SdScriptsModel, device: str) -> None:
    """The model's weights quantized as its trainer's loader does under --fp8_scaled (on `device`,
    each weight left where it was)."""
    from library.fp8_optimization_utils import apply_fp8_monkey_patch, optimize_state_dict_with_fp8

    loader = spec.fp8_scaled_loader
    if loader is None:
        raise ValueError(f"{spec.description}: its trainer has no --fp8_scaled")
    targets, excluded = loader.FP8_OPTIMIZATION_TARGET_KEYS, loader.FP8_OPTIMIZATION_EXCLUDE_KEYS
    state = optimize_state_dict_with_fp8(model.state_dict(), device, targets, excluded)
    apply_fp8_monkey_patch(model, state, use_scaled_mm=False)
    model.load_state_dict(state, strict=True, assign=True)


@torch.no_grad()
def _drawn_on_host(model: nn.Module, device: str) -> None:
    """Random weights for the parameters a loader left on the meta device, drawn on `device` one
    module at a time (its reset_parameters) and kept on the host, where a trainer's loader leaves
    a model too large for the GPU before block swap places it."""
    for name, module in model.named_modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not any(t.is_meta for t in own):
            continue
        if not hasattr(module, "reset_parameters") or not all(t.is_meta for t in own):
            raise TypeError(f"{name} ({type(module).__name__}): no reset_parameters to draw its weights with")
        module.to_empty(device=device, recurse=False)
        module.reset_parameters()
        drawn = [t.to("cpu", copy=True) for t in module.parameters(recurse=False)]  # (to_empty reuses the objects)
        module.to_empty(device="cpu", recurse=False)
        for parameter, value in zip(module.parameters(recurse=False), drawn):
            parameter.copy_(value)


def _sd_scripts_lora(model: nn.Module, spec: SdScriptsModel, rank: int, device: str) -> nn.Module:
    """sd-scripts' own LoRA network (alpha = rank) applied to the model alone, kept fp32 on the
    device as train_network.py keeps it (the base model's casts do not reach it: apply_to wraps
    the modules' forward without making the network their child)."""
    module = importlib.import_module(f"networks.{spec.network}")
    network = module.create_network(1.0, rank, rank, None, [nn.Module() for _ in range(spec.text_encoders)], model)
    network.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    return network.to(device).requires_grad_(True)


def _place(model: nn.Module, device: str, blocks_to_swap: int | None) -> None:
    """On the device as the trainers' prepare_unet_with_accelerator leaves it: with block swap, all
    but the swapped blocks' weights (move_to_device_except_swap_blocks, then
    prepare_block_swap_before_forward); without, the whole model."""
    if blocks_to_swap:
        model.move_to_device_except_swap_blocks(torch.device(device))
        model.prepare_block_swap_before_forward()
    else:
        model.to(device)


def _sd_scripts_bench(spec: SdScriptsModel, device: str, lora_rank: int, options: SdScriptsOptions) -> BenchModel:
    """An sd-scripts model with its LoRA in train_network.py's order: the base model loaded (cast,
    block swap enabled), the network applied, the model placed; accelerated through the
    launcher's own code path (compile_accel.integrations.sd_scripts.apply)."""
    from compile_accel.integrations import sd_scripts as accel_sd_scripts

    swap = options.blocks_to_swap
    model = _sd_scripts_base(spec, device, options)
    network = _sd_scripts_lora(model, spec, lora_rank, device)
    model._bench_network = [network]  # kohya keeps the network outside the model
    _place(model, device, swap)

    def enable_checkpointing() -> None:
        model.enable_gradient_checkpointing()
        # As the trainers do under --gradient_checkpointing (the SDXL U-Net checkpoints reentrantly,
        # which gives LoRA no gradient unless an input requires grad).
        for tensor in (spec.latents, *spec.conditions):
            tensor.requires_grad_(True)

    notes = (", fp8 base" if options.fp8_base else "") + (", fp8 scaled" if options.fp8_scaled else "")
    notes += f", {swap} blocks swapped" if swap else ""
    return BenchModel(
        f"{spec.description} r{lora_rank}{notes}",
        model,
        list(network.parameters()),
        spec.call,
        torch.randn_like(spec.latents),
        enable_checkpointing,
        accel_sd_scripts.apply,
        # (auto may swap blocks where --blocks-to-swap asked for none)
        reset_block_swap=getattr(model, "prepare_block_swap_before_forward", _nothing),
    )


def sdscripts_lumina2(
    device: str, lora_rank: int, batch: int | None, res: int | None, options: SdScriptsOptions = SdScriptsOptions()
) -> BenchModel:
    """kohya sd-scripts' NextDiT at full size (NextDiT_2B_GQA_patch2_Adaln_Refiner), random bf16
    weights, sd-scripts' own LoRA (networks/lora_lumina.py, fp32 weights, which need the runner's
    bf16 autocast, as in its trainer), 256 caption tokens."""
    _sd_scripts_path()
    from library import lumina_models

    batch, res = batch or 2, res or 1024
    x = torch.randn(batch, 16, res // 8, res // 8, device=device, dtype=torch.bfloat16)
    t = torch.rand(batch, device=device)
    captions = torch.randn(batch, 256, 2304, device=device, dtype=torch.bfloat16)
    mask = torch.ones(batch, 256, device=device, dtype=torch.bool)
    spec = SdScriptsModel(
        f"sd-scripts NextDiT (Lumina 2) full size, batch {batch}, {res}x{res}, lora_lumina",
        lumina_models.NextDiT_2B_GQA_patch2_Adaln_Refiner,
        "lora_lumina",
        1,
        lambda module: module(x, t, captions, mask),
        x,
        [captions],
    )
    return _sd_scripts_bench(spec, device, lora_rank, options)


def sdscripts_flux(
    device: str, lora_rank: int, batch: int | None, res: int | None, options: SdScriptsOptions = SdScriptsOptions()
) -> BenchModel:
    """kohya sd-scripts' Flux (library/flux_models.py) at Flux-dev size (configs["dev"], guidance
    embedding), random weights, its own LoRA (networks/lora_flux.py), 512 T5 tokens, called as
    flux_train_network.py calls it: packed latents, flux_utils.prepare_img_ids, timesteps / 1000,
    guidance 3.5 (its --guidance_scale default), no T5 attention mask."""
    _sd_scripts_path()
    from library import flux_models, flux_utils

    batch, res = batch or 1, res or 1024
    params = dataclasses.replace(flux_models.configs["dev"].params, **FLUX_CONFIG)
    side = res // 16  # 8x VAE, then 2x2 patches packed into the channels
    img = torch.randn(batch, side * side, params.in_channels, device=device, dtype=torch.bfloat16)
    img_ids = flux_utils.prepare_img_ids(batch, side, side).to(device)
    txt = torch.randn(batch, 512, params.context_in_dim, device=device, dtype=torch.bfloat16)
    txt_ids = torch.zeros(batch, 512, 3, device=device)
    pooled = torch.randn(batch, params.vec_in_dim, device=device, dtype=torch.bfloat16)
    t = torch.rand(batch, device=device)
    guidance = torch.full((batch,), 3.5, device=device)

    def call(module: nn.Module) -> torch.Tensor:
        return module(img=img, img_ids=img_ids, txt=txt, txt_ids=txt_ids, timesteps=t, y=pooled, guidance=guidance)

    spec = SdScriptsModel(
        f"sd-scripts Flux ({params.depth}+{params.depth_single_blocks} blocks, hidden {params.hidden_size}), "
        f"batch {batch}, {res}x{res}, lora_flux",
        lambda: flux_models.Flux(params),
        "lora_flux",
        2,
        call,
        img,
        [img_ids, txt, txt_ids, pooled, guidance],
    )
    return _sd_scripts_bench(spec, device, lora_rank, options)


def sdscripts_sdxl(
    device: str, lora_rank: int, batch: int | None, res: int | None, options: SdScriptsOptions = SdScriptsOptions()
) -> BenchModel:
    """kohya sd-scripts' SDXL U-Net (library/sdxl_original_unet.py) at full size, random weights,
    SDPA attention (set_use_sdpa(True), what sdxl_train_network.py does with --sdpa), LoRA from
    networks/lora.py on the U-Net alone, called as its call_unet does: latents, integer timesteps,
    77 tokens of 2048 (CLIP-L and bigG concatenated), the 2816-wide vector (pooled + size embeddings)."""
    _sd_scripts_path()
    from library import sdxl_original_unet as unet

    batch, res = batch or 4, res or 1024
    x = torch.randn(batch, unet.IN_CHANNELS, res // 8, res // 8, device=device, dtype=torch.bfloat16)
    t = torch.randint(0, 1000, (batch,), device=device)
    context = torch.randn(batch, 77, unet.CONTEXT_DIM, device=device, dtype=torch.bfloat16)
    vector = torch.randn(batch, unet.ADM_IN_CHANNELS, device=device, dtype=torch.bfloat16)

    def make() -> nn.Module:
        model = unet.SdxlUNet2DConditionModel()
        model.set_use_sdpa(True)
        return model

    spec = SdScriptsModel(
        f"sd-scripts SDXL U-Net (model channels {unet.MODEL_CHANNELS}), batch {batch}, {res}x{res}, lora",
        make,
        "lora",
        2,
        lambda module: module(x, t, context, vector),
        x,
        [context, vector],
    )
    return _sd_scripts_bench(spec, device, lora_rank, options)


def sdscripts_sd15(
    device: str, lora_rank: int, batch: int | None, res: int | None, options: SdScriptsOptions = SdScriptsOptions()
) -> BenchModel:
    """kohya sd-scripts' SD 1.x U-Net (library/original_unet.py, model_util's SD 1.5 config) at full
    size, random weights, SDPA attention (train_network.py's --sdpa), LoRA from networks/lora.py on
    the U-Net alone, called as train_network.py's call_unet does: latents, integer timesteps, 77
    tokens of CLIP-L's 768 features."""
    _sd_scripts_path()
    from library import model_util, original_unet

    batch, res = batch or 4, res or 512
    x = torch.randn(batch, original_unet.IN_CHANNELS, res // 8, res // 8, device=device, dtype=torch.bfloat16)
    t = torch.randint(0, 1000, (batch,), device=device)
    context = torch.randn(batch, 77, model_util.UNET_PARAMS_CONTEXT_DIM, device=device, dtype=torch.bfloat16)

    def make() -> nn.Module:
        model = original_unet.UNet2DConditionModel(**model_util.create_unet_diffusers_config(v2=False))
        model.set_use_sdpa(True)
        return model

    spec = SdScriptsModel(
        f"sd-scripts SD 1.x U-Net (model channels {model_util.UNET_PARAMS_MODEL_CHANNELS}), batch {batch}, "
        f"{res}x{res}, lora",
        make,
        "lora",
        1,
        lambda module: module(x, t, context).sample,
        x,
        [context],
    )
    return _sd_scripts_bench(spec, device, lora_rank, options)


def sdscripts_sd3(
    device: str, lora_rank: int, batch: int | None, res: int | None, options: SdScriptsOptions = SdScriptsOptions()
) -> BenchModel:
    """kohya sd-scripts' MMDiT (library/sd3_models.py) as sd3_utils.load_mmdit builds SD3 medium
    (create_sd3_mmdit with SD3_MEDIUM: depth 24, hidden 1536, 192x192 position embedding), random
    weights, its own LoRA (networks/lora_sd3.py), called as sd3_train_network.py calls it: latents,
    timesteps in [0, 1000), 333 context tokens (77 CLIP-L/G + 256 T5, its --t5xxl_max_token_length
    default), the pooled 2048-wide vector."""
    _sd_scripts_path()
    from library import sd3_models

    batch, res = batch or 1, res or 1024
    params = sd3_models.SD3Params(**{**SD3_MEDIUM, **SD3_CONFIG})
    x = torch.randn(batch, 16, res // 8, res // 8, device=device, dtype=torch.bfloat16)
    t = torch.rand(batch, device=device) * 1000
    context = torch.randn(batch, 333, params.context_embedder_in_features, device=device, dtype=torch.bfloat16)
    pooled = torch.randn(batch, params.adm_in_channels, device=device, dtype=torch.bfloat16)

    def make() -> nn.Module:
        model = sd3_models.create_sd3_mmdit(params)
        # The position embedding is a buffer the checkpoint fills (torch.empty until then): the
        # fixed sin-cos table of the model's size.
        table = sd3_models.get_2d_sincos_pos_embed(model.hidden_size, params.pos_embed_max_size)
        model.pos_embed.copy_(torch.from_numpy(table))
        return model

    spec = SdScriptsModel(
        f"sd-scripts MMDiT (SD3 {params.model_type}, depth {params.depth}), batch {batch}, {res}x{res}, lora_sd3",
        make,
        "lora_sd3",
        3,
        lambda module: module(x, t, context=context, y=pooled),
        x,
        [context, pooled],
    )
    return _sd_scripts_bench(spec, device, lora_rank, options)


def sdscripts_anima(
    device: str, lora_rank: int, batch: int | None, res: int | None, options: SdScriptsOptions = SdScriptsOptions()
) -> BenchModel:
    """kohya sd-scripts' Anima (library/anima_models.py) at full size (ANIMA_CONFIG), random
    weights, its own LoRA (networks/lora_anima.py, the DiT's blocks), called as
    anima_train_network.py calls it: one-frame latents, timesteps in [0, 1], Qwen3's hidden states
    of 512 tokens through the LLM adapter with 512 T5 token ids, a zero padding mask."""
    _sd_scripts_path()
    from library import anima_models

    batch, res = batch or 2, res or 1024
    x = torch.randn(batch, 16, 1, res // 8, res // 8, device=device, dtype=torch.bfloat16)
    t = torch.rand(batch, device=device)
    qwen3 = torch.randn(batch, 512, QWEN3_FEATURES, device=device, dtype=torch.bfloat16)
    t5_ids = torch.randint(0, 32128, (batch, 512), device=device)
    tokens = torch.ones(batch, 512, dtype=torch.long, device=device)  # attention masks: no padding
    padding = torch.zeros(batch, 1, res // 8, res // 8, device=device, dtype=torch.bfloat16)
    spec = SdScriptsModel(
        f"sd-scripts Anima (model channels {ANIMA_CONFIG['model_channels']}), batch {batch}, {res}x{res}, lora_anima",
        lambda: anima_models.Anima(**ANIMA_CONFIG),
        "lora_anima",
        1,
        lambda module: module(
            x,
            t,
            qwen3,
            padding_mask=padding,
            target_input_ids=t5_ids,
            target_attention_mask=tokens,
            source_attention_mask=tokens,
        ),
        x,
        [qwen3],
    )
    return _sd_scripts_bench(spec, device, lora_rank, options)


def sdscripts_hunyuan_image(
    device: str, lora_rank: int, batch: int | None, res: int | None, options: SdScriptsOptions = SdScriptsOptions()
) -> BenchModel:
    """kohya sd-scripts' HunyuanImage 2.1 DiT (library/hunyuan_image_models.py, 20 double and 40
    single blocks of width 3584: 17B parameters), built as its loader builds it (parameters on the
    meta device), random bf16 weights drawn on the device and kept on the host: 34 GB, over a 24
    GiB card, so run it with --blocks-to-swap, as its trainer (which has --fp8_scaled, not --fp8_base)
    is run; sd-scripts' guide pairs 24 GB with --fp8_scaled --blocks_to_swap 9.
    Its own LoRA (networks/lora_hunyuan_image.py); called as hunyuan_image_train_network.py calls
    it: the 32x VAE's 64-channel latents, integer timesteps, the caption's Qwen2.5-VL hidden states
    and byT5's with their masks; block swap with backward support, as that trainer enables it."""
    _sd_scripts_path()
    from library import hunyuan_image_models

    batch, res = batch or 1, res or 1024
    x = torch.randn(batch, 64, res // 32, res // 32, device=device, dtype=torch.bfloat16)
    t = torch.randint(0, 1000, (batch,), device=device)
    text = torch.randn(batch, 256, HUNYUAN_IMAGE_TEXT_FEATURES, device=device, dtype=torch.bfloat16)
    text_mask = torch.ones(batch, 256, dtype=torch.int64, device=device)
    glyphs = torch.randn(batch, 128, 1472, device=device, dtype=torch.bfloat16)
    glyph_mask = (torch.arange(128, device=device) < 16).long().expand(batch, -1)

    def make() -> nn.Module:
        model = hunyuan_image_models.create_model("torch", False, torch.bfloat16)
        _drawn_on_host(model, device)
        return model

    spec = SdScriptsModel(
        f"sd-scripts HunyuanImage 2.1 DiT, batch {batch}, {res}x{res}, lora_hunyuan_image",
        make,
        "lora_hunyuan_image",
        2,
        lambda module: module(x, t, text, text_mask, glyphs, glyph_mask),
        x,
        [text, glyphs],
        swap_options={"supports_backward": True},
        fp8_scaled_loader=hunyuan_image_models,
    )
    return _sd_scripts_bench(spec, device, lora_rank, options)


MODELS: dict[str, Callable[..., BenchModel]] = {  # (device, lora_rank, batch, res) -> BenchModel
    "tiny": tiny,
    "lumina2": lumina2,
    "flux": flux,
    "sd3": sd3,
    "wan": wan,
    "sdscripts-lumina2": sdscripts_lumina2,
    "sdscripts-flux": sdscripts_flux,
    "sdscripts-sdxl": sdscripts_sdxl,
    "sdscripts-sd15": sdscripts_sd15,
    "sdscripts-sd3": sdscripts_sd3,
    "sdscripts-anima": sdscripts_anima,
    "sdscripts-hunyuan-image": sdscripts_hunyuan_image,
}
# The sd-scripts models (their builders take SdScriptsOptions; which options each has: below).
SD_SCRIPTS_MODELS = sorted(name for name in MODELS if name.startswith("sdscripts-"))
# hunyuan_image_train_network.py refuses --fp8_base (it has --fp8_scaled, weights and scales of its own);
# anima_train_network.py turns --fp8_base off (and --fp8_scaled: its DiT supports neither).
FP8_BASE_MODELS = [name for name in SD_SCRIPTS_MODELS if name not in ("sdscripts-anima", "sdscripts-hunyuan-image")]
# The trainers with --fp8_scaled (sd-scripts' scaled fp8 weights).
FP8_SCALED_MODELS = ["sdscripts-hunyuan-image"]
# The models with enable_block_swap (the U-Nets have none).
BLOCK_SWAP_MODELS = ["sdscripts-anima", "sdscripts-flux", "sdscripts-hunyuan-image", "sdscripts-lumina2", "sdscripts-sd3"]
