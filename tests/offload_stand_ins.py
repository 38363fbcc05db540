"""Stand-ins shared by the offload tests (tests/test_offload.py, tests/test_activation_offload.py,
tests/test_gpu.py): stacks of frozen MLP blocks with low-rank adapters, called the diffusers way
(JointStack: token streams as views of one tensor, as in Flux; TanhStack: blocks that save their
own output, which the model reads again), and a LoRA step."""

from __future__ import annotations

import torch
import torch.nn as nn
from conftest import lora_step
from torch.utils.checkpoint import checkpoint

DIM, TOKENS = 32, 16


class Block(nn.Module):
    """A frozen MLP block with a trainable low-rank adapter and a shared conditioning input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)
        self.down = nn.Parameter(torch.randn(DIM, 4) * 0.1)
        self.up = nn.Parameter(torch.randn(4, DIM) * 0.1)
        for module in (self.norm, self.fc1, self.fc2):
            module.requires_grad_(False)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = self.norm(x) + cond
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h))) + h @ self.down @ self.up


class Stack(nn.Module):
    """Blocks called the diffusers way: the checkpoint wraps the block call."""

    def __init__(self, n: int = 6, checkpointing: str | None = "non-reentrant") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing is None:
                x = block(x, cond)
            else:
                x = checkpoint(block, x, cond, use_reentrant=self.checkpointing == "reentrant")
        return x


TEXT = 4  # JointStack's text tokens, the first of TOKENS


class JointBlock(Block):
    """Takes two token streams and returns them as views of one joint tensor, as Flux's
    single-stream blocks do (a view keeps its base, so offloading the views alone frees nothing)."""

    def forward(self, text: torch.Tensor, image: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        joint = super().forward(torch.cat([text, image], dim=1), cond)
        return joint[:, :TEXT], joint[:, TEXT:]


class JointStack(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(JointBlock() for _ in range(n))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        text, image = x[:, :TEXT], x[:, TEXT:]
        for block in self.blocks:
            text, image = checkpoint(block, text, image, cond, use_reentrant=False)
        return torch.cat([text, image], dim=1)


class TanhBlock(Block):
    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x, cond))  # tanh saves its output for backward


class TanhStack(Stack):
    """Blocks that save their own output, and model code between them that reads it again in
    backward (x * x): a block's output must stay on the GPU."""

    def __init__(self, n: int = 6, checkpointing: str | None = None) -> None:
        super().__init__(n, checkpointing)
        self.blocks = nn.ModuleList(TanhBlock() for _ in range(n))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cond)
            x = x * x
        return x


def stack_inputs(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, TOKENS, DIM, requires_grad=True)
    return x, torch.randn(batch, 1, DIM)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def twins(make) -> tuple[nn.Module, nn.Module]:
    """(reference, model): two models from `make()` with the same weights."""
    reference, model = make(), make()
    model.load_state_dict(reference.state_dict())
    return reference, model


def copy_of(model: Stack) -> Stack:
    twin = Stack(len(model.blocks), model.checkpointing)
    twin.load_state_dict(model.state_dict())
    return twin


def step(model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x, cond = inputs
    x = x.detach().requires_grad_(True)
    return lora_step(model, trainable(model), (x, cond))


def assert_compiled_step_matches(model: nn.Module, reference: nn.Module, inputs: tuple) -> None:
    """A LoRA step of `model` (compiled blocks) against the eager `reference` on `inputs`: loss
    and LoRA gradients equal up to float32 reordering (rtol 1e-5 and 1e-4)."""
    loss, grads = step(model, inputs)
    expected_loss, expected = step(reference, inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-7)
