"""On a CUDA device (skipped without one): bf16 parity, offloaded weights, `.data` swaps, the
offload conductor's streams, int8 streaming, and sd-scripts-style block swaps."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import as_close_as_eager, build, inputs_for, lora_step, relative_error, train_beside

import compile_accel
from compile_accel import CompileConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cuda_step(model, params, inputs, autocast: bool = True):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        return lora_step(model, params, inputs)


def _on_cuda(lora: str = "kohya", checkpointing: str | None = None):
    model, params = build(lora, checkpointing, dim=256, heads=4, text_dim=64)
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
    assert as_close_as_eager(loss, eager_loss, reference_loss)
    assert all(map(as_close_as_eager, grads, eager_grads, reference_grads))
    stats = acceleration.stats()
    assert stats["compiled_regions"] == stats["regions"] and stats["unique_graphs"] == 2


@pytest.mark.parametrize("mode, budget", [("selective", None), ("blocks", 0.5), ("blocks", "auto")])
def test_cuda_graphs_train_as_eager_on_fresh_inputs(mode: str, budget: float | str | None) -> None:
    """compile_mode="reduce-overhead" replays CUDA graphs recorded in the first steps: new inputs
    every step and LoRA weights updated in place between steps must give eager's losses and
    gradients (fp32; tolerance 1e-3 for inductor's reordered sums). Selective mode runs under a
    reentrant checkpoint (sd-scripts' SDXL's), whose first forward, without grad, is recorded;
    budget modes have no checkpointing. With "auto", calibration on the first step records and
    measures them."""
    skips_before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    checkpointing = "reentrant" if mode == "selective" else None
    torch.manual_seed(0)
    model, params, _ = _on_cuda(checkpointing=checkpointing)
    torch.manual_seed(0)
    eager, eager_params, _ = _on_cuda(checkpointing=checkpointing)
    limit = 64.0 if budget == "auto" else None
    config = CompileConfig(
        mode=mode, activation_memory_budget=budget, compile_mode="reduce-overhead", vram_limit_gib=limit
    )
    acceleration = compile_accel.apply(model, config)
    if budget == "auto":
        acceleration.auto_budget.candidates = (0.0, 0.5)  # 0.5 predicted to fit: calibration records its graphs
    train_beside(model, params, eager, eager_params, steps=4)
    stats = acceleration.stats()
    assert stats["compiled_regions"] == stats["regions"] > 0
    assert stats["recompiles"] == 0 and stats["fallbacks"] == []
    assert stats["cuda_graph_graphs"] > 0
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips_before  # CUDA graphs did run
    if budget == "auto":
        auto = stats["auto_budget"]
        assert auto["budget"] == 0.5 and auto["fits"] and auto["table"][0]["peak_bytes"] > 0


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


def _cuda_stack(n: int = 6, kind: str = "Stack"):
    import offload_stand_ins

    model = getattr(offload_stand_ins, kind)(n=n).cuda()
    reference = getattr(offload_stand_ins, kind)(n=n).cuda()
    reference.load_state_dict(model.state_dict())
    return model, reference


def _assert_steps_match(model: nn.Module, reference: nn.Module, steps: int, rtol: float) -> None:
    """LoRA steps on fresh random inputs: loss and LoRA gradients within `rtol` of the reference's."""
    from offload_stand_ins import stack_inputs, step

    for _ in range(steps):
        inputs = tuple(t.cuda() for t in stack_inputs())
        loss, grads = step(model, inputs)
        expected_loss, expected = step(reference, inputs)
        torch.testing.assert_close(loss, expected_loss, rtol=rtol, atol=1e-6)
        assert all(relative_error(g, e) < rtol for g, e in zip(grads, expected, strict=True))


@pytest.mark.parametrize("kind, budget", [("Stack", None), ("JointStack", None), ("Stack", 0.5), ("TanhStack", 1.0)])
def test_streamed_compiled_blocks_match_resident_eager_without_recompiles(
    monkeypatch, kind: str, budget: float | None
) -> None:
    """Side-stream copies with prefetch, activation offload (JointStack: inputs that are views of
    one tensor, as in Flux) and inductor-compiled blocks under diffusers-style checkpointing, or
    under a budget without checkpointing (the activations the compiled blocks save travel;
    TanhStack: blocks save their own output, which the model reads again in backward):
    LoRA gradients as a fully resident eager run's, every block call compiled (none eager for
    want of its weights), no recompiles after the first step."""
    from offload_stand_ins import stack_inputs, step

    from compile_accel import BlockOffloadConductor
    from compile_accel.offload import activations

    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    model, reference = _cuda_stack(kind=kind)
    if budget is not None:
        model.checkpointing = None
    holder = nn.Module()
    holder.blocks = model.blocks
    config = CompileConfig(mode="blocks", activation_memory_budget=budget)
    acceleration = compile_accel.apply(holder, config, blocks=["blocks"])
    conductor = BlockOffloadConductor(offload_fraction=0.67, activation_offload=True).attach(model.blocks)
    assert all(b.host.is_pinned() for b in conductor.blocks if b.streamed)
    step(model, tuple(t.cuda() for t in stack_inputs()))
    graphs = acceleration.stats()["unique_graphs"]
    _assert_steps_match(model, reference, steps=3, rtol=1e-4)
    stats = acceleration.stats()
    assert stats["unique_graphs"] == graphs and stats["recompiles"] == 0
    assert stats["eager_nonresident_calls"] == 0
    assert conductor.counters["prefetched_loads"] > 0 and conductor.counters["activation_bytes_offloaded"] > 0


def test_int8_kernel_equals_the_torch_arithmetic() -> None:
    """One launch per output dtype and kind of row dequantizes every matrix in a staging buffer into
    its place in an output buffer, computing q * scale in fp32 and rounding once, as torch.mul does
    on the CPU; no other byte changes."""
    from compile_accel.int8 import Int8Matrices, Int8Matrix, dequantize_int8_, quantize_int8

    shapes = [
        ((300, 7, 5), torch.bfloat16),
        ((9, 4100), torch.float16),
        ((3, 16), torch.bfloat16),
        ((70,), torch.float32),
        ((40, 48), torch.float16),
        ((130, 2, 8), torch.bfloat16),
    ]
    staging, out = torch.zeros(1 << 18, dtype=torch.uint8), torch.full((1 << 18,), 7, dtype=torch.uint8)
    matrices, expected, q_at, out_at = [], [], 16, 32
    for shape, dtype in shapes:
        weight = torch.randn(shape) * torch.logspace(-3, 1, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
        q, scale = quantize_int8(weight)
        scale_at = q_at + (q.numel() + 15) // 16 * 16
        staging[q_at : q_at + q.numel()].view(torch.int8).copy_(q.flatten())
        staging[scale_at : scale_at + 4 * scale.numel()].view(torch.float32).copy_(scale)
        matrices.append(Int8Matrix(q_at, scale_at, out_at, torch.Size(shape), dtype))
        expected.append(dequantize_int8_(torch.empty(shape, dtype=dtype), q, scale))
        q_at = scale_at + (4 * scale.numel() + 15) // 16 * 16
        out_at += (q.numel() * dtype.itemsize + 15) // 16 * 16 + 16
    plan = Int8Matrices(matrices, torch.device("cuda"))
    assert len(plan.launches) == 5  # per dtype, rows of whole 16-element runs or not
    result = out.cuda()
    plan(staging.cuda(), result)
    result = result.cpu()
    written = torch.zeros_like(result, dtype=torch.bool)
    for m, values in zip(matrices, expected, strict=True):
        end = m.out_offset + values.numel() * values.element_size()
        assert torch.equal(result[m.out_offset : end].view(m.dtype).view(m.shape), values)
        written[m.out_offset : end] = True
    assert (result[~written] == 7).all()


def test_int8_streaming_on_cuda_halves_bytes_with_small_error() -> None:
    from offload_stand_ins import stack_inputs

    from compile_accel import BlockOffloadConductor

    model, reference = _cuda_stack()
    model, reference = model.to(torch.bfloat16), reference.to(torch.bfloat16)
    conductor = BlockOffloadConductor(offload_fraction=1.0, offload_dtype="int8").attach(model.blocks)
    bf16_bytes = sum(p.numel() * 2 for b in reference.blocks for p in b.parameters() if not p.requires_grad)
    assert conductor.stats()["host_bytes"] < 0.6 * bf16_bytes
    x, cond = (t.cuda().to(torch.bfloat16) for t in stack_inputs())
    with torch.no_grad():
        error = relative_error(model(x, cond).float(), reference(x, cond).float())
    assert 0 < error < 2e-2


def test_int8_streamed_training_equals_a_run_on_the_dequantized_weights(monkeypatch) -> None:
    """int8 streaming with prefetch in both directions, activation offload and backward: the
    LoRA gradients of a resident eager run whose streamed blocks' frozen matrices went through the
    same int8 round trip (computed by torch ops here); remove() hands back exactly those weights."""
    from test_offload import int8_round_trip_

    from compile_accel import BlockOffloadConductor
    from compile_accel.offload import activations

    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    model, reference = _cuda_stack()
    conductor = BlockOffloadConductor(offload_fraction=0.67, activation_offload=True, offload_dtype="int8")
    conductor.attach(model.blocks)
    for block, twin in zip(conductor.blocks, reference.blocks, strict=True):
        if block.streamed:  # resident blocks keep their weights
            int8_round_trip_(twin)
    _assert_steps_match(model, reference, steps=2, rtol=1e-5)
    assert conductor.counters["prefetched_loads"] > 0 and conductor.counters["activation_bytes_offloaded"] > 0
    conductor.remove()
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), reference.parameters(), strict=True))


def test_int8_streamed_weights_feed_int8_base_compute_on_cuda(monkeypatch) -> None:
    """tests/test_offload.py's check on CUDA: inductor, the Triton int8 kernel, side-stream copies
    two blocks ahead and activation offload; the stand-in's small matmuls let into 8 bits."""
    from test_offload import check_int8_streamed_weights_feed_int8_compute

    from compile_accel import base_compute
    from compile_accel.offload import activations

    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    monkeypatch.setattr(base_compute, "CUDA_MIN_ROWS", 0)
    monkeypatch.setattr(base_compute, "CUDA_MIN_WIDTH", 0)
    check_int8_streamed_weights_feed_int8_compute("cuda", "inductor", activation_offload=True)


class _Swapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(128, 512), nn.Linear(512, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _exchange(on_gpu: nn.Module, on_host: nn.Module) -> None:
    """sd-scripts' ModelOffloader swap: the host block's weights are copied into the GPU block's
    storage, which the host block takes over; the GPU block's weights go to host memory."""
    for gpu_linear, host_linear in ((on_gpu.fc1, on_host.fc1), (on_gpu.fc2, on_host.fc2)):
        storage = gpu_linear.weight.data
        gpu_linear.weight.data = storage.to("cpu", copy=True)
        host_linear.weight.data = storage.copy_(host_linear.weight.data)


def test_block_swap_by_weight_exchange_stays_compiled_and_correct() -> None:
    """Weight `.data` exchanged between a GPU block and a host block between calls (biases stay
    on the GPU, as in sd-scripts): every call of a resident block runs compiled, with the
    eager result, and no swap recompiles."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Swapped() for _ in range(4)).cuda()
    for block in blocks[2:]:
        block.fc1.weight.data, block.fc2.weight.data = block.fc1.weight.data.cpu(), block.fc2.weight.data.cpu()
    eager = nn.ModuleList(_Swapped() for _ in range(4)).cuda()
    eager.load_state_dict({k: v.cuda() for k, v in blocks.state_dict().items()})
    holder = nn.Module()
    holder.blocks = blocks
    acceleration = compile_accel.apply(holder, CompileConfig(mode="blocks"), blocks=["blocks"])
    x = torch.randn(8, 128, device="cuda")
    for _ in range(3):
        out, expected = x, x
        for i in range(4):
            out, expected = blocks[i](out), eager[i](expected)
            if i < 2:
                _exchange(blocks[i], blocks[i + 2])  # block i done: bring block i + 2 in
        for i in range(2):
            _exchange(blocks[i + 2], blocks[i])  # and back, for the next step
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    stats = acceleration.stats()
    assert stats["eager_nonresident_calls"] == 0 and stats["unique_graphs"] == 1 and stats["recompiles"] == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_device_split_of_compiled_blocks_matches_one_device() -> None:
    """Double and single blocks split across two GPUs (the split inside the single blocks):
    LoRA gradients as on one device, one graph per block class per device, no recompiles."""
    from compile_accel.placement import split_blocks

    model, params, inputs = _on_cuda()
    reference_loss, reference = _cuda_step(model, params, inputs, autocast=False)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=0.5))
    placement = split_blocks(model, ["cuda:0", "cuda:1"], split=[3])
    assert placement.block_devices["single_blocks.0"] == torch.device("cuda", 0)
    assert placement.block_devices["single_blocks.1"] == torch.device("cuda", 1)
    for _ in range(2):
        loss, grads = _cuda_step(model, params, inputs, autocast=False)
        assert relative_error(loss, reference_loss) < 1e-4
        assert all(relative_error(g.to("cuda:0"), r) < 1e-3 for g, r in zip(grads, reference, strict=True))
    stats = acceleration.stats()
    assert stats["unique_graphs"] == 3 and stats["recompiles"] == 0  # double@0, single@0, single@1
