"""One compiled graph per block class, shared by every instance; no recompiles in steady state."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step

import compile_accel
from compile_accel import CompileConfig
from compile_accel.benchmarks.lora import KohyaStyleLoRANetwork

# Graphs and recompiles are dynamo's and AOTAutograd's, not inductor's: every test here compiles
# with aot_eager, in a fraction of inductor's CPU compile time. Selective with dynamo's default
# dynamic (the dynamic=True path is the same torch.compile argument, checked on blocks below).
BACKEND = "aot_eager"
MODES = {
    "blocks": (CompileConfig(mode="blocks", activation_memory_budget=0.5, backend=BACKEND), None),
    "selective": (CompileConfig(mode="selective", backend=BACKEND), "non-reentrant"),
}


def _graphs_after_steps(mode: str, double_blocks: int, single_blocks: int, steps: int = 3) -> list[dict]:
    """Stats after each of `steps` steps of a fresh model in a fresh dynamo (as in a new process)."""
    torch._dynamo.reset()
    config, checkpointing = MODES[mode]
    model, params = build("kohya", checkpointing, double_blocks=double_blocks, single_blocks=single_blocks)
    acceleration = compile_accel.apply(model, config)
    inputs = inputs_for(model)
    history = []
    for _ in range(steps):
        lora_step(model, params, inputs)
        history.append(acceleration.stats())
    return history


@pytest.fixture(scope="module")
def graphs_after_steps() -> Callable[[str, int, int], list[dict]]:
    """`_graphs_after_steps`, each (mode, block counts) trained once for the whole module."""
    return functools.cache(_graphs_after_steps)


FEW, MANY = (2, 2), (3, 4)


@pytest.mark.parametrize("mode", list(MODES))
def test_graphs_do_not_grow_with_block_count(mode: str, graphs_after_steps) -> None:
    few = graphs_after_steps(mode, *FEW)
    # A model with more instances of the same classes compiles no more graphs.
    many = graphs_after_steps(mode, *MANY)
    assert many[-1]["regions"] > few[-1]["regions"]
    assert many[-1]["unique_graphs"] == few[-1]["unique_graphs"] > 0
    for history in (few, many):
        # Steady state: steps after the first add no graph and no recompile.
        assert [s["unique_graphs"] for s in history] == [history[0]["unique_graphs"]] * len(history)
        assert [s["recompiles"] for s in history] == [0] * len(history)


def test_blocks_mode_one_graph_per_block_class(graphs_after_steps) -> None:
    history = graphs_after_steps("blocks", *MANY)
    # DoubleStreamBlock and SingleStreamBlock: two classes, two graphs.
    assert history[-1]["unique_graphs"] == 2
    assert history[-1]["regions"] == sum(MANY)


def test_reentrant_selective_compiles_nothing_after_first_step() -> None:
    """Reentrant checkpointing runs the children without grad, then recomputes them with grad:
    two graphs per child where non-reentrant has one, but still nothing new after step one."""
    model, params = build("kohya", "reentrant")
    acceleration = compile_accel.apply(model, CompileConfig(mode="selective", backend=BACKEND))
    inputs = inputs_for(model)
    lora_step(model, params, inputs)
    first = acceleration.stats()
    for _ in range(2):
        lora_step(model, params, inputs)
    assert acceleration.stats()["unique_graphs"] == first["unique_graphs"]
    assert acceleration.stats()["recompiles"] == first["recompiles"]


def test_dynamic_true_shares_one_graph_across_token_counts() -> None:
    """Aspect-ratio buckets: with dynamic=True new token counts reuse the graph (one block class:
    dynamic graphs are the slowest to compile on the CPU)."""
    model, params = build("kohya", None, **ONE_BLOCK_CLASS)
    config = CompileConfig(mode="blocks", activation_memory_budget=1.0, dynamic=True, backend=BACKEND)
    acceleration = compile_accel.apply(model, config)
    lora_step(model, params, inputs_for(model, res=16))
    graphs = acceleration.stats()["unique_graphs"]
    for res in (12, 24):
        lora_step(model, params, inputs_for(model, res=res))
    assert acceleration.stats()["unique_graphs"] == graphs
    assert acceleration.stats()["recompiles"] == 0


def _dynamo_graphs(fn, *args) -> list[torch.fx.GraphModule]:
    """The graphs dynamo captures from fn(*args), not compiled further."""
    captured = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        captured.append(gm)
        return gm

    torch.compile(fn, backend=capture)(*args)
    return captured


def _call_by_name(gm: torch.fx.GraphModule, **tensors: torch.Tensor) -> tuple:
    """Call a dynamo graph with the tensors named as the captured function's arguments (dynamo
    orders and names its placeholders itself, e.g. `l_q_`)."""
    return gm(*(tensors[n.name.removeprefix("l_").rstrip("_")] for n in gm.graph.nodes if n.op == "placeholder"))


def test_attention_rewrites_reach_a_checkpoint_traced_inside_the_region() -> None:
    """A checkpoint inside a compiled region becomes a higher-order op with its own body graph;
    the attention there gets dense token-major inputs too."""
    from compile_accel.attention import rewrite_attention

    def attention(qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def region(qkv: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(attention, qkv, use_reentrant=False)

    (gm,) = _dynamo_graphs(region, torch.randn(2, 5, 48, requires_grad=True))
    rewrite_attention(gm)
    bodies = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule) and m is not gm]
    sdpa = [
        n for body in bodies for n in body.graph.nodes if n.target is torch.nn.functional.scaled_dot_product_attention
    ]
    assert len(sdpa) == 1 and all(map(_made_token_major, sdpa[0].args[:3]))


def _made_token_major(node: torch.fx.Node) -> bool:
    """`node` is x.transpose(1, 2).contiguous().transpose(1, 2)."""
    chain = [node, node.args[0], node.args[0].args[0]]
    return [n.target for n in chain] == ["transpose", "contiguous", "transpose"] and node.args[1:] == (1, 2)


class _AttentionInputs(torch.overrides.TorchFunctionMode):
    """Records the q, k and v tensors each scaled_dot_product_attention call receives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            named = dict(zip(("query", "key", "value"), args)) | kwargs
            self.calls.append([named[name] for name in ("query", "key", "value")])
        return func(*args, **kwargs)


def test_attention_inputs_get_dense_token_major_buffers_in_the_graph() -> None:
    """Permuted views of one projection reach scaled_dot_product_attention as buffers of their
    own, laid out (batch, tokens, heads, head_dim) (a torch 2.11 inductor bug gave wrong gradients
    for permuted q/k/v); a 3-d input becomes contiguous; the graph computes the same values, and
    AOTAutograd would still cache it (what a compile worker needs)."""
    from torch._functorch._aot_autograd.autograd_cache import check_cacheable

    from compile_accel.attention import token_major_attention_inputs

    def attention(qkv: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = qkv.unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, value=v)  # diffusers passes keywords
        flat = x.transpose(1, 2)  # (batch, tokens, dim) without a heads dimension, not contiguous
        return heads, torch.nn.functional.scaled_dot_product_attention(flat, flat, flat)

    qkv, x = torch.randn(2, 5, 48), torch.randn(2, 8, 5)
    (gm,) = _dynamo_graphs(attention, qkv, x)
    expected = _call_by_name(gm, qkv=qkv, x=x)
    assert token_major_attention_inputs(gm) == 2
    check_cacheable(gm)  # raises BypassAOTAutogradCache for a node it would not cache
    recorded = _AttentionInputs()
    with recorded:
        got = _call_by_name(gm, qkv=qkv, x=x)
    (q, k, v), flat = recorded.calls
    batch, heads, tokens, head_dim = q.shape
    for tensor in (q, k, v):
        assert tensor.stride() == (tokens * heads * head_dim, head_dim, heads * head_dim, 1)
        assert tensor.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()
    assert all(t.is_contiguous() for t in flat)
    torch.testing.assert_close(got, expected)


def test_expanded_boolean_mask_becomes_an_additive_mask_made_before_the_expand() -> None:
    """sd-scripts' Lumina 2 expands a key-padding mask to (batch, heads, queries, keys) before
    attention; the rewrite builds the additive mask at (batch, 1, 1, keys) and expands that, with
    the same output and gradients. A mask that is not expanded is left to SDPA."""
    from compile_accel.attention import additive_masks_before_expand

    def expanded(q, k, v, keep, calls):
        calls.add_(1)  # an in-place op whose result is unused must survive the rewrite
        b, h, n, _ = q.shape
        mask = keep.view(b, 1, 1, n).expand(-1, h, n, -1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def broadcast(q, k, v, keep, calls):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])

    q, k, v = (torch.randn(2, 3, 6, 8, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 6) > 0.4
    keep[:, 0] = True  # every query sees a key
    calls = torch.zeros(())
    (gm,), (untouched,) = (_dynamo_graphs(fn, q, k, v, keep, calls) for fn in (expanded, broadcast))
    assert additive_masks_before_expand(untouched) == 0
    assert additive_masks_before_expand(gm) == 1
    sdpa = next(n for n in gm.graph.nodes if n.target is torch.nn.functional.scaled_dot_product_attention)
    mask = sdpa.kwargs["attn_mask"]
    assert mask.target == "expand" and mask.args[0].target == "masked_fill"
    expected = expanded(q, k, v, keep, torch.zeros(()))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    calls.zero_()
    (out,) = _call_by_name(gm, q=q, k=k, v=v, keep=keep, calls=calls)
    assert calls.item() == 1
    torch.testing.assert_close(out, expected)
    for grad, want in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), expected_grads):
        torch.testing.assert_close(grad, want)


class _MLPBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_each_compiled_graph_is_logged_with_its_seconds_and_the_count(caplog: pytest.LogCaptureFixture) -> None:
    """A block class's first compile (seconds to minutes on a real model) is announced and timed;
    the next blocks and steps reuse the graph and log nothing; a new shape's graph (a U-Net
    compiles one per layer shape) is timed and counted too."""
    blocks = torch.nn.ModuleList([_MLPBlock(), _MLPBlock()])
    compile_accel.apply(blocks, CompileConfig(mode="blocks", backend="eager"), blocks=[blocks])
    x = torch.randn(2, 8, requires_grad=True)
    with caplog.at_level("INFO", logger="compile_accel"):
        for _ in range(2):
            blocks[1](blocks[0](x)).sum().backward()
        blocks[0](torch.randn(3, 8, requires_grad=True)).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "compile_accel"]
    assert len(lines) == 3 and lines[0] == "compiling _MLPBlock (training) ..."
    assert re.fullmatch(r"compiled _MLPBlock \(training\) in \d+\.\d s \(graphs compiled so far: 1\)", lines[1])
    new_shape = r"compiled _MLPBlock \(training, new input shapes\) in \d+\.\d s \(graphs compiled so far: 2\)"
    assert re.fullmatch(new_shape, lines[2])


class _RefinedBlock(torch.nn.Module):
    """sd-scripts' JointTransformerBlock in small: forward(*args) checkpoints _forward, whose
    modulation input is optional (NextDiT's context refiner passes 3 arguments, its noise
    refiner and layers 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention, self.modulation = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.gradient_checkpointing = False

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.training and self.gradient_checkpointing:
            return torch.utils.checkpoint.checkpoint(self._forward, *args, use_reentrant=False)
        return self._forward(*args)

    def _forward(
        self, x: torch.Tensor, mask: torch.Tensor, freqs: torch.Tensor, adaln: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attention(x * freqs).masked_fill(~mask[..., None], 0.0)
        return x if adaln is None else x * (1 + self.modulation(adaln))[:, None]


class _RefinedModel(torch.nn.Module):
    """NextDiT's call pattern: the refiner blocks get (x, mask, freqs) at the caption's token
    count, the layers the same block class with (x, mask, freqs, t) at the joint token count."""

    def __init__(self) -> None:
        super().__init__()
        self.context_refiner = torch.nn.ModuleList([_RefinedBlock(), _RefinedBlock()])
        self.layers = torch.nn.ModuleList([_RefinedBlock(), _RefinedBlock()])

    def forward(self, captions: torch.Tensor, image: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for block in self.context_refiner:
            captions = block(captions, torch.ones(captions.shape[:2], dtype=torch.bool), torch.ones_like(captions))
        x = torch.cat([captions, image], 1)
        for block in self.layers:
            x = block(x, torch.ones(x.shape[:2], dtype=torch.bool), torch.ones_like(x), t)
        return x


@pytest.mark.parametrize("mode", list(MODES))
def test_blocks_called_with_two_argument_counts_compile_one_graph_each_and_no_recompile(
    mode: str, dynamo_recompiles: list[str]
) -> None:
    """One block function called with 3 arguments by some blocks and 4 by others (sd-scripts'
    NextDiT) compiles a graph per call signature, each from its first call: dynamo logs no
    recompile, as stats() counts none. A kohya-style LoRA is on the blocks; the model's
    checkpointing on for selective, replaced by the budget in blocks mode."""
    config, checkpointing = MODES[mode]
    torch._dynamo.reset()  # the LoRA modules' forward has dynamo cache entries from the tests before
    torch.manual_seed(0)
    model = _RefinedModel()
    model.requires_grad_(False)
    network = KohyaStyleLoRANetwork(model, ["*.attention", "layers.*.modulation"], up_init_std=0.05)
    model.train()
    for block in (*model.context_refiner, *model.layers):
        block.gradient_checkpointing = checkpointing is not None
    acceleration = compile_accel.apply(model, dataclasses.replace(config, backend="aot_eager"))
    for _ in range(2):
        model(torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 8)).square().mean().backward()
    assert all(p.grad is not None for p in network.parameters())
    stats = acceleration.stats()
    assert (stats["unique_graphs"], stats["recompiles"], stats["fallbacks"]) == (2, 0, [])
    assert dynamo_recompiles == []


@pytest.mark.parametrize("dynamic, symbolic", [(None, False), (True, True)])
def test_an_adapter_of_fixed_sizes_compiles_per_size_unless_the_config_says(
    dynamic: bool | None, symbolic: bool
) -> None:
    """ModelAdapter(static_shapes=True) (a U-Net's levels): with CompileConfig.dynamic None each
    size compiles a graph of its own, none symbolic; a dynamic the config names is kept."""
    import torch.nn as nn

    from compile_accel.adapters import ModelAdapter
    from compile_accel.api import apply_adapter

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return x

    model = Model()
    config = CompileConfig(mode="blocks", backend=BACKEND, dynamic=dynamic)
    acceleration = apply_adapter(model, config, ModelAdapter(("blocks",), static_shapes=True))
    for rows in (4, 6, 10):  # automatic dynamic shapes turn symbolic from the second size on
        model(torch.randn(rows, 8, requires_grad=True)).sum().backward()
    # Per size: 3 graphs; symbolic: 1; automatic dynamic shapes would have made 2.
    stats = acceleration.stats()
    assert acceleration.config.dynamic is (False if dynamic is None else dynamic)
    assert (stats["unique_graphs"], stats["recompiles"]) == (1 if symbolic else 3, 0)
    acceleration.remove()
