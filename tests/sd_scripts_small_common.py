"""What the small sd-scripts harnesses (tests/sd_scripts_small_<model>.py) share.

A harness runs sd-scripts' training script in its own process: it shrinks the model factories
that sd-scripts hard-codes at full size (in memory; no file of the checkout changes), can record
every step's loss and compile_accel's stats, and hands the command line to the launcher:

    python tests/sd_scripts_small_<model>.py [--record DIR] --sd-scripts DIR SCRIPT ARGS...

This module also writes what a run reads: random checkpoints of the small sizes, a two-image
dataset, and tokenizers where sd-scripts looks for them on the Hugging Face hub (run with
HF_HUB_CACHE=<workspace>/hub HF_HUB_OFFLINE=1, as `environment` sets).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import string
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

CAPTIONS = ["a red cat", "a blue dog on grass"]
WORDS = sorted({word for caption in CAPTIONS for word in caption.split()})

# CLIP tokenizer: single letters (word-final ones with "</w>") and no merges, so each word is its
# letters; <|endoftext|> has the highest id, as in CLIP, whose legacy pooling takes the argmax id.
LETTERS = string.ascii_lowercase
CLIP_VOCAB = [*LETTERS, *(c + "</w>" for c in LETTERS), "<|startoftext|>", "<|endoftext|>"]
# Small CLIP text encoders, keyed by the hidden size sd-scripts builds (768: CLIP-L, 1280: CLIP-G,
# 1024: SD 2.x's OpenCLIP-H); they differ so that a mixed-up pair would not fit together. CLIP-L
# keeps its 12 layers: SDXL takes its 11th hidden state.
SMALL_CLIP = {
    768: dict(hidden_size=32, intermediate_size=64, num_hidden_layers=12, num_attention_heads=2, projection_dim=32),
    1280: dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, projection_dim=48),
    1024: dict(hidden_size=40, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2, projection_dim=40),
}
T5_VOCAB = ["<pad>", "</s>", "<unk>", *WORDS]  # T5's ids for pad and eos
# d_model stays 4096: SD3 pads CLIP's output to 4096 features and joins T5's to it.
SMALL_T5 = dict(d_model=4096, d_ff=32, d_kv=16, num_heads=2, num_layers=1, vocab_size=len(T5_VOCAB))
T5_MAX_TOKENS = 16  # --t5xxl_max_token_length: the longest caption is 5 words and </s>


def small_clip(config_class: type) -> Callable[..., object]:
    """A stand-in for the CLIP config class a loader builds its hard-coded CLIP-L or CLIP-G from."""
    vocab = {"vocab_size": len(CLIP_VOCAB)}
    return lambda **config: config_class(**{**config, **SMALL_CLIP[config["hidden_size"]], **vocab})


def small_t5(config_class: type) -> Callable[..., object]:
    """A stand-in for the T5 config class a loader builds its hard-coded T5-XXL from."""
    return lambda **config: config_class(**{**config, **SMALL_T5})


Patch = tuple[object, str, object]  # (module or class, attribute, stand-in)


def install(patches: list[Patch]) -> None:
    """The stand-ins in place for the rest of the process (a harness's training process)."""
    for owner, name, value in patches:
        setattr(owner, name, value)


@contextlib.contextmanager
def patched(patches: list[Patch]) -> Iterator[None]:
    """The stand-ins in place for a `with` block (a workspace builds models of the harness's
    sizes without changing sd-scripts' modules for the rest of the test process)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    install(patches)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def save(weights: torch.nn.Module | dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    save_file({k: v.detach().clone() for k, v in state.items()}, str(path))  # clones: tied weights too
    return path


def write_dataset(root: Path, size: int = 64) -> Path:
    """Two random `size` x `size` images with the captions, one batch of two; returns the dataset
    config."""
    from PIL import Image

    images = root / "images"
    images.mkdir(parents=True)
    for i, caption in enumerate(CAPTIONS):
        pixels = np.random.default_rng(i).integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(caption)
    dataset = root / "dataset.toml"
    dataset.write_text(
        f'[general]\ncaption_extension = ".txt"\n[[datasets]]\nresolution = {size}\nbatch_size = 2\n'
        f'[[datasets.subsets]]\nimage_dir = "{images}"\nnum_repeats = 1\n'
    )
    return dataset


def hub_snapshot(hub: Path, repo_id: str) -> Path:
    """The folder that from_pretrained(repo_id) reads offline with HF_HUB_CACHE=hub."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0")
    return repo / "snapshots" / "0"


def word_level_tokenizer(vocab: list[str], unk: str) -> object:
    """A `tokenizers` tokenizer that splits on white space and knows the words of `vocab`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def write_clip_tokenizer(hub: Path, repo_id: str, subfolder: str = "") -> None:
    import transformers

    folder = hub_snapshot(hub, repo_id) / subfolder
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(CLIP_VOCAB)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(folder / "vocab.json", folder / "merges.txt", model_max_length=77)
    tokenizer.save_pretrained(folder)


def write_t5_tokenizer(hub: Path, repo_id: str) -> None:
    import transformers
    from tokenizers import processors

    tokenizer = word_level_tokenizer(T5_VOCAB, "<unk>")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.T5TokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0
    ).save_pretrained(hub_snapshot(hub, repo_id))


def small_clip_model(hidden_size: int, projection: bool) -> torch.nn.Module:
    """A random CLIP text encoder of the small size for sd-scripts' CLIP-L (768) or CLIP-G (1280)."""
    import transformers

    config = small_clip(transformers.CLIPTextConfig)(hidden_size=hidden_size)
    return (transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel)(config)


def small_t5_model() -> torch.nn.Module:
    import transformers

    return transformers.T5EncoderModel(small_t5(transformers.T5Config)(feed_forward_proj="gated-gelu"))


def record(folder: Path) -> None:
    """Write to `folder` the loss of every training step (`losses`, one JSON number a line: the
    values sd-scripts' progress bar averages into avr_loss) and, at exit, the stats of the model
    the launcher accelerated (`stats.json`; none without compile flags)."""
    from library import train_util

    from compile_accel.integrations.sd_scripts import families

    add, apply = train_util.LossRecorder.add, families.apply

    def add_and_record(self: object, *, epoch: int, step: int, loss: float) -> None:
        with (folder / "losses").open("a") as file:
            file.write(json.dumps(loss) + "\n")
        add(self, epoch=epoch, step=step, loss=loss)

    def apply_and_record(model: torch.nn.Module, config: object) -> object:
        acceleration = apply(model, config)
        atexit.register(lambda: (folder / "stats.json").write_text(json.dumps(acceleration.stats(), default=str)))
        return acceleration

    train_util.LossRecorder.add = add_and_record
    families.apply = apply_and_record  # what the launcher calls on the model it accelerates


def harness_main(shrink: Callable[[], None], argv: list[str]) -> int:
    """The harness command line: [--record DIR] then the launcher's arguments."""
    from compile_accel.integrations.sd_scripts import main

    if argv[:1] == ["--record"]:
        record(Path(argv[1]))
        argv = argv[2:]
    shrink()
    return main(argv)


def environment(sd_scripts: Path, hub: Path, **extra: str) -> dict[str, str]:
    """The harness's environment: sd-scripts importable, the workspace's hub offline, and no
    compile flag from the caller's environment (a run sets its own). Nor conftest's scalar
    kernels (ATEN_CPU_CAPABILITY=default): with them torch 2.14.1's inductor writes C++ for
    HunyuanImage's blocks that does not compile ("'at::vec' has not been declared"), and the
    trainers' runs compile as a user's do."""
    from compile_accel.integrations.sd_scripts import BUDGET_ENV, SELECTIVE_ENV

    dropped = (SELECTIVE_ENV, BUDGET_ENV, "ATEN_CPU_CAPABILITY")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(sd_scripts), os.environ.get("PYTHONPATH")]))
    return {**env, **extra}


if __name__ == "__main__":
    sys.exit("run a model's harness, e.g. tests/sd_scripts_small_flux.py")
