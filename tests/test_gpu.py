"""On a CUDA device (skipped without one): bf16 parity, offloaded weights, `.data` swaps."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import build, inputs_for, lora_step, relative_error

import compile_accel
from compile_accel import CompileConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]



def _cuda_step(model, params, inputs, autocast: bool = True):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        return lora_step(model, params, inputs)


def _on_cuda(lora: str = "kohya"):
    model, params = build(lora, None, dim=256, heads=4, text_dim=64)
    model.cuda()
    for network in getattr(model, "_test_network", []):
        network.cuda()
    inputs = tuple(t.cuda() for t in inputs_for(model, res=32, text_len=16))
    return model, params, inputs


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_blocks_budget_bf16_lora_gradients_as_close_as_eager(budget: float) -> None:
    """Under bf16 autocast compiled and eager round differently, so both are measured against
    an fp32 eager step: the compiled error may be at most twice eager's (plus 1e-3)."""
    model, params, inputs = _on_cuda()
    reference_loss, reference_grads = _cuda_step(model, params, inputs, autocast=False)
    eager_loss, eager_grads = _cuda_step(model, params, inputs)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=budget))
    loss, grads = _cuda_step(model, params, inputs)

    def close_enough(compiled: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor) -> bool:
        return relative_error(compiled, reference) <= 2 * relative_error(eager, reference) + 1e-3

    assert close_enough(loss, eager_loss, reference_loss)
    assert all(map(close_enough, grads, eager_grads, reference_grads))
    stats = acceleration.stats()
    assert stats["compiled_regions"] == stats["regions"] and stats["unique_graphs"] == 2


def test_cuda_data_swap_does_not_recompile() -> None:
    model, params, inputs = _on_cuda()
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5))
    _cuda_step(model, params, inputs)
    graphs = acceleration.stats()["unique_graphs"]
    for p in model.single_blocks.parameters():
        p.data = p.data.clone()  # new CUDA storage, same dtype/shape/stride
    _cuda_step(model, params, inputs)
    assert acceleration.stats()["unique_graphs"] == graphs and acceleration.stats()["recompiles"] == 0


def _to_gpu(module: nn.Module, args: tuple) -> None:
    module.cuda()


def _to_host(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
    module.cpu()


class _JustInTime(nn.Module):
    """Weights in host memory, brought to the GPU by a pre-hook for each call (as module-level
    offloading does) and sent back by a post-hook."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.lin.register_forward_pre_hook(_to_gpu)
        self.lin.register_forward_hook(_to_host)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_block_with_host_weights_runs_eager_and_is_counted() -> None:
    blocks = nn.ModuleList(_JustInTime() for _ in range(3))
    x = torch.randn(4, 64, device="cuda")
    expected = x
    for block in blocks:
        expected = block(expected)
    holder = nn.Module()
    holder.blocks = blocks
    acceleration = compile_accel.apply(holder, CompileConfig(mode="blocks"), blocks=["blocks"])
    out = x
    for block in blocks:
        out = block(out)
    torch.testing.assert_close(out, expected)
    stats = acceleration.stats()
    assert stats["eager_nonresident_calls"] == 3 and stats["unique_graphs"] == 0
