"""Which block inputs a compiled graph takes as requiring grad (compile_accel.region_inputs): the
hidden states blocks pass on, in every call; the model's conditioning, handed to every block as
the same tensor, as the caller gives it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import relative_error
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils.checkpoint import checkpoint

import compile_accel
from compile_accel import CompileConfig, regions

TOLERANCE = 1e-5  # float32 on the CPU, aot_eager: the same ops as eager
WIDTH = 16

# Per graph: each placeholder's shape and requires_grad, as the backend was handed them.
_GRAPH_INPUTS: list[list[tuple[tuple[int, ...], bool]]] = []


@torch._dynamo.register_backend(name="compile_accel_test_inputs")
def _inputs_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    _GRAPH_INPUTS.append([(tuple(t.shape), t.requires_grad) for t in example_inputs if isinstance(t, torch.Tensor)])
    return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)


class _ModulatedBlock(nn.Module):
    """A DiT block in small: a frozen modulation of the timestep embedding, a trained Linear."""

    def __init__(self, checkpointed: bool, reentrant: bool = False) -> None:
        super().__init__()
        self.modulation = nn.Linear(WIDTH, 2 * WIDTH).requires_grad_(False)
        self.proj = nn.Linear(WIDTH, WIDTH)  # trained (a LoRA's stand-in)
        self.checkpointed, self.reentrant = checkpointed, reentrant

    def body(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        scale, gate = self.modulation(emb).unsqueeze(1).chunk(2, dim=-1)
        return x + gate * self.proj(torch.tanh(x * (1 + scale)))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self.body, x, emb, use_reentrant=self.reentrant)
        return self.body(x, emb)


class _Model(nn.Module):
    def __init__(self, checkpointed: bool = False, reentrant: bool = False) -> None:
        super().__init__()
        # (trained under a reentrant checkpoint, which gives no gradient to a call whose inputs have none)
        self.x_embedder = nn.Linear(WIDTH, WIDTH).requires_grad_(reentrant)
        self.t_embedder = nn.Linear(1, WIDTH).requires_grad_(False)
        self.blocks = nn.ModuleList([_ModulatedBlock(checkpointed, reentrant) for _ in range(3)])

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x, emb = self.x_embedder(x), self.t_embedder(t)
        for block in self.blocks:
            x = block(x, emb)
        return x


def _step(model: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    model(*inputs).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return grads


def _twins(checkpointed: bool = False, reentrant: bool = False) -> tuple[nn.Module, nn.Module]:
    model = _Model(checkpointed, reentrant)
    eager = _Model(checkpointed, reentrant)
    eager.load_state_dict(model.state_dict())
    return model, eager


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 8, WIDTH), torch.rand(2, 1)


def test_conditioning_keeps_its_requires_grad_and_the_hidden_states_require_grad_in_every_block() -> None:
    """One graph for the three blocks: the hidden states taken as requiring grad (the first
    block's come from a frozen embedder), the timestep embedding as not; gradients as eager's.
    The first block's first call runs eager; the class is compiled from the second's."""
    _GRAPH_INPUTS.clear()
    model, eager = _twins()
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", backend="compile_accel_test_inputs"))
    for _ in range(2):
        inputs = _inputs()
        grads, expected = _step(model, inputs), _step(eager, inputs)
        assert all(relative_error(g, e) < TOLERANCE for g, e in zip(grads, expected, strict=True))
    stats = acceleration.stats()
    assert (stats["unique_graphs"], stats["recompiles"], stats["fallbacks"]) == (1, 0, [])
    [graph_inputs] = _GRAPH_INPUTS
    assert ((2, 8, WIDTH), True) in graph_inputs  # the hidden states
    assert ((2, WIDTH), False) in graph_inputs  # the timestep embedding
    acceleration.remove()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_selective_inside_the_models_own_checkpoint_runs_the_first_call_eager_once(
    reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Selective compiles the body the block checkpoints: the first block's first call runs
    eager, and so must a non-reentrant checkpoint's recompute of it in the backward (it checks
    that its recompute saves what its forward saved); a reentrant one runs its forward in the
    backward, where the first call is. Gradients as eager's every step; eager in the first step
    only (counted by the checkpoint the eager call runs under where no checkpoint is around it)."""
    _GRAPH_INPUTS.clear()
    model, eager = _twins(checkpointed=True, reentrant=reentrant)
    eager_calls = []
    monkeypatch.setattr(regions, "checkpoint", lambda *args, **kwargs: eager_calls.append(1) or checkpoint(*args, **kwargs))
    config = CompileConfig(mode="selective", backend="compile_accel_test_inputs")
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    per_step = []
    for _ in range(3):
        inputs = _inputs()
        grads, expected = _step(model, inputs), _step(eager, inputs)
        assert all(relative_error(g, e) < TOLERANCE for g, e in zip(grads, expected, strict=True))
        per_step.append(len(eager_calls))
    stats = acceleration.stats()
    # A reentrant checkpoint's forward runs without grad: one graph more, for all blocks.
    assert (stats["compiled_regions"], stats["unique_graphs"], stats["recompiles"]) == (3, 1 + reentrant, 0)
    assert ((2, WIDTH), False) in _GRAPH_INPUTS[0]
    # Non-reentrant too: the model's checkpoint calls the body, which runs with that checkpoint
    # traced (compile_accel.checkpointing), so the eager call runs under a checkpoint of its own.
    assert per_step == [1, 1, 1]
    acceleration.remove()


def test_a_block_class_with_one_block_compiles_at_its_first_call_with_the_callers_requires_grad() -> None:
    """Nothing to compare a lone block with: compiled at once, its inputs as the caller gives them."""
    _GRAPH_INPUTS.clear()
    model = nn.Module()
    model.blocks = nn.ModuleList([_ModulatedBlock(checkpointed=False)])
    config = CompileConfig(mode="blocks", backend="compile_accel_test_inputs")
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    model.blocks[0](torch.randn(2, 8, WIDTH), torch.randn(2, WIDTH)).sum().backward()
    assert acceleration.stats()["unique_graphs"] == 1
    assert ((2, 8, WIDTH), False) in _GRAPH_INPUTS[0] and ((2, WIDTH), False) in _GRAPH_INPUTS[0]
    acceleration.remove()
