"""Which modules selective mode compiles: a block's checkpointed body, children reached through
their parent, no lone built-in layers; U-Net block lists and their checkpoint switches.

The models here are small stand-ins with the code shapes of kohya sd-scripts' blocks (a
checkpointed `_forward` / `forward_body`, a Flux-style block that calls its attention's
projections directly, an SDXL-style U-Net). Parity is against eager on fresh random inputs."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import relative_error
from torch.utils.checkpoint import checkpoint

import compile_accel
from compile_accel import CompileConfig
from compile_accel import backend as region_backend
from compile_accel.benchmarks.lora import KohyaStyleLoRANetwork
from compile_accel.blocks import match_block_lists, resolve_block_lists
from compile_accel.integrations.sd_scripts import FAMILIES
from compile_accel.selective import checkpoint_body, region_specs

TOLERANCE = 1e-4  # fp32 on the CPU: compiled and eager differ by rounding only
# Which modules are compiled is under test, not inductor's code: aot_eager runs the same graphs
# (tests/test_parity.py compiles them with inductor).
BACKEND = "aot_eager"
DIM = 16


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.scale


class Attention(nn.Module):
    """Its forward is never called by the block below: the block reaches into its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.norm = RMSNorm()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the block never calls this")


class FluxStyleBlock(nn.Module):
    """Flux's double block shape, checkpointed from the model's loop (no body of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.pre_norm = nn.LayerNorm(DIM, elementwise_affine=False)  # a lone built-in layer
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(approximate="tanh"), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn.qkv(self.pre_norm(x)).chunk(3, dim=-1)
        q = self.attn.norm(q)
        x = x + self.attn.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.mlp(x)


class BodyBlock(nn.Module):
    """sd-scripts' checkpoint mixin: `forward` checkpoints `_forward` when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)
        self.norm = RMSNorm()
        self.gradient_checkpointing = False

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.linear(self.norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.gradient_checkpointing:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class ReentrantBodyBlock(BodyBlock):
    """sd-scripts' SDXL checkpoints reentrantly: the body runs first without grad, and again in
    the backward; the checkpoint keeps the block's input (the block before's output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x, use_reentrant=True)


class WrappedBodyBlock(BodyBlock):
    """sd-scripts' SDXL form: the body goes through a `create_custom_forward` wrapper."""

    def forward_body(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x) * 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.gradient_checkpointing:

            def create_custom_forward(func):
                def custom_forward(*inputs):
                    return func(*inputs)

                return custom_forward

            return checkpoint(create_custom_forward(self.forward_body), x, use_reentrant=False)
        return self.forward_body(x)


class BoundBodyBlock(BodyBlock):
    """sd-scripts' HunyuanImage and Anima forms: the body bound to a local name first, and a
    checkpoint function of another name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.gradient_checkpointing:
            forward_fn = self._forward
            return torch_checkpoint(forward_fn, x, use_reentrant=False)
        return self._forward(x)


def torch_checkpoint(*args: object, **kwargs: object) -> torch.Tensor:
    return checkpoint(*args, **kwargs)


class Transformer(nn.Module):
    """SDXL's Transformer2DModel shape: not checkpointed itself, its transformer blocks are."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, DIM)
        self.proj_in = nn.Linear(DIM, DIM)
        self.transformer_blocks = nn.ModuleList([BodyBlock(), BodyBlock()])
        self.proj_out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(self.norm(x.transpose(1, 2)).transpose(1, 2))
        for block in self.transformer_blocks:
            h = block(h)
        return x + self.proj_out(h)


class SdxlStyleUNet(nn.Module):
    """input_blocks / middle_block / output_blocks of layer lists, as sd-scripts' SDXL U-Net
    (its first input block is a Sequential holding one conv, here one Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(DIM, DIM)), nn.ModuleList([WrappedBodyBlock(), Transformer()])]
        )
        self.middle_block = nn.ModuleList([WrappedBodyBlock(), Transformer(), WrappedBodyBlock()])
        self.output_blocks = nn.ModuleList([nn.ModuleList([WrappedBodyBlock(), Transformer()])])

    def enable_gradient_checkpointing(self) -> None:
        for module in self.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for layers in self.input_blocks:
            for layer in layers:
                x = layer(x)
            skips.append(x)
        for layer in self.middle_block:
            x = layer(x)
        for layers in self.output_blocks:
            x = x + skips.pop()
            for layer in layers:
                x = layer(x)
        return x


class Stack(nn.Module):
    """Blocks checkpointed from the model's loop, as diffusers does (`loop_checkpoint`)."""

    def __init__(self, block: type[nn.Module], count: int = 3, loop_checkpoint: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(count)])
        self.loop_checkpoint = loop_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.training and self.loop_checkpoint else block(x)
        return x


def _with_lora(model: nn.Module, targets: tuple[str, ...] = ("*",)) -> list[nn.Parameter]:
    """Frozen model, kohya-style LoRA (the forward of each target nn.Linear patched), in training."""
    model.requires_grad_(False)
    network = KohyaStyleLoRANetwork(model, list(targets), rank=2, alpha=2, up_init_std=0.05)
    model._test_network = [network]
    model.train()
    return list(network.parameters())


def _step(model: nn.Module, params: list[nn.Parameter], x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(x).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach(), grads


def _assert_matches_eager(
    model: nn.Module, params: list[nn.Parameter], config: CompileConfig, **apply
) -> compile_accel.Acceleration:
    """Three steps on fresh inputs: loss and LoRA gradients equal eager's, every region compiled
    and called, nothing compiled again."""
    inputs = [torch.randn(2, 8, DIM) for _ in range(3)]
    expected = [_step(model, params, x) for x in inputs]
    acceleration = compile_accel.apply(model, config, **apply)
    for x, (loss, grads) in zip(inputs, expected, strict=True):
        got_loss, got_grads = _step(model, params, x)
        assert relative_error(got_loss, loss) < TOLERANCE
        assert all(relative_error(g, e) < TOLERANCE for g, e in zip(got_grads, grads, strict=True))
    stats = acceleration.stats()
    assert stats["fallbacks"] == [] and stats["recompiles"] == 0 and stats["uncalled_regions"] == []
    return acceleration


def test_children_reached_through_a_parent_are_compiled_instead_of_it() -> None:
    model = Stack(FluxStyleBlock)
    params = _with_lora(model)
    specs = region_specs("selective", resolve_block_lists(model, None), [])
    # attn's own forward never runs: its projections (LoRA-patched) and its norm are the
    # regions; the lone LayerNorm stays eager, the MLP is one region.
    assert [s.label for s in specs if s.name.startswith("blocks.0.")] == [
        "blocks.0.attn.qkv",
        "blocks.0.attn.norm",
        "blocks.0.attn.proj",
        "blocks.0.mlp",
    ]
    stats = _assert_matches_eager(model, params, CompileConfig(mode="selective", backend=BACKEND)).stats()
    assert stats["compiled_regions"] == stats["regions"] == 12
    # Every module whose forward runs with compute of its own is inside a region.
    covered = {id(m) for s in specs for m in s.module.modules()}
    left = [n for n, m in model.named_modules() if id(m) not in covered and isinstance(m, (RMSNorm, nn.Sequential))]
    assert left == []


def test_a_checkpointed_body_is_compiled_and_the_checkpoint_stays_eager() -> None:
    model = Stack(BodyBlock)
    for block in model.blocks:
        block.gradient_checkpointing = True
    params = _with_lora(model)
    assert checkpoint_body(BodyBlock) == "_forward"
    stats = _assert_matches_eager(model, params, CompileConfig(mode="selective", backend=BACKEND)).stats()
    # One body region per block, one graph for the class; forward (the checkpoint) untouched.
    assert stats["regions"] == stats["compiled_regions"] == 3 and stats["unique_graphs"] == 1
    assert all("forward" not in vars(block) and "_forward" in vars(block) for block in model.blocks)


def test_a_body_behind_a_wrapper_call_or_a_local_name_is_found() -> None:
    assert checkpoint_body(WrappedBodyBlock) == "forward_body"
    assert checkpoint_body(BoundBodyBlock) == "_forward"
    assert checkpoint_body(FluxStyleBlock) is None and checkpoint_body(Transformer) is None


def test_remove_gives_the_body_method_back() -> None:
    model = Stack(BodyBlock)
    _with_lora(model)
    acceleration = compile_accel.apply(model, CompileConfig(mode="selective", backend=BACKEND))
    acceleration.remove()
    assert all("_forward" not in vars(block) for block in model.blocks)


class PooledOutputCompilers:
    """Stand-in for inductor's compilers (compile_accel.backend._inner_backend): a graph compiled
    with CUDA graphs returns its outputs in buffers of its own that its next call overwrites, as a
    CUDA graph's replay does (in its pool); without, it runs the graph as traced. Notes the grad
    mode each graph was compiled in, per kind."""

    def __init__(self) -> None:
        self.grad_modes: dict[bool, list[bool]] = {True: [], False: []}  # with CUDA graphs -> grad modes

    def __call__(self, config: CompileConfig, cuda_graphs: bool = True):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            self.grad_modes[cuda_graphs].append(torch.is_grad_enabled())
            if not cuda_graphs:
                return gm.forward
            pool: list[torch.Tensor] = []

            def replay(*args: torch.Tensor) -> tuple:
                outputs = gm.forward(*args)
                pool[:] = pool or [torch.empty_like(out) for out in outputs]
                for buffer, out in zip(pool, outputs, strict=True):
                    buffer.copy_(out)
                return tuple(pool)

            return replay

        return compile_graph


def _reentrant_steps_as_eager(model: nn.Module, config: CompileConfig) -> compile_accel.Acceleration:
    """Two steps on fresh inputs (which require grad, as a reentrant checkpoint needs): loss and
    LoRA gradients equal eager's."""
    params = _with_lora(model)
    inputs = [torch.randn(2, 8, DIM, requires_grad=True) for _ in range(2)]
    expected = [_step(model, params, x) for x in inputs]
    acceleration = compile_accel.apply(model, config)
    for x, (loss, grads) in zip(inputs, expected, strict=True):
        got_loss, got_grads = _step(model, params, x)
        assert relative_error(got_loss, loss) < TOLERANCE
        assert all(relative_error(g, e) < TOLERANCE for g, e in zip(got_grads, grads, strict=True))
    return acceleration


def test_selective_cuda_graphs_record_the_graphs_without_grad_and_copy_their_outputs_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a reentrant checkpoint each block's body output is the next block's input, kept for
    the recompute: left in the pool, the next block's replay would overwrite it and the
    gradients would be wrong. The recompute's graph (with grad) compiles without CUDA graphs."""
    compilers = PooledOutputCompilers()
    monkeypatch.setattr(region_backend, "_inner_backend", compilers)
    model = Stack(ReentrantBodyBlock, loop_checkpoint=False)
    config = CompileConfig(mode="selective", compile_mode="reduce-overhead")
    stats = _reentrant_steps_as_eager(model, config).stats()
    assert compilers.grad_modes == {True: [False], False: [True]}
    assert stats["cuda_graph_graphs"] == 1 and stats["compiled_regions"] == stats["regions"] == 3


def test_selective_cuda_graphs_with_nothing_of_training_run_without_grad_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-reentrant checkpoint runs the body with grad. A sampling forward before training
    (eval, no grad) records its graphs, and does not hide that training records none."""
    compilers = PooledOutputCompilers()
    monkeypatch.setattr(region_backend, "_inner_backend", compilers)
    model = Stack(BodyBlock, loop_checkpoint=False)
    for block in model.blocks:
        block.gradient_checkpointing = True
    params = _with_lora(model)
    x = torch.randn(2, 8, DIM)
    expected_loss, expected_grads = _step(model, params, x)
    acceleration = compile_accel.apply(model, CompileConfig(mode="selective", compile_mode="reduce-overhead"))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about yet
        model.eval()
        model(torch.randn(1, 8, DIM))
    model.train()
    with pytest.warns(RuntimeWarning, match="compiled every graph with grad: nothing of training replays"):
        loss, grads = _step(model, params, x)
    assert relative_error(loss, expected_loss) < TOLERANCE
    assert all(relative_error(g, e) < TOLERANCE for g, e in zip(grads, expected_grads, strict=True))
    assert compilers.grad_modes == {True: [False], False: [True]}
    assert acceleration.stats()["cuda_graph_graphs"] == 1


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_graphs_with_grad_compile_in_the_same_inductor_mode_without_cuda_graphs(mode: str) -> None:
    config = CompileConfig(mode="selective", compile_mode=mode)
    recording = region_backend._inner_backend(config).config
    plain = region_backend._inner_backend(config, cuda_graphs=False).config
    assert recording.pop("triton.cudagraphs") is True and plain.get("triton.cudagraphs", False) is False
    assert plain == recording  # the mode's other settings (max-autotune's) kept


def test_sdxl_family_lists_every_layer_list_of_the_unet() -> None:
    unet = SdxlStyleUNet()
    paths = match_block_lists(unet, FAMILIES["SdxlUNet2DConditionModel"].blocks)
    # Nested lists (each Transformer's transformer_blocks) are inside these, not beside them;
    # the Sequential holding the first layer is no layer list.
    assert paths == ["input_blocks.1", "middle_block", "output_blocks.0"]


UNET_LORA_TARGETS = ("*.linear", "*.proj_in", "*.proj_out")


@pytest.fixture(scope="module")
def unet_paths() -> list[str]:
    return match_block_lists(SdxlStyleUNet(), FAMILIES["SdxlUNet2DConditionModel"].blocks)


def test_unet_selective_compiles_every_checkpointed_body_and_the_lora_layers_between(unet_paths) -> None:
    torch.manual_seed(0)
    unet = SdxlStyleUNet()
    unet.enable_gradient_checkpointing()
    params = _with_lora(unet, UNET_LORA_TARGETS)
    labels = [s.label for s in region_specs("selective", resolve_block_lists(unet, unet_paths), [])]
    assert "input_blocks.1.0.forward_body" in labels and "input_blocks.1.1.transformer_blocks.1._forward" in labels
    assert "input_blocks.1.1.proj_in" in labels and "input_blocks.1.1.norm" not in labels
    config = CompileConfig(mode="selective", backend=BACKEND)
    stats = _assert_matches_eager(unet, params, config, blocks=unet_paths).stats()
    assert stats["checkpointing_switched_off"] == []


def test_unet_blocks_with_a_budget_switch_off_the_checkpoints_inside_them(unet_paths) -> None:
    torch.manual_seed(0)
    unet = SdxlStyleUNet()
    unet.enable_gradient_checkpointing()
    params = _with_lora(unet, UNET_LORA_TARGETS)
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend=BACKEND)
    acceleration = _assert_matches_eager(unet, params, config, blocks=unet_paths)
    stats = acceleration.stats()
    flags = {n: m.gradient_checkpointing for n, m in unet.named_modules() if hasattr(m, "gradient_checkpointing")}
    # Every ResBlock-style layer and every transformer block inside a compiled Transformer.
    assert sorted(stats["checkpointing_switched_off"]) == sorted(flags) and not any(flags.values())
    assert stats["regions"] == 7  # two layers per list, three in the middle
    acceleration.remove()
    assert all(m.gradient_checkpointing for m in unet.modules() if hasattr(m, "gradient_checkpointing"))
