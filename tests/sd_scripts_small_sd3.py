"""Run sd-scripts' sd3_train_network.py end to end on small random checkpoints.

sd-scripts sizes MMDiT from the checkpoint's tensors (its depth from x_embedder's width), so a
small checkpoint makes a small MMDiT; CLIP-L, CLIP-G and T5-XXL come from configs written into
sd3_utils and flux_utils at full size, which `shrink_factories`, run before the script, shrinks.
`make_workspace` writes a two-block SD3.5-large-style MMDiT (RMS q/k norm), the small text
encoders, the VAE at full size, the dataset and the tokenizers (sd_scripts_small_common).

    python tests/sd_scripts_small_sd3.py [--record DIR] --sd-scripts DIR sd3_train_network.py ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from library import sd3_models
import sd_scripts_small_common as common

SCRIPT = "sd3_train_network.py"
DEPTH = 2  # MMDiT's width is 64 * depth: 128, in 2 heads
POS_EMBED_SIZE = 8  # positions for up to 8x8 patches; a 64x64 image has 4x4 (VAE /8, patch 2)


def shrink_factories() -> None:
    """Make sd-scripts build the small text encoders."""
    from library import flux_utils, sd3_utils

    sd3_utils.CLIPTextConfig = common.small_clip(transformers.CLIPTextConfig)
    flux_utils.T5Config = common.small_t5(transformers.T5Config)  # sd3_utils.load_t5xxl builds T5 there


def small_mmdit() -> torch.nn.Module:
    params = sd3_models.SD3Params(
        patch_size=2,
        depth=DEPTH,
        num_patches=POS_EMBED_SIZE**2,
        pos_embed_max_size=POS_EMBED_SIZE,
        adm_in_channels=sum(common.SMALL_CLIP[width]["projection_dim"] for width in (768, 1280)),  # pooled L and G
        qk_norm="rms",
        x_block_self_attn_layers=[],
        context_embedder_in_features=common.SMALL_T5["d_model"],
        context_embedder_out_features=64 * DEPTH,
        model_type="5-large",
    )
    mmdit = sd3_models.create_sd3_mmdit(params)
    # What MMDiT allocates uninitialised: the fixed sin-cos table of a checkpoint, and q/k norm
    # scales (ones, as a norm starts).
    table = sd3_models.get_2d_sincos_pos_embed(mmdit.hidden_size, POS_EMBED_SIZE)
    mmdit.pos_embed.copy_(torch.from_numpy(table).unsqueeze(0))
    for norm in mmdit.modules():
        if isinstance(norm, sd3_models.RMSNorm) and norm.learnable_scale:
            torch.nn.init.ones_(norm.weight)
    return mmdit


def make_workspace(root: Path) -> dict[str, Path]:
    """Random checkpoints, dataset and tokenizers under `root`; returns the paths the script needs."""
    from library import strategy_sd3  # imports train_util: only where a run needs it

    torch.manual_seed(0)
    paths = {"dataset": common.write_dataset(root), "hub": root / "hub"}
    mmdit = {f"model.diffusion_model.{k}": v for k, v in small_mmdit().state_dict().items()}
    paths["mmdit"] = common.save(mmdit, root / "mmdit.safetensors")
    paths["clip_l"] = common.save(common.small_clip_model(768, projection=True), root / "clip_l.safetensors")
    paths["clip_g"] = common.save(common.small_clip_model(1280, projection=True), root / "clip_g.safetensors")
    paths["t5xxl"] = common.save(common.small_t5_model(), root / "t5xxl.safetensors")
    paths["vae"] = common.save(sd3_models.SDVAE(), root / "vae.safetensors")
    for repo_id in (strategy_sd3.CLIP_L_TOKENIZER_ID, strategy_sd3.CLIP_G_TOKENIZER_ID):
        common.write_clip_tokenizer(paths["hub"], repo_id)
    common.write_t5_tokenizer(paths["hub"], strategy_sd3.T5_XXL_TOKENIZER_ID)
    return paths


def train_args(paths: dict[str, Path]) -> list[str]:
    """The script's own arguments for the workspace: the model files and LoRA."""
    return [
        *("--pretrained_model_name_or_path", str(paths["mmdit"]), "--clip_l", str(paths["clip_l"])),
        *("--clip_g", str(paths["clip_g"]), "--t5xxl", str(paths["t5xxl"]), "--vae", str(paths["vae"])),
        *("--network_module", "networks.lora_sd3", "--t5xxl_max_token_length", str(common.T5_MAX_TOKENS)),
        "--cache_text_encoder_outputs",
    ]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
