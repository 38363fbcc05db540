"""Run sd-scripts' anima_train_network.py end to end on small random checkpoints.

sd-scripts builds Anima (Cosmos-Predict2's DiT) from a config written into anima_utils, its LLM
adapter (Qwen3's hidden states to T5-token embeddings) from sizes written into anima_models, and
the Qwen-Image VAE from a config written into its loader, all at full size; `shrink_factories`,
run before the script, shrinks those three classes. The Qwen3 text encoder comes from a folder
(config and tokenizer read with from_pretrained), so it needs no shrinking: `make_workspace`
writes it small with a word-level tokenizer, checkpoints of the shrunk sizes, the dataset and a
T5 tokenizer for the adapter's target tokens (sd_scripts_small_common).

    python tests/sd_scripts_small_anima.py [--record DIR] --sd-scripts DIR anima_train_network.py ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers
from library import anima_models, qwen_image_autoencoder_kl
import sd_scripts_small_common as common

SCRIPT = "anima_train_network.py"
ANIMA, LLM_ADAPTER = anima_models.Anima, anima_models.LLMAdapter
QWEN_IMAGE_VAE = qwen_image_autoencoder_kl.AutoencoderKLQwenImage
QWEN3_VOCAB = ["<|endoftext|>", *common.WORDS]  # Qwen's pad, eos and (here) unknown token
SMALL_QWEN3 = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=len(QWEN3_VOCAB),
)
# 4 heads of 16: Anima's 3D RoPE splits a head into 4 (height), 4 (width) and 8 (time) features.
SMALL_ANIMA = dict(model_channels=64, num_blocks=2, num_heads=4, crossattn_emb_channels=32, adaln_lora_dim=16)
# Qwen3's hidden states to the DiT's cross-attention width (its T5 embedding keeps 32128 tokens).
SMALL_ADAPTER = dict(source_dim=SMALL_QWEN3["hidden_size"], target_dim=32, model_dim=32, num_layers=2, num_heads=2)
SMALL_VAE = dict(base_dim=16, num_res_blocks=1)  # still 16 latent channels, 8x down
# The rest of load_anima_model's config that sets parameter shapes.
ANIMA_SHAPES = dict(max_img_h=512, max_img_w=512, max_frames=128, in_channels=16, out_channels=16, patch_spatial=2)
ANIMA_SHAPES.update(patch_temporal=1, pos_emb_cls="rope3d", use_adaln_lora=True, use_llm_adapter=True)
MAX_TOKENS = 16  # Qwen3's and T5's: the longest caption is 5 words


def small_anima(**config: object) -> torch.nn.Module:
    """sd-scripts' Anima at about 70,000 parameters per block (same code, small config)."""
    return ANIMA(**{**config, **SMALL_ANIMA})


def small_llm_adapter(**config: object) -> torch.nn.Module:
    return LLM_ADAPTER(**{**config, **SMALL_ADAPTER})


def small_vae(**config: object) -> torch.nn.Module:
    return QWEN_IMAGE_VAE(**{**config, **SMALL_VAE})


PATCHES: list[common.Patch] = [
    (anima_models, "Anima", small_anima),
    (anima_models, "LLMAdapter", small_llm_adapter),
    (qwen_image_autoencoder_kl, "AutoencoderKLQwenImage", small_vae),
]


def shrink_factories() -> None:
    """Make sd-scripts build the small Anima, LLM adapter and VAE."""
    common.install(PATCHES)


def make_workspace(root: Path) -> dict[str, Path]:
    """Random checkpoints, dataset and tokenizers under `root`; returns the paths the script needs."""
    torch.manual_seed(0)
    paths = {"dataset": common.write_dataset(root), "hub": root / "hub", "qwen3": root / "qwen3"}
    with common.patched(PATCHES):
        anima = anima_models.Anima(**ANIMA_SHAPES)
        vae = qwen_image_autoencoder_kl.AutoencoderKLQwenImage()
    paths["anima"] = common.save({f"net.{k}": v for k, v in anima.state_dict().items()}, root / "anima.safetensors")
    paths["vae"] = common.save(vae, root / "vae.safetensors")
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL_QWEN3))
    qwen3.save_pretrained(paths["qwen3"])
    eos = QWEN3_VOCAB[0]
    transformers.Qwen2TokenizerFast(
        tokenizer_object=common.word_level_tokenizer(QWEN3_VOCAB, eos), eos_token=eos, pad_token=eos, unk_token=eos
    ).save_pretrained(paths["qwen3"])
    common.write_t5_tokenizer(root, "t5")  # a folder that the script reads by path
    paths["t5_tokenizer"] = root / "models--t5" / "snapshots" / "0"
    return paths


def train_args(paths: dict[str, Path]) -> list[str]:
    """The script's own arguments for the workspace: the model files, tokenizers and LoRA."""
    return [
        *("--pretrained_model_name_or_path", str(paths["anima"]), "--qwen3", str(paths["qwen3"])),
        *("--vae", str(paths["vae"]), "--t5_tokenizer_path", str(paths["t5_tokenizer"])),
        *("--qwen3_max_token_length", str(MAX_TOKENS), "--t5_max_token_length", str(MAX_TOKENS)),
        *("--network_module", "networks.lora_anima", "--cache_text_encoder_outputs"),
    ]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
