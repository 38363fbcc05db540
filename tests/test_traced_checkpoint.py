"""Selective mode traces torch's checkpoint of a block's body into the body's graph
(compile_accel.checkpointing): the backward recomputes inside the compiled graph, and the eager
checkpoint around the body has nothing to recompute. A body behind a wrapper of the trainer's
(sd-scripts' CPU-offload checkpointing) keeps the eager checkpoint. A block that checkpoints
reentrantly (sd-scripts' U-Nets) has its forward compiled, checkpoint and all
(compile_accel.selective)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import relative_error
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import compile_accel
from compile_accel import CompileConfig
from compile_accel.backend import RegionBackend
from compile_accel.blocks import resolve_block_lists
from compile_accel.checkpointing import traced_checkpoint
from compile_accel.selective import region_specs
from compile_accel.stats import Stats

TOLERANCE = 1e-5  # float32 on the CPU, aot_eager: the same ops as eager
WIDTH, HIDDEN = 16, 64
BLOCKS = 3
USE_REENTRANT = True  # as sd-scripts' U-Nets pass it

# Per backward graph: the shapes of the tensors its forward saved for it.
_SAVED: list[list[tuple[int, ...]]] = []


def _record_saved(graph: torch.fx.GraphModule, _: list) -> object:
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    _SAVED.append([tuple(n.meta["val"].shape) for n in placeholders if "val" in n.meta])
    return make_boxed_func(graph.forward)


@torch._dynamo.register_backend(name="compile_accel_test_saved")
def _saved_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    forward = lambda g, _: make_boxed_func(g.forward)  # noqa: E731
    return aot_autograd(fw_compiler=forward, bw_compiler=_record_saved)(gm, example_inputs)


def _moved(tensor: torch.Tensor) -> torch.Tensor:
    """sd-scripts' `to_cuda` of an offloaded input, in small: a new tensor."""
    return tensor.clone()


class _Block(nn.Module):
    """sd-scripts' checkpoint mixin: `forward` checkpoints `_forward`; `offloaded`: through
    sd-scripts' CPU-offload wrapper, which moves the inputs before calling the body."""

    def __init__(self, offloaded: bool = False, graph_break: bool = False, policy: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)
        self.offloaded, self.graph_break, self.policy = offloaded, graph_break, policy

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.up(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.down(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offloaded:

            def create_custom_forward(func):
                def custom_forward(*inputs):
                    return func(*[_moved(t) for t in inputs])

                return custom_forward

            return checkpoint(create_custom_forward(self._forward), x, use_reentrant=False)
        if self.policy:  # a selective checkpoint policy: tanh's output saved, the rest recomputed
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=_save_tanh)
        return checkpoint(self._forward, x, use_reentrant=False)


def _save_tanh() -> tuple:
    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.tanh.default else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _ReentrantBlock(_Block):
    """sd-scripts' U-Net form: a pass-through wrapper, a reentrant checkpoint."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def create_custom_forward(func):
            def custom_forward(*inputs):
                return func(*inputs)

            return custom_forward

        return torch.utils.checkpoint.checkpoint(create_custom_forward(self._forward), x, use_reentrant=USE_REENTRANT)


class _Model(nn.Module):
    def __init__(self, reentrant: bool = False, **block: bool) -> None:
        super().__init__()
        # (trained under a reentrant checkpoint, which gives no gradient to a call whose inputs have none)
        self.embed = nn.Linear(WIDTH, WIDTH).requires_grad_(reentrant)
        self.blocks = nn.ModuleList([(_ReentrantBlock if reentrant else _Block)(**block) for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def _steps(**block: bool) -> tuple[compile_accel.Acceleration, list[int]]:
    """Three training steps on fresh inputs, gradients as eager's; the body region calls of each."""
    _SAVED.clear()
    model, eager = _Model(**block), _Model(**block)
    eager.load_state_dict(model.state_dict())
    config = CompileConfig(mode="selective", backend="compile_accel_test_saved")
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    calls = []
    for _ in range(3):
        x = torch.randn(2, 8, WIDTH)
        before = sum(region.calls for region in acceleration.regions)
        grads = []
        for m in (model, eager):
            m(x).square().mean().backward()
            grads.append([p.grad for p in m.parameters() if p.requires_grad])
            m.zero_grad(set_to_none=True)
        assert all(relative_error(g, e) < TOLERANCE for g, e in zip(*grads, strict=True))
        calls.append(sum(region.calls for region in acceleration.regions) - before)
    return acceleration, calls


def _saves_hidden_activations() -> bool:
    """Whether a backward graph was handed an activation of the blocks' hidden width."""
    return any(len(shape) == 3 and shape[-1] == HIDDEN for saved in _SAVED for shape in saved)


def test_torchs_checkpoint_of_the_body_is_traced_and_recomputes_inside_the_graph() -> None:
    """One graph for the class, each body called once a step (the eager checkpoint around it
    recomputes nothing), and the graph saves no hidden activation (the traced checkpoint
    recomputes it in the backward)."""
    acceleration, calls = _steps()
    stats = acceleration.stats()
    assert (stats["compiled_regions"], stats["unique_graphs"], stats["recompiles"], stats["fallbacks"]) == (
        BLOCKS,
        1,
        0,
        [],
    )
    assert calls == [BLOCKS] * 3
    assert _SAVED and not _saves_hidden_activations()
    acceleration.remove()


@pytest.mark.parametrize("block", [{"offloaded": True}, {"policy": True}], ids=["wrapper", "policy"])
def test_a_body_behind_the_trainers_wrapper_or_under_a_checkpoint_policy_keeps_the_eager_checkpoint(
    block: dict[str, bool],
) -> None:
    """Called by a wrapper that moves its inputs, or under a selective checkpoint policy (which a
    traced checkpoint would drop), the body is compiled alone: the eager checkpoint recomputes it
    in the backward (two calls a step), its graph saving its activations."""
    acceleration, calls = _steps(**block)
    assert acceleration.stats()["unique_graphs"] == 1
    assert calls == [2 * BLOCKS] * 3
    assert _saves_hidden_activations()
    acceleration.remove()


def test_a_traced_checkpoint_that_compiles_no_graph_falls_back_to_the_body_alone_and_says_so() -> None:
    """A graph break in the body makes dynamo run the traced checkpoint eager: a warning, and
    the body compiled alone (its two pieces) under the eager checkpoint from then on."""
    with pytest.warns(RuntimeWarning, match="could not be compiled with its checkpoint traced"):
        acceleration, calls = _steps(graph_break=True)
    stats = acceleration.stats()
    assert stats["fallbacks"] == [] and stats["compiled_regions"] == BLOCKS and stats["unique_graphs"] >= 2
    assert calls[1:] == [2 * BLOCKS] * 2
    acceleration.remove()


def test_a_reentrant_checkpoint_is_compiled_with_the_blocks_forward_except_under_cuda_graphs() -> None:
    """The forward is the region (called once a step: the body is not a region); the graph saves
    no hidden activation. With CUDA graphs the body stays the region: its forward without grad
    is the graph that replays."""
    acceleration, calls = _steps(reentrant=True)
    assert [region.name for region in acceleration.regions] == [f"blocks.{i}" for i in range(BLOCKS)]
    assert calls == [BLOCKS] * 3 and not _saves_hidden_activations()
    acceleration.remove()
    block_lists = resolve_block_lists(_Model(reentrant=True), ["blocks"])
    labels = [spec.label for spec in region_specs("selective", block_lists, [], cuda_graphs=True)]
    assert labels == [f"blocks.{i}._forward" for i in range(BLOCKS)]


def test_where_torch_does_not_mark_the_rng_wrapper_cacheable_region_compiles_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 and 2.12: a recomputed attention's rng wrapper would keep a traced checkpoint's
    graph out of the caches (and so out of the compile workers' hands) unless marked, and only
    around the regions' compiles."""
    op = torch._prims.rng_prims.graphsafe_run_with_rng_state
    monkeypatch.setattr(op, "_cacheable", False)
    backend = RegionBackend(CompileConfig(mode="selective"), None, Stats())
    with backend._settings():
        assert op.cacheable()
    assert not op.cacheable()


def test_base_compute_checks_the_accuracy_of_the_graph_the_step_runs() -> None:
    """With 8-bit base matmuls, the accuracy check at the class's first compiled call runs the
    traced graph, not a graph of the body alone compiled for the check."""
    model = _Model()
    model.blocks.requires_grad_(False)  # frozen base Linears; the embedder trains
    model.embed.requires_grad_(True)
    config = CompileConfig(mode="selective", backend="aot_eager", base_compute="int8")
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    for _ in range(3):
        model(torch.randn(2, 8, WIDTH)).square().mean().backward()
    stats = acceleration.stats()
    assert stats["unique_graphs"] == 1 and "_Block" in stats["base_compute"]["accuracy"]
    acceleration.remove()


def test_each_traced_function_is_named_after_its_body_where_dynamo_names_it() -> None:
    """Dynamo names a function by its code's name, file and line where it hits the recompile
    limit (compile_accel.stats watches for that line): one body's warning must not be another's."""
    bodies = (_Block._forward, _ReentrantBlock.forward, _Model.forward)
    names = {traced_checkpoint(body).__code__.co_name for body in bodies}
    assert names == {f"{body.__qualname__} under its checkpoint" for body in bodies}
