"""apply() works in place: same state-dict keys and parameters, optimizers keep working,
remove() gives eager back, `.data` swaps do not recompile, non-resident regions run eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error

import compile_accel
from compile_accel import CompileConfig
from compile_accel.benchmarks.lora import KohyaStyleLoRA
from compile_accel.regions import Region

# What apply() and remove() do to the model is under test, not inductor's code: aot_eager compiles
# the same graphs in a fraction of inductor's CPU time.
BACKEND = "aot_eager"
BLOCKS = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend=BACKEND)


def test_state_dict_keys_parameters_and_optimizer_unchanged() -> None:
    model, params = build("peft", "non-reentrant")
    keys = list(model.state_dict())
    ids = [id(p) for p in model.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)  # built before apply
    compile_accel.apply(model, CompileConfig(mode="selective", backend=BACKEND))
    assert list(model.state_dict()) == keys
    assert not any("_orig_mod" in k for k in model.state_dict())
    assert [id(p) for p in model.parameters()] == ids
    before = [p.detach().clone() for p in params]
    model(*inputs_for(model)).square().mean().backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))


def test_remove_gives_eager_back() -> None:
    model, params = build("kohya", None)
    inputs = inputs_for(model)
    eager_loss, eager_grads = lora_step(model, params, inputs)
    acceleration = compile_accel.apply(model, BLOCKS)
    lora_step(model, params, inputs)
    acceleration.remove()
    assert not any(isinstance(m.__dict__.get("forward"), Region) for m in model.modules())
    # kohya's LoRA forwards (installed before apply) are still in place.
    lora_linears = [m for m in model.modules() if isinstance(getattr(m.forward, "__self__", None), KohyaStyleLoRA)]
    assert len(lora_linears) == 12
    loss, grads = lora_step(model, params, inputs)
    assert torch.equal(loss, eager_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads, strict=True))
    compile_accel.apply(model, BLOCKS)  # and it can be applied again


def test_data_swap_does_not_recompile() -> None:
    model, params = build("kohya", None)
    inputs = inputs_for(model)
    acceleration = compile_accel.apply(model, BLOCKS)
    lora_step(model, params, inputs)
    graphs = acceleration.stats()["unique_graphs"]
    for block in [*model.double_blocks, *model.single_blocks]:
        for p in block.parameters():
            p.data = p.data * 1.5  # what an offloader does: new storage, same device/dtype/shape
    loss, grads = lora_step(model, params, inputs)
    stats = acceleration.stats()
    assert stats["unique_graphs"] == graphs and stats["recompiles"] == 0
    acceleration.remove()
    eager_loss, eager_grads = lora_step(model, params, inputs)
    assert relative_error(loss, eager_loss) < 1e-4  # the compiled graphs read the new weights
    assert all(relative_error(g, e) < 1e-4 for g, e in zip(grads, eager_grads, strict=True))


class _LinearStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_region_runs_eager_while_not_resident() -> None:
    """Inputs on another device than the region's weights (meta here, the GPU while an
    offloader holds the weights in host memory): the region runs its eager forward and
    counts it; nothing compiles. Back on one device, it runs compiled, until a tensor registered
    later lives elsewhere."""
    model = _LinearStack()
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", backend=BACKEND))
    out = model(torch.empty(2, 8, device="meta"))
    assert out.device.type == "meta"
    stats = acceleration.stats()
    assert stats["eager_nonresident_calls"] == 2 and stats["unique_graphs"] == 0
    model(torch.randn(2, 8))
    stats = acceleration.stats()
    assert stats["eager_nonresident_calls"] == 2 and stats["unique_graphs"] == 1
    # A child registered after the region's first calls (as LoRA injected late would be) is seen.
    elsewhere = nn.Module()
    elsewhere.register_buffer("state", torch.zeros(1, device="meta"))
    model.blocks[0][0].elsewhere = elsewhere
    model(torch.randn(2, 8))
    assert acceleration.stats()["eager_nonresident_calls"] == 3


def test_train_eval_and_to_still_work() -> None:
    model, _ = build("kohya", None, **ONE_BLOCK_CLASS)  # the float64 graphs are this test's alone
    compile_accel.apply(model, BLOCKS)
    model.eval()
    assert not model.single_blocks[0].training
    model.to(torch.float64)
    model._test_network[0].to(torch.float64)  # kohya's LoRA network lives outside the model
    inputs = [t.double() if t.is_floating_point() else t for t in inputs_for(model)]
    with torch.no_grad():
        out = model(*inputs)
    assert out.dtype == torch.float64 and torch.isfinite(out).all()


def test_modules_outside_blocks_are_untouched() -> None:
    model, _ = build("kohya", None)
    compile_accel.apply(model, BLOCKS)
    for module in (model.img_in, model.time_in, model.final):
        assert not isinstance(module.__dict__.get("forward"), Region)
    assert isinstance(model.double_blocks[0].__dict__.get("forward"), Region)
    assert isinstance(model, nn.Module)


class _Accumulating(nn.Module):
    """Adds into a buffer it is given: in-place on an input, fine in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        total.add_(1.0)
        return self.lin(x) + total.sum()


class _AccumulatingStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Accumulating() for _ in range(2))

    def forward(self, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, total)
        return x


def test_in_place_change_of_an_input_that_needs_no_grad_trains_as_in_eager() -> None:
    model = _AccumulatingStack()
    x = torch.randn(4, 8, requires_grad=True)
    expected_total = torch.zeros(3)
    expected = model(x, expected_total)
    compile_accel.apply(model, CompileConfig(mode="blocks", backend=BACKEND))
    total = torch.zeros(3)
    torch.testing.assert_close(model(x, total), expected)
    torch.testing.assert_close(total, expected_total)


def test_in_place_change_of_a_copied_input_is_an_error_not_a_lost_update() -> None:
    model = _AccumulatingStack()
    compile_accel.apply(model, CompileConfig(mode="blocks", backend=BACKEND))
    total = torch.zeros(3, 2).t()  # not contiguous: the region gets a contiguous copy
    with torch.no_grad(), pytest.raises(RuntimeError, match="changed a view or non-contiguous input in place"):
        model(torch.randn(4, 8), total)
