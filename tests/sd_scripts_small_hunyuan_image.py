"""Run sd-scripts' hunyuan_image_train_network.py end to end on small random checkpoints.

sd-scripts builds HunyuanImage 2.1's DiT and VAE (sizes fixed in their __init__) and Qwen2.5-VL and
byT5 (configs written into hunyuan_image_text_encoder) at full size; `shrink_factories`, run before
the script, shrinks them: small widths and head counts for the DiT's submodule factories (it keeps
2 double and 4 single blocks, the fewest that `--blocks_to_swap 1` accepts), small channels for
the VAE, small configs for the encoders (byT5 keeps its width: sd-scripts hard-codes it for
captions without quoted text), and mends its in-memory text encoder cache (see there).
`make_workspace` writes checkpoints of those sizes, the dataset, a byte-level BPE tokenizer where
sd-scripts looks for Qwen2.5-VL's (whole words, so that the prompt template is the 34 tokens
sd-scripts drops) and byT5's tokenizer (sd_scripts_small_common).

    python tests/sd_scripts_small_hunyuan_image.py [--record DIR] --sd-scripts DIR \\
        hunyuan_image_train_network.py ARGS...
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import transformers
from library import hunyuan_image_models, hunyuan_image_modules, hunyuan_image_text_encoder, hunyuan_image_vae
import sd_scripts_small_common as common

SCRIPT = "hunyuan_image_train_network.py"
WIDTH, HEADS, ROPE_DIMS = 64, 2, [16, 16]  # the DiT's (and Qwen2.5-VL's) width: heads of sum(ROPE_DIMS)
DOUBLE_BLOCKS, SINGLE_BLOCKS = 2, 4
# The full sizes among the arguments of the DiT's submodule factories, and their small ones: the
# width (also Qwen2.5-VL's, the text input), the byT5 mapper's width and the head count.
DIT_SIZES = {3584: WIDTH, 2048: WIDTH, 28: HEADS}
DIT_FACTORIES = ["ByT5Mapper", "PatchEmbed2D", "SingleTokenRefiner", "TimestepEmbedder", "MMDoubleStreamBlock"]
DIT_FACTORIES += ["MMSingleStreamBlock", "FinalLayer"]
VAE_CHANNELS = [32, 32, 64, 64, 128, 128]  # 32x down: 6 levels; the last a multiple of 2 x 64 latents
QWEN_VOCAB = 512  # 256 bytes, the words' BPE tokens and the special tokens
# 3 layers: HunyuanImage takes the third hidden state from the end; M-RoPE sections of half a head.
SMALL_QWEN = dict(hidden_size=WIDTH, intermediate_size=64, num_attention_heads=HEADS, num_key_value_heads=1)
SMALL_QWEN.update(num_hidden_layers=3, max_window_layers=3, layer_types=["full_attention"] * 3, vocab_size=QWEN_VOCAB)
SMALL_QWEN.update(rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [4, 6, 6]})
SMALL_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=WIDTH)
SMALL_VISION["fullatt_block_indexes"] = [0]
SMALL_BYT5 = dict(d_ff=32, d_kv=16, num_heads=2, num_layers=1, num_decoder_layers=1)  # d_model stays 1472


def resized(factory: Callable[..., object], sizes: dict[str, object] | None = None) -> Callable[..., object]:
    """`factory` with the keyword arguments `sizes`, or else with DIT_SIZES' full sizes replaced."""

    def small(value: object) -> object:
        return DIT_SIZES.get(value, value) if type(value) is int else value

    if sizes is not None:
        return lambda *args, **kwargs: factory(*args, **{**kwargs, **sizes})
    return lambda *args, **kwargs: factory(*map(small, args), **{k: small(v) for k, v in kwargs.items()})


def small_qwen_config(**config: object) -> transformers.Qwen2_5_VLConfig:
    """A stand-in for the config class the loader builds its hard-coded Qwen2.5-VL 7B from."""
    text, vision = {**config.pop("text_config", {}), **SMALL_QWEN}, {**config.pop("vision_config", {}), **SMALL_VISION}
    return transformers.Qwen2_5_VLConfig(**{**config, **SMALL_QWEN}, text_config=text, vision_config=vision)


def patches() -> list[common.Patch]:
    """What makes sd-scripts build the small DiT, VAE, Qwen2.5-VL and byT5."""
    dit = hunyuan_image_models.HYImageDiffusionTransformer
    init = dit.__init__

    def small_init(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # small blocks, 20 double and 40 single; then the first few
        del self.double_blocks[DOUBLE_BLOCKS:], self.single_blocks[SINGLE_BLOCKS:]
        self.num_double_blocks, self.num_single_blocks = DOUBLE_BLOCKS, SINGLE_BLOCKS
        self.hidden_size, self.heads_num, self.rope_dim_list = WIDTH, HEADS, ROPE_DIMS

    return [
        (dit, "__init__", small_init),
        *((hunyuan_image_models, name, resized(getattr(hunyuan_image_modules, name))) for name in DIT_FACTORIES),
        (hunyuan_image_vae, "Encoder", resized(hunyuan_image_vae.Encoder, dict(block_out_channels=VAE_CHANNELS))),
        (hunyuan_image_vae, "Decoder", resized(hunyuan_image_vae.Decoder, dict(block_out_channels=VAE_CHANNELS[::-1]))),
        (hunyuan_image_text_encoder, "Qwen2_5_VLConfig", small_qwen_config),
        (hunyuan_image_text_encoder, "T5Config", resized(transformers.T5Config, SMALL_BYT5)),
    ]


def shrink_factories() -> None:
    """Make sd-scripts build the small models, and keep the text encoders' outputs it caches in
    memory as arrays: it keeps an image's OCR flag as a NumPy scalar, which the torch.FloatTensor
    of its collate function rejects (a 0-d array, as its disk cache gives back, it takes)."""
    from library import strategy_hunyuan_image

    strategy = strategy_hunyuan_image.HunyuanImageTextEncoderOutputsCachingStrategy
    cache = strategy.cache_batch_outputs

    def cache_as_arrays(self: object, tokenize: object, models: list, encoding: object, infos: list) -> None:
        cache(self, tokenize, models, encoding, infos)
        for info in infos:
            if info.text_encoder_outputs is not None:
                info.text_encoder_outputs = tuple(np.asarray(output) for output in info.text_encoder_outputs)

    common.install([*patches(), (strategy, "cache_batch_outputs", cache_as_arrays)])


def write_qwen_tokenizer(hub: Path) -> None:
    """A byte-level BPE tokenizer whose merges make whole words of the prompts sd-scripts writes."""
    import regex
    from transformers.models.qwen2 import tokenization_qwen2 as qwen2

    prompts = []  # the template around each caption, as sd-scripts formats it

    def record(texts: list[str], **_: object) -> SimpleNamespace:
        prompts.extend(texts)
        return SimpleNamespace(input_ids=None, attention_mask=None)

    hunyuan_image_text_encoder.get_qwen_tokens(record, common.CAPTIONS)
    byte_chars = qwen2.bytes_to_unicode()
    vocab, merges = {c: i for i, c in enumerate(byte_chars.values())}, {}
    for text in re.split(r"<\|\w+\|>", "".join(prompts)):
        for piece in regex.findall(qwen2.PRETOKENIZE_REGEX, text):
            word = "".join(byte_chars[b] for b in piece.encode())
            for end in range(2, len(word) + 1):  # merged left to right: w o -> wo, wo r -> wor, ...
                merges.setdefault(f"{word[: end - 1]} {word[end - 1]}", None)
                vocab.setdefault(word[:end], len(vocab))
    folder = common.hub_snapshot(hub, hunyuan_image_text_encoder.QWEN_2_5_VL_IMAGE_ID)
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n")
    tokenizer = transformers.Qwen2Tokenizer(folder / "vocab.json", folder / "merges.txt")
    tokenizer.add_tokens(sorted(set(re.findall(r"<\|\w+\|>", "".join(prompts)))), special_tokens=True)
    caption = tokenizer.tokenize(prompts[0])[hunyuan_image_text_encoder.PROMPT_TEMPLATE_ENCODE_START_IDX :]
    assert len(tokenizer) <= QWEN_VOCAB and caption[0] == common.CAPTIONS[0].split()[0], caption  # template dropped
    tokenizer.save_pretrained(folder)


def make_workspace(root: Path) -> dict[str, Path]:
    """Random checkpoints, dataset and tokenizers under `root`; returns the paths the script needs."""
    torch.manual_seed(0)
    paths = {"dataset": common.write_dataset(root), "hub": root / "hub"}
    write_qwen_tokenizer(paths["hub"])
    byt5_folder = common.hub_snapshot(paths["hub"], hunyuan_image_text_encoder.BYT5_TOKENIZER_PATH)
    transformers.ByT5Tokenizer().save_pretrained(byt5_folder)
    with common.patched(patches()):
        paths["dit"] = common.save(hunyuan_image_models.HYImageDiffusionTransformer(), root / "dit.safetensors")
        paths["vae"] = common.save(hunyuan_image_vae.HunyuanVAE2D(), root / "vae.safetensors")
        qwen = transformers.Qwen2_5_VLForConditionalGeneration(small_qwen_config())
        byt5_config = hunyuan_image_text_encoder.T5Config(d_model=1472, feed_forward_proj="gated-gelu", vocab_size=384)
    # The key layouts the loaders convert from: Qwen2.5-VL's original one, and byT5's embedding as
    # "shared", sized for the tokens sd-scripts adds to the tokenizer.
    qwen_state = {k.replace("model.language_model.", "model.", 1): v for k, v in qwen.state_dict().items()}
    qwen_state = {k.replace("model.visual.", "visual.", 1): v for k, v in qwen_state.items()}
    paths["qwen"] = common.save(qwen_state, root / "qwen2_5_vl.safetensors")
    byt5 = transformers.T5EncoderModel(byt5_config).get_encoder()
    hunyuan_image_text_encoder.add_special_token(transformers.AutoTokenizer.from_pretrained(byt5_folder), byt5)
    byt5_state = byt5.state_dict()
    byt5_state["shared.weight"] = byt5_state.pop("embed_tokens.weight")
    paths["byt5"] = common.save(byt5_state, root / "byt5.safetensors")
    return paths


def train_args(paths: dict[str, Path]) -> list[str]:
    """The script's own arguments for the workspace (the model files and the flow settings of
    sd-scripts' HunyuanImage 2.1 LoRA guide)."""
    return [
        *("--pretrained_model_name_or_path", str(paths["dit"]), "--text_encoder", str(paths["qwen"])),
        *("--byt5", str(paths["byt5"]), "--vae", str(paths["vae"]), "--network_module", "networks.lora_hunyuan_image"),
        *("--attn_mode", "torch", "--discrete_flow_shift", "5.0", "--model_prediction_type", "raw"),
        "--cache_text_encoder_outputs",
    ]


if __name__ == "__main__":
    sys.exit(common.harness_main(shrink_factories, sys.argv[1:]))
