"""The models `compile-accel bench` trains: each with LoRA, a batch, and how to accelerate it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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


def sdscripts_lumina2(device: str, lora_rank: int, batch: int | None, res: int | None) -> BenchModel:
    """kohya sd-scripts' NextDiT at full size (NextDiT_2B_GQA_patch2_Adaln_Refiner), random bf16
    weights, sd-scripts' own LoRA (networks/lora_lumina.py, fp32 weights, which need the runner's
    bf16 autocast, as in its trainer), 256 caption tokens. Imports from $SD_SCRIPTS_DIR
    (default: .sd-scripts/ in this repository)."""
    import os
    import sys

    from compile_accel.integrations import sd_scripts as accel_sd_scripts

    root = os.environ.get("SD_SCRIPTS_DIR", str(Path(__file__).resolve().parent.parent / ".sd-scripts"))
    sys.path.insert(0, root)
    from library import lumina_models
    from networks import lora_lumina

    batch, res = batch or 2, res or 1024
    with torch.device(device):
        model = lumina_models.NextDiT_2B_GQA_patch2_Adaln_Refiner().to(torch.bfloat16).requires_grad_(False)
    network = lora_lumina.create_network(1.0, lora_rank, lora_rank, None, [nn.Module()], model)
    network.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    network.to(device).requires_grad_(True)
    model._bench_network = [network]  # kohya keeps the network outside the model
    x = torch.randn(batch, 16, res // 8, res // 8, device=device, dtype=torch.bfloat16)
    t = torch.rand(batch, device=device)
    captions = torch.randn(batch, 256, 2304, device=device, dtype=torch.bfloat16)
    mask = torch.ones(batch, 256, device=device, dtype=torch.bool)
    return BenchModel(
        f"sd-scripts NextDiT (Lumina 2) full size, batch {batch}, {res}x{res}, lora_lumina r{lora_rank}",
        model,
        list(network.parameters()),
        lambda module: module(x, t, captions, mask),
        torch.randn_like(x),
        model.enable_gradient_checkpointing,
        accel_sd_scripts.apply,
    )


MODELS: dict[str, Callable[[str, int, int | None, int | None], BenchModel]] = {
    "tiny": tiny,
    "lumina2": lumina2,
    "flux": flux,
    "sd3": sd3,
    "wan": wan,
    "sdscripts-lumina2": sdscripts_lumina2,
}
