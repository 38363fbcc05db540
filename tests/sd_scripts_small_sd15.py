"""Run sd-scripts' train_network.py (SD 1.x) end to end on a small random checkpoint (SD 2.x:
tests/sd_scripts_small_sd2.py, from the same functions).

sd-scripts builds SD 1.x's U-Net (library/original_unet.py) from module constants: its channels
in original_unet and, for the checkpoint's conversion, in model_util, which also writes CLIP-L's
config into its loader. `small_factories` shrinks them where they are looked up: 32 base channels
(levels of 32, 64, 128 and 128: GroupNorm's 32 groups still divide them), CLIP-L's small size for
the cross-attention features, and the CLIP config class. The U-Net keeps its layout: four levels,
two ResBlocks each, the transformers, down- and upsamplers. `make_workspace` writes one
checkpoint in sd-scripts' own single-file format (its save_stable_diffusion_checkpoint), with
the VAE at full size.

    python tests/sd_scripts_small_sd15.py [--record DIR] --sd-scripts DIR train_network.py ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from library import model_util, original_unet
import sd_scripts_small_common as common

SCRIPT = "train_network.py"
MODEL_CHANNELS = 32
CONTEXT_DIM = common.SMALL_CLIP[768]["hidden_size"]
# 128x128 images: latents of 16x16, 2x2 at the middle block after three downsamplings. At 64x64
# its self-attention would see one token, whose softmax is 1 whatever q and k are: their LoRA
# would get no gradient but rounding noise, which Adam scales up to steps of the learning rate.
IMAGE_SIZE = 128


def small_factories(v2: bool = False) -> list[common.Patch]:
    """The stand-ins; `v2`: also SD 2.x's, its cross-attention features (OpenCLIP-H's small size)
    and head counts (5, 10, 20 do not divide the small levels)."""
    levels = tuple(MODEL_CHANNELS * m for m in model_util.UNET_PARAMS_CHANNEL_MULT)
    v2_patches = [
        (model_util, "V2_UNET_PARAMS_CONTEXT_DIM", common.SMALL_CLIP[1024]["hidden_size"]),
        (model_util, "V2_UNET_PARAMS_ATTENTION_HEAD_DIM", [2, 4, 8, 8]),
    ]
    return [
        *(v2_patches if v2 else []),
        (original_unet, "BLOCK_OUT_CHANNELS", levels),
        (original_unet, "TIMESTEP_INPUT_DIM", levels[0]),  # both derived at import, from the full size
        (original_unet, "TIME_EMBED_DIM", levels[0] * 4),
        (model_util, "UNET_PARAMS_MODEL_CHANNELS", MODEL_CHANNELS),
        (model_util, "UNET_PARAMS_CONTEXT_DIM", CONTEXT_DIM),
        (model_util, "CLIPTextConfig", common.small_clip(transformers.CLIPTextConfig)),
    ]


def shrink_factories() -> None:
    """Make sd-scripts build the small U-Net and text encoder."""
    common.install(small_factories())


def make_workspace(root: Path, v2: bool = False) -> dict[str, Path]:
    """A random checkpoint (SD 2.x's with `v2`), dataset and tokenizer under `root`; returns the
    paths the script needs."""
    from diffusers import AutoencoderKL
    from library import strategy_sd  # imports train_util: only where a run needs it

    torch.manual_seed(0)
    paths = {"dataset": common.write_dataset(root, IMAGE_SIZE), "hub": root / "hub"}
    paths["checkpoint"] = root / "sd15.safetensors"
    with common.patched(small_factories(v2)):
        unet = original_unet.UNet2DConditionModel(**model_util.create_unet_diffusers_config(v2))
        text_encoder = common.small_clip_model(1024 if v2 else 768, projection=False)
        vae = AutoencoderKL(**model_util.create_vae_diffusers_config())
        checkpoint = str(paths["checkpoint"])
        model_util.save_stable_diffusion_checkpoint(v2, checkpoint, text_encoder, unet, None, 0, 0, None, vae=vae)
    if v2:
        common.write_clip_tokenizer(paths["hub"], strategy_sd.V2_STABLE_DIFFUSION_ID, subfolder="tokenizer")
    else:
        common.write_clip_tokenizer(paths["hub"], strategy_sd.TOKENIZER_ID)
    return paths


def train_args(paths: dict[str, Path]) -> list[str]:
    """The script's own arguments for the workspace: the checkpoint, LoRA, SDPA attention (the
    script cannot cache the text encoder's outputs: it runs, frozen, at each step)."""
    return ["--pretrained_model_name_or_path", str(paths["checkpoint"]), "--network_module", "networks.lora", "--sdpa"]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
