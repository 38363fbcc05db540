"""diffusers adapters on small configs: real-valued RoPE parity, LoRA-gradient parity, one
graph per block class, and remove()."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

pytest.importorskip("diffusers")
from conftest import relative_error
from diffusers import (
    FluxTransformer2DModel,
    Lumina2Transformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from diffusers.models import embeddings
from diffusers.models.transformers import transformer_lumina2, transformer_qwenimage
from peft import LoraConfig

import compile_accel
from compile_accel import CompileConfig
from compile_accel.integrations import diffusers as accel_diffusers
from compile_accel.rotary import real_table, rotate_interleaved

TOLERANCE = 1e-4
# The adapters' rewrites, block lists and graph counts are under test here, not inductor's code
# generation (tests/test_parity.py compiles with inductor): AOTAutograd's graphs run as they are,
# partitioned at the budget all the same, in a fraction of inductor's CPU compile time.
BACKEND = "aot_eager"
BUDGET = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend=BACKEND)
LORA = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)


@pytest.mark.parametrize(
    "complex_rotary, factor_shape, head_axis",
    [(embeddings.apply_rotary_emb, (2, 24, 8), 2), (transformer_qwenimage.apply_rotary_emb_qwen, (24, 8), 1)],
    ids=["lumina2", "qwen-image"],
)
def test_real_rotary_matches_complex(complex_rotary, factor_shape: tuple, head_axis: int) -> None:
    x = torch.randn(2, 24, 4, 16)
    angles = torch.rand(factor_shape) * 6.3
    freqs = torch.polar(torch.ones_like(angles), angles)
    # (If an earlier test left the adapter's stand-in installed, it still takes complex factors.)
    expected = complex_rotary(x, freqs, use_real=False)
    assert relative_error(rotate_interleaved(x, real_table(freqs), head_axis), expected) < 1e-6


def _lumina2() -> tuple[Lumina2Transformer2DModel, list[torch.nn.Parameter], tuple]:
    model = Lumina2Transformer2DModel(
        sample_size=16,
        in_channels=4,
        hidden_size=64,
        num_layers=2,
        num_refiner_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        multiple_of=16,
        cap_feat_dim=32,
        axes_dim_rope=(8, 4, 4),
        axes_lens=(64, 32, 32),
    )
    model.requires_grad_(False)
    model.add_adapter(LORA)
    model.train()
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 6:] = False  # captions of two lengths: the joint blocks get an attention mask
    inputs = (torch.randn(2, 4, 16, 16), torch.rand(2), torch.randn(2, 8, 32), mask)
    return model, [p for p in model.parameters() if p.requires_grad], inputs


def _step(model, params, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(*inputs, return_dict=False)[0].square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach(), grads


@pytest.mark.parametrize(
    "config, regions, graphs",
    [
        (BUDGET, 6, 3),  # a region per block, a graph per block list
        (CompileConfig(mode="selective", backend=BACKEND), 36, 9),  # 6 regions per block, 3 graphs per list
    ],
    ids=["blocks-budget-0.5", "selective"],
)
def test_lumina2_lora_gradients_match_eager_with_one_graph_per_block_kind(
    config: CompileConfig, regions: int, graphs: int
) -> None:
    """Two blocks in each of the three block lists (noise refiner, context refiner, joint layers):
    the second block of a list runs the graphs of the first, so the graphs are those of one block
    per list (as many as a model with one block per list compiles, or one with four layers), and
    a deeper model has no more. (A deeper model compiled again only to count its graphs took half
    of this test's time.)"""
    model, params, inputs = _lumina2()
    model.enable_gradient_checkpointing()
    expected_loss, expected_grads = _step(model, params, inputs)
    acceleration = accel_diffusers.apply(model, config)
    loss, grads = _step(model, params, inputs)
    assert relative_error(loss, expected_loss) < TOLERANCE
    assert all(relative_error(g, e) < TOLERANCE for g, e in zip(grads, expected_grads, strict=True))
    stats = acceleration.stats()
    assert stats["fallbacks"] == [] and stats["graph_breaks"] == 0  # complex RoPE is gone from the blocks
    if config.mode == "blocks":
        assert stats["checkpointing_switched_off"] == ["Lumina2Transformer2DModel"]
        assert not model.gradient_checkpointing
    # Every region of the 2 + 2 + 2 blocks compiled, its graphs no more than one block per list has.
    assert (stats["compiled_regions"], stats["unique_graphs"], stats["recompiles"]) == (regions, graphs, 0)


def test_lumina2_remove_undoes_the_rotary_rewrite() -> None:
    model, params, inputs = _lumina2()
    expected_loss, _ = _step(model, params, inputs)
    before = transformer_lumina2.apply_rotary_emb  # still rewritten if an earlier model's acceleration was not removed
    acceleration = accel_diffusers.apply(model, CompileConfig(mode="selective"))  # rewrites now, compiles on call
    assert transformer_lumina2.apply_rotary_emb is not embeddings.apply_rotary_emb
    acceleration.remove()
    assert transformer_lumina2.apply_rotary_emb is before
    assert "forward" not in model.rope_embedder.__dict__
    assert torch.equal(_step(model, params, inputs)[0], expected_loss)


def test_compile_accel_apply_gives_a_known_model_its_integrations_adapter(caplog: pytest.LogCaptureFixture) -> None:
    """compile_accel.apply on diffusers' Lumina 2 compiles what the diffusers integration does
    (its blocks, with the real-arithmetic rotary), and says so; blocks given keep the plain path."""
    model, _, _ = _lumina2()
    with caplog.at_level(logging.INFO, logger="compile_accel"):
        acceleration = compile_accel.apply(model, CompileConfig(mode="blocks"))
    assert "Lumina2Transformer2DModel is known to the diffusers integration" in caplog.text
    assert sorted(b.path for b in acceleration.block_lists) == ["context_refiner", "layers", "noise_refiner"]
    assert transformer_lumina2.apply_rotary_emb is not embeddings.apply_rotary_emb  # the adapter's rewrite
    acceleration.remove()
    explicit = compile_accel.apply(model, CompileConfig(mode="blocks"), blocks=["layers"])
    assert [b.path for b in explicit.block_lists] == ["layers"] and "forward" not in model.rope_embedder.__dict__
    explicit.remove()


def test_mode_off_leaves_lumina2_untouched() -> None:
    """Mode "off" compiles nothing, so the adapter's rewrites stay out too (the eager baseline
    of a benchmark is the model as diffusers wrote it)."""
    model, _, _ = _lumina2()
    before = transformer_lumina2.apply_rotary_emb
    acceleration = accel_diffusers.apply(model, CompileConfig(mode="off"))
    assert transformer_lumina2.apply_rotary_emb is before
    assert "forward" not in model.rope_embedder.__dict__
    acceleration.remove()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mode": "blocks", "activation_memory_budget": 2.0}, "activation_memory_budget"),
        ({"mode": "blocks", "backend": "no_such_backend"}, "is not a torch.compile backend"),
    ],
)
def test_bad_config_leaves_lumina2_untouched_and_its_rewrite_not_run(
    fields: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _, _ = _lumina2()
    before = transformer_lumina2.apply_rotary_emb
    adapter = accel_diffusers.ADAPTERS["Lumina2Transformer2DModel"]
    rewritten: list[torch.nn.Module] = []
    spy = dataclasses.replace(adapter, prepare=lambda model: rewritten.append(model) or adapter.prepare(model))
    monkeypatch.setitem(accel_diffusers.ADAPTERS, "Lumina2Transformer2DModel", spy)
    with pytest.raises(ValueError, match=message):
        accel_diffusers.apply(model, CompileConfig(**fields))
    assert rewritten == []
    assert transformer_lumina2.apply_rotary_emb is before
    assert "forward" not in model.rope_embedder.__dict__


def _train_step_parity(model: torch.nn.Module, inputs: dict, config: CompileConfig) -> dict:
    """LoRA-gradient parity of a diffusers model with eager; returns the stats."""
    model.requires_grad_(False)
    model.add_adapter(LORA)
    model.train()
    model.enable_gradient_checkpointing()
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        loss = model(**inputs, return_dict=False)[0].square().mean()
        loss.backward()
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return loss.detach(), grads

    expected_loss, expected_grads = step()
    acceleration = accel_diffusers.apply(model, config)
    loss, grads = step()
    assert relative_error(loss, expected_loss) < TOLERANCE
    assert all(relative_error(g, e) < TOLERANCE for g, e in zip(grads, expected_grads, strict=True))
    return acceleration.stats()


def test_flux_lora_gradients_match_eager() -> None:
    model = FluxTransformer2DModel(
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    rows, cols = torch.meshgrid(torch.arange(6.0), torch.arange(6.0), indexing="ij")
    inputs = dict(
        hidden_states=torch.randn(2, 36, 16),
        encoder_hidden_states=torch.randn(2, 8, 32),
        pooled_projections=torch.randn(2, 16),
        timestep=torch.rand(2),
        txt_ids=torch.zeros(8, 3),
        img_ids=torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3),
    )
    stats = _train_step_parity(model, inputs, BUDGET)
    # Two block classes, two graphs: the single blocks fed slices share the first one's graph.
    assert stats["regions"] == 4 and stats["unique_graphs"] == 2 and stats["fallbacks"] == []


def test_qwen_image_compiles_whole_blocks_without_complex_rope() -> None:
    model = QwenImageTransformer2DModel(
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    inputs = dict(
        hidden_states=torch.randn(2, 36, 16),
        encoder_hidden_states=torch.randn(2, 8, 32),
        encoder_hidden_states_mask=torch.ones(2, 8),
        timestep=torch.rand(2),
        img_shapes=[[(1, 6, 6)]] * 2,
    )
    stats = _train_step_parity(model, inputs, BUDGET)
    assert stats["fallbacks"] == [] and stats["graph_breaks"] == 0
    assert stats["regions"] == 3 and stats["unique_graphs"] == 1


def _sd3(layers: int = 2) -> tuple[SD3Transformer2DModel, dict]:
    """A small SD3 MMDiT (one block class, diffusers' Attention) and its inputs, in the order of
    its forward's arguments. Its last block leaves out the text stream's output: one graph more."""
    sd3 = SD3Transformer2DModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        pos_embed_max_size=8,
    )
    inputs = dict(
        hidden_states=torch.randn(2, 4, 8, 8),
        encoder_hidden_states=torch.randn(2, 8, 32),
        pooled_projections=torch.randn(2, 16),
        timestep=torch.rand(2),
    )
    return sd3, inputs


def test_sd3_and_wan_blocks_compile() -> None:
    sd3, sd3_inputs = _sd3()
    stats = _train_step_parity(sd3, sd3_inputs, BUDGET)
    assert stats["fallbacks"] == [] and stats["regions"] == 2

    torch._dynamo.reset()
    wan = WanTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        rope_max_seq_len=32,
    )
    wan_inputs = dict(
        hidden_states=torch.randn(2, 4, 3, 8, 8),
        encoder_hidden_states=torch.randn(2, 8, 32),
        timestep=torch.rand(2),
    )
    stats = _train_step_parity(wan, wan_inputs, BUDGET)
    assert stats["fallbacks"] == [] and stats["regions"] == 2 and stats["unique_graphs"] == 1


def test_model_without_adapter_is_refused() -> None:
    with pytest.raises(ValueError, match="no diffusers adapter for Linear"):
        accel_diffusers.apply(torch.nn.Linear(2, 2), CompileConfig(mode="blocks"))


def test_wan_bench_builder_trains_a_lora_step(monkeypatch) -> None:
    """`compile-accel bench --model wan` at a small config: video latents, text, a LoRA gradient."""
    from compile_accel.benchmarks import models

    monkeypatch.setattr(
        models,
        "WAN_CONFIG",
        dict(
            num_attention_heads=2,
            attention_head_dim=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_max_seq_len=32,
        ),
    )
    monkeypatch.setattr(models, "WAN_LATENT_FRAMES", 3)
    bench = models.wan("cpu", lora_rank=4, batch=1, res=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bench.predict()
    assert out.shape == bench.target.shape == (1, 16, 3, 8, 8)
    (out.float() - bench.target.float()).square().mean().backward()
    assert len(bench.lora_params) == 2 * 2 * 2 * 4  # A and B, 4 projections, 2 attentions, 2 layers
    assert all(p.grad is not None for p in bench.lora_params)
    # LoRA's B starts at zero, so only B has a gradient at the first step: half of them.
    assert sum(bool(p.grad.abs().sum() > 0) for p in bench.lora_params) == len(bench.lora_params) // 2


def test_unet_adapter_compiles_resblocks_attentions_and_resamplers_and_switches_their_checkpointing() -> None:
    """diffusers' UNet2DConditionModel: the blocks are each down/mid/up block's resnets,
    attentions and resamplers; a budget switches off the down/up blocks' checkpoint flags."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
        sample_size=8,
    )
    unet.enable_gradient_checkpointing()
    acceleration = accel_diffusers.apply(unet, BUDGET)
    kinds = {type(module).__name__ for module in (region.module for region in acceleration.regions)}
    assert kinds == {"ResnetBlock2D", "Transformer2DModel", "Downsample2D", "Upsample2D"}
    # Every ResnetBlock2D and Transformer2DModel of the U-Net is a region.
    for kind in ("ResnetBlock2D", "Transformer2DModel"):
        everywhere = sum(type(m).__name__ == kind for m in unet.modules())
        assert sum(type(r.module).__name__ == kind for r in acceleration.regions) == everywhere
    switched = acceleration.stats()["checkpointing_switched_off"]
    assert switched and all(not unet.get_submodule(name).gradient_checkpointing for name in switched)
    acceleration.remove()
    assert all(unet.get_submodule(name).gradient_checkpointing for name in switched)
