"""Run sd-scripts' sdxl_train_network.py end to end on a small random checkpoint.

sd-scripts' SdxlUNet2DConditionModel has its sizes in module constants (channels, time and
label embeddings) and in literals of its constructor (10 transformer layers a block at the
lowest level, 2048 cross-attention features); its two CLIP text encoders come from configs
written into sdxl_model_util. `small_factories` shrinks them where they are looked up: the
constants, the CLIP config class, and Transformer2DModel's constructor arguments (1 layer,
the small encoders' features). The U-Net keeps its layout: three levels, every ResBlock,
transformer, down- and upsampler. `make_workspace` writes one checkpoint in sd-scripts' own
single-file format (its save_stable_diffusion_checkpoint), with the VAE at full size.

    python tests/sd_scripts_small_sdxl.py [--record DIR] --sd-scripts DIR sdxl_train_network.py ARGS...
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from library import model_util, sdxl_model_util, sdxl_original_unet
import sd_scripts_small_common as common

SCRIPT = "sdxl_train_network.py"
MODEL_CHANNELS = 32  # levels of 32, 64 and 128 channels: GroupNorm's 32 groups still divide them
# The text context is CLIP-L's and CLIP-G's hidden states side by side; the label embedding
# reads CLIP-G's pooled projection and six 256-feature size embeddings (sdxl_train_util).
CONTEXT_DIM = common.SMALL_CLIP[768]["hidden_size"] + common.SMALL_CLIP[1280]["hidden_size"]
ADM_IN_CHANNELS = common.SMALL_CLIP[1280]["projection_dim"] + 6 * 256


def _one_small_layer(init: Callable[..., None]) -> Callable[..., None]:
    def small_init(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        init(self, *args, **{**kwargs, "num_transformer_layers": 1, "cross_attention_dim": CONTEXT_DIM})

    return small_init


def small_factories() -> list[common.Patch]:
    unet = sdxl_original_unet
    return [
        (unet, "MODEL_CHANNELS", MODEL_CHANNELS),
        (unet, "TIME_EMBED_DIM", MODEL_CHANNELS * 4),
        (unet, "ADM_IN_CHANNELS", ADM_IN_CHANNELS),
        (unet, "CONTEXT_DIM", CONTEXT_DIM),
        (unet.Transformer2DModel, "__init__", _one_small_layer(unet.Transformer2DModel.__init__)),
        (sdxl_model_util, "CLIPTextConfig", common.small_clip(transformers.CLIPTextConfig)),
    ]


def shrink_factories() -> None:
    """Make sd-scripts build the small U-Net and text encoders."""
    common.install(small_factories())


def make_workspace(root: Path) -> dict[str, Path]:
    """A random checkpoint, dataset and tokenizers under `root`; returns the paths the script needs."""
    from diffusers import AutoencoderKL
    from library import strategy_sdxl  # imports train_util: only where a run needs it

    torch.manual_seed(0)
    paths = {"dataset": common.write_dataset(root), "hub": root / "hub", "checkpoint": root / "sdxl.safetensors"}
    with common.patched(small_factories()):
        unet = sdxl_original_unet.SdxlUNet2DConditionModel()
    text_encoders = common.small_clip_model(768, projection=False), common.small_clip_model(1280, projection=True)
    vae = AutoencoderKL(**model_util.create_vae_diffusers_config())
    sdxl_model_util.save_stable_diffusion_checkpoint(
        str(paths["checkpoint"]), *text_encoders, unet, 0, 0, ckpt_info=None, vae=vae, logit_scale=None, metadata=None
    )
    for repo_id in (strategy_sdxl.TOKENIZER1_PATH, strategy_sdxl.TOKENIZER2_PATH):
        common.write_clip_tokenizer(paths["hub"], repo_id)
    return paths


def train_args(paths: dict[str, Path]) -> list[str]:
    """The script's own arguments for the workspace: the checkpoint, LoRA, SDPA attention, the
    text encoders' outputs cached."""
    checkpoint = str(paths["checkpoint"])
    return [
        *("--pretrained_model_name_or_path", checkpoint, "--network_module", "networks.lora", "--sdpa"),
        "--cache_text_encoder_outputs",
    ]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
