"""Run sd-scripts' flux_train_network.py end to end on small random checkpoints.

sd-scripts builds Flux from `library.flux_models.configs` (only the block counts come from the
checkpoint) and CLIP-L and T5-XXL from configs written into flux_utils, all at full size;
`shrink_factories`, run before the script, shrinks those configs, and `make_workspace` writes
checkpoints of the shrunk sizes, the autoencoder at full size, the dataset, and CLIP and T5
tokenizers where sd-scripts looks for them (sd_scripts_small_common).

    python tests/sd_scripts_small_flux.py [--record DIR] --sd-scripts DIR flux_train_network.py ARGS...
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import transformers
from library import flux_models
import sd_scripts_small_common as common

SCRIPT = "flux_train_network.py"
# FLUX.1 dev's layout (guidance embedding, both block kinds) at 4 heads of 16 (= sum(axes_dim)).
SMALL_FLUX = dict(
    vec_in_dim=common.SMALL_CLIP[768]["hidden_size"],  # CLIP-L's pooled output
    context_in_dim=common.SMALL_T5["d_model"],
    hidden_size=64,
    num_heads=4,
    depth=2,
    depth_single_blocks=2,
    axes_dim=[4, 6, 6],
)


def shrink_factories() -> None:
    """Make sd-scripts build the small Flux, CLIP-L and T5."""
    from library import flux_utils

    for name, spec in flux_models.configs.items():
        flux_models.configs[name] = dataclasses.replace(spec, params=dataclasses.replace(spec.params, **SMALL_FLUX))
    flux_utils.CLIPConfig = common.small_clip(transformers.CLIPConfig)
    flux_utils.T5Config = common.small_t5(transformers.T5Config)


def write_ae(root: Path) -> Path:
    """Flux's autoencoder at full size (its config is not shrunk), random; Lumina 2 uses it too."""
    return common.save(flux_models.AutoEncoder(flux_models.configs["dev"].ae_params), root / "ae.safetensors")


def make_workspace(root: Path) -> dict[str, Path]:
    """Random checkpoints, dataset and tokenizers under `root`; returns the paths the script needs."""
    from library import strategy_flux  # imports train_util: only where a run needs it

    torch.manual_seed(0)
    paths = {"dataset": common.write_dataset(root), "hub": root / "hub", "ae": write_ae(root)}
    params = dataclasses.replace(flux_models.configs["dev"].params, **SMALL_FLUX)
    paths["flux"] = common.save(flux_models.Flux(params), root / "flux.safetensors")
    paths["clip_l"] = common.save(common.small_clip_model(768, projection=False), root / "clip_l.safetensors")
    paths["t5xxl"] = common.save(common.small_t5_model(), root / "t5xxl.safetensors")
    common.write_clip_tokenizer(paths["hub"], strategy_flux.CLIP_L_TOKENIZER_ID)
    common.write_t5_tokenizer(paths["hub"], strategy_flux.T5_XXL_TOKENIZER_ID)
    return paths


def train_args(paths: dict[str, Path]) -> list[str]:
    """The script's own arguments for the workspace (the model files and the flow settings of
    sd-scripts' Flux LoRA guide)."""
    return [
        *("--pretrained_model_name_or_path", str(paths["flux"]), "--clip_l", str(paths["clip_l"])),
        *("--t5xxl", str(paths["t5xxl"]), "--ae", str(paths["ae"]), "--network_module", "networks.lora_flux"),
        *("--t5xxl_max_token_length", str(common.T5_MAX_TOKENS), "--guidance_scale", "1.0"),
        *("--timestep_sampling", "shift", "--discrete_flow_shift", "3.1582", "--model_prediction_type", "raw"),
        "--cache_text_encoder_outputs",
    ]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
