"""Run sd-scripts' lumina_train_network.py end to end on small random checkpoints.

sd-scripts builds NextDiT and Gemma 2 at their full sizes from code (not from the checkpoint),
so `shrink_factories`, run before the script, shrinks those two factories; `make_workspace`
writes checkpoints of the shrunk sizes, Flux's autoencoder at full size, the dataset and a
word-level tokenizer where sd-scripts looks for google/gemma-2-2b (sd_scripts_small_common).

    python tests/sd_scripts_small_lumina.py [--record DIR] --sd-scripts DIR lumina_train_network.py ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

# The trainer's modules (train_util, lumina_util) are imported where the end-to-end run needs
# them: they pull in pipelines that some transformers releases cannot import.
from library import lumina_models
import sd_scripts_small_common as common
from sd_scripts_small_flux import write_ae

SCRIPT = "lumina_train_network.py"
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


def shrink_factories() -> None:
    """Make sd-scripts build the small NextDiT and Gemma 2."""
    from library import lumina_util

    lumina_models.NextDiT_2B_GQA_patch2_Adaln_Refiner = small_nextdit
    lumina_util.Gemma2Config = lambda **config: transformers.Gemma2Config(**{**config, **SMALL_GEMMA2})


def make_workspace(root: Path) -> dict[str, Path]:
    """Random checkpoints, dataset and tokenizer under `root`; returns the paths the script needs."""
    torch.manual_seed(0)
    paths = {"dataset": common.write_dataset(root), "hub": root / "hub", "ae": write_ae(root)}
    paths["nextdit"] = common.save(small_nextdit(), root / "nextdit.safetensors")
    gemma2 = transformers.Gemma2Model(transformers.Gemma2Config(**SMALL_GEMMA2))
    paths["gemma2"] = common.save(gemma2, root / "gemma2.safetensors")
    vocab = ["<pad>", "<eos>", "<bos>", "<unk>", "<Prompt", "Start>", *common.WORDS]
    transformers.GemmaTokenizerFast(
        tokenizer_object=common.word_level_tokenizer(vocab, "<unk>"),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    ).save_pretrained(common.hub_snapshot(paths["hub"], "google/gemma-2-2b"))
    return paths


def train_args(paths: dict[str, Path]) -> list[str]:
    """The script's own arguments for the workspace (the model files and Lumina 2's flow settings)."""
    return [
        *("--pretrained_model_name_or_path", str(paths["nextdit"]), "--gemma2", str(paths["gemma2"])),
        *("--ae", str(paths["ae"]), "--network_module", "networks.lora_lumina"),
        *("--timestep_sampling", "nextdit_shift", "--discrete_flow_shift", "6.0", "--model_prediction_type", "raw"),
        "--cache_text_encoder_outputs",
    ]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
