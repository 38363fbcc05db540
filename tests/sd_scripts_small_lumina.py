"""Run sd-scripts' lumina_train_network.py end to end on small random checkpoints.

sd-scripts builds NextDiT and Gemma 2 at their full sizes from code (not from the checkpoint),
so this module's `shrink_factories`, run before the script, shrinks those two factories; `make_workspace`
writes checkpoints of the shrunk sizes, Flux's autoencoder at full size, a two-image dataset
and a word-level tokenizer where sd-scripts looks for google/gemma-2-2b. Image loading uses a
plain-torch ToTensor + Normalize because torchvision may have no build for the torch here.
No file of the checkout changes.

    python tests/sd_scripts_small_lumina.py --sd-scripts DIR lumina_train_network.py ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import transformers

# The trainer's modules (train_util, lumina_util) are imported where the end-to-end run needs
# them: they pull in pipelines that some transformers releases cannot import.
from library import lumina_models

SMALL_GEMMA2 = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    query_pre_attn_scalar=16,
    vocab_size=64,
)
CAPTIONS = ["a red cat", "a blue dog on grass"]


def small_nextdit(params: object = None, **overrides: object) -> torch.nn.Module:
    """sd-scripts' NextDiT at a few thousand parameters per block (same code, small config)."""
    config = dict(
        patch_size=2,
        in_channels=16,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=16,
        axes_dims=[4, 6, 6],
        axes_lens=[300, 32, 32],
        qk_norm=True,
        cap_feat_dim=SMALL_GEMMA2["hidden_size"],
    )
    return lumina_models.NextDiT(**{**config, **overrides})


def image_to_tensor(image: np.ndarray) -> torch.Tensor:
    """torchvision's ToTensor() + Normalize([0.5], [0.5]) for an HxWx3 uint8 image."""
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div(127.5).sub(1.0)


def shrink_factories() -> None:
    """Make sd-scripts build the small NextDiT and Gemma 2 and load images without torchvision."""
    from library import lumina_util, train_util

    lumina_models.NextDiT_2B_GQA_patch2_Adaln_Refiner = small_nextdit
    lumina_util.Gemma2Config = lambda **config: transformers.Gemma2Config(**{**config, **SMALL_GEMMA2})
    train_util.IMAGE_TRANSFORMS = image_to_tensor


def _save(module: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))


def make_workspace(root: Path) -> dict[str, Path]:
    """Random checkpoints, dataset and tokenizer under `root`; returns the paths the script needs."""
    from library import flux_models
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    images = root / "images"
    images.mkdir(parents=True)
    for i, caption in enumerate(CAPTIONS):
        pixels = np.random.default_rng(i).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(caption)
    dataset = root / "dataset.toml"
    dataset.write_text(
        f'[general]\ncaption_extension = ".txt"\n[[datasets]]\nresolution = 64\nbatch_size = 2\n'
        f'[[datasets.subsets]]\nimage_dir = "{images}"\nnum_repeats = 1\n'
    )
    paths = {"dataset": dataset, "nextdit": root / "nextdit.safetensors", "gemma2": root / "gemma2.safetensors"}
    _save(small_nextdit(), paths["nextdit"])
    _save(transformers.Gemma2Model(transformers.Gemma2Config(**SMALL_GEMMA2)), paths["gemma2"])
    paths["ae"] = root / "ae.safetensors"
    _save(flux_models.AutoEncoder(flux_models.configs["schnell"].ae_params), paths["ae"])
    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<Prompt", "Start>", *sorted({w for c in CAPTIONS for w in c.split()})]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    repo = root / "hub" / "models--google--gemma-2-2b"  # the Hugging Face cache layout, offline
    transformers.GemmaTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(repo / "snapshots" / "0")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0")
    paths["hub"] = root / "hub"
    return paths


if __name__ == "__main__":
    from compile_accel.integrations.sd_scripts import main

    shrink_factories()
    sys.exit(main(sys.argv[1:]))
