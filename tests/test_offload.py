"""BlockOffloadConductor on the CPU (device="cpu": the same bookkeeping with plain copies):
LoRA gradients equal to a resident run under every checkpointing style, residency and order,
eviction after an early-stopped recompute, int8 streaming, composition with compiled blocks,
and bad input that changes nothing. Activation offload: tests/test_activation_offload.py."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import an_empty_inductor_cache, build, inputs_for, lora_step, relative_error

import compile_accel
from compile_accel import CompileConfig, base_compute_rewrite, compile_workers, offload, precompile
from compile_accel.compile_cache import RunCompileCache
from compile_accel.dynamo_settings import HAS_CACHE_ARTIFACTS
from compile_accel.int8 import Int8Matrices, Int8Matrix, dequantize_int8_, quantize_int8
from compile_accel.int8_weight import Int8Weight
from compile_accel.offload import BlockOffloadConductor, layout
from offload_stand_ins import (
    DIM,
    JointStack,
    Stack,
    assert_compiled_step_matches,
    copy_of,
    stack_inputs,
    step,
    trainable,
)


def int8_round_trip_(module: nn.Module) -> None:
    """Give the module's frozen matrices the values the conductor streams in int8 mode."""
    for p in module.parameters():
        if not p.requires_grad and p.dim() >= 2:
            p.data = dequantize_int8_(torch.empty_like(p), *quantize_int8(p.data))


class Residency:
    """Records, at every block call, whether the block's weights are in place and how many
    streamed blocks the conductor holds in its slots."""

    def __init__(self, conductor: BlockOffloadConductor, blocks: nn.ModuleList) -> None:
        self.conductor = conductor
        self.calls: list[int] = []
        self.finished: list[int] = []
        self.held: list[int] = []
        self.misplaced: list[int] = []
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._before(index))  # runs after the conductor's hook
            block.register_forward_hook(lambda module, args, out, index=index: self.finished.append(index))

    def _before(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self.calls.append(index)
            held = self.conductor.resident_streamed_blocks()
            self.held.append(len(held))
            if self.conductor.blocks[index].streamed and index not in held:
                self.misplaced.append(index)

        return hook


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant", None])
def test_lora_grads_equal_a_resident_run(checkpointing: str | None) -> None:
    """Streamed weights are exact copies, so every step gives the resident run's gradients
    bit for bit; without checkpointing too (weights saved for backward are reloaded first)."""
    reference = Stack(checkpointing=checkpointing)
    model = copy_of(reference)
    conductor = BlockOffloadConductor(offload_fraction=0.67, device="cpu").attach(model.blocks)
    assert conductor.stats()["streamed_blocks"] == 4
    for _ in range(2):
        inputs = stack_inputs()
        loss, grads = step(model, inputs)
        expected_loss, expected = step(reference, inputs)
        assert torch.equal(loss, expected_loss)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


def test_order_prefetch_and_early_stopped_recompute() -> None:
    """Forward ascends and backward descends; after the first step every load was predicted and
    started a block ahead; at most two streamed blocks are ever held; a non-reentrant recompute
    that stops early (so the block's forward never finishes) leaves nothing stale."""
    model = Stack(n=8, checkpointing="non-reentrant")
    conductor = BlockOffloadConductor(offload_fraction=0.75, device="cpu").attach(model.blocks)
    residency = Residency(conductor, model.blocks)
    step(model, stack_inputs())
    first = dict(conductor.counters)
    residency.calls.clear(), residency.finished.clear()
    step(model, stack_inputs())
    assert residency.calls == [*range(8), *reversed(range(8))]
    assert len(residency.finished) < len(residency.calls)  # the recompute stopped early
    assert residency.misplaced == []
    assert max(residency.held) <= offload.SLOTS
    loads = conductor.counters["loads"] - first["loads"]
    assert loads > 0 and conductor.counters["prefetched_loads"] - first["prefetched_loads"] == loads


def test_resident_blocks_are_the_smallest_spread_out_and_prefetch_two_ahead() -> None:
    """The blocks that stay are the smallest ones, spread over the execution order; streamed
    blocks alternate slots, and from a resident block the next two streamed ones are copied
    (the resident block's compute overlaps copies)."""
    blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)] + [nn.Linear(8, 8) for _ in range(6)])
    blocks.requires_grad_(False)
    conductor = BlockOffloadConductor(offload_fraction=6 / 9, device="cpu").attach(blocks)
    assert [b.index for b in conductor.blocks if not b.streamed] == [4, 6, 8]
    assert [b.slot for b in conductor.blocks if b.streamed] == [0, 1, 0, 1, 0, 1]
    held_at = {}

    def record(index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            held_at[index] = sorted(conductor.resident_streamed_blocks())

        return hook

    for index in (4, 6):
        blocks[index].register_forward_pre_hook(record(index))
    x = torch.randn(2, 64)
    for block in blocks:
        x = block(x) if block.in_features == x.shape[-1] else block(x[:, :8])
    assert held_at == {4: [5, 7], 6: [5, 7]}  # at block 4: blocks 5 and 7 on their way


def test_int8_copies_two_blocks_ahead_and_keeps_the_running_one() -> None:
    """int8: from a streamed block the next two are copied into the staging buffers while the slots
    still hold the running block; each is dequantized into its slot when its turn comes."""
    blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6)).requires_grad_(False)
    expected = [dequantize_int8_(torch.empty(16, 16), *quantize_int8(b.weight)) for b in blocks]
    conductor = BlockOffloadConductor(offload_fraction=1.0, device="cpu", offload_dtype="int8").attach(blocks)
    seen = {}

    def record(index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            staged = sorted(b.index for b in conductor._slots.staged if b is not None)
            seen[index] = (
                staged,
                index in conductor.resident_streamed_blocks(),
                torch.equal(module.weight, expected[index]),
            )

        return hook

    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(record(index))
    with torch.no_grad():
        x = torch.randn(2, 16)
        for block in blocks:
            x = block(x)
    assert [seen[i] for i in range(4)] == [([i + 1, i + 2], True, True) for i in range(4)]


def test_int8_mispredicted_copies_are_replaced_and_results_stay_exact() -> None:
    """A pass without backward in training mode makes the conductor expect backward next; the
    next forward starts over instead, so staged copies get replaced. Loss and LoRA gradients stay
    those of the same blocks holding the int8 round trip of their weights."""
    reference = Stack(n=6)
    model = copy_of(reference)
    conductor = BlockOffloadConductor(offload_fraction=1.0, device="cpu", offload_dtype="int8").attach(model.blocks)
    int8_round_trip_(reference.blocks)  # every block streams: every frozen matrix is int8
    x, cond = stack_inputs()
    with torch.no_grad():
        model(x, cond)
    assert {b.index for b in conductor._slots.staged if b is not None} - {0, 1}  # staged for a backward
    loss, grads = step(model, (x, cond))
    expected_loss, expected = step(reference, (x, cond))
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    assert all(torch.allclose(g, e, rtol=1e-6, atol=0) for g, e in zip(grads, expected, strict=True))


@pytest.mark.parametrize("mode", ["blocks", "selective"])
def test_inner_checkpoint_and_compiled_blocks_stream_without_recompiles(mode: str) -> None:
    """The trainer-style checkpoint inside each block's forward, traced in the compiled graphs
    (whole blocks, or the bodies in selective mode): swapping weights through the slots compiles
    nothing new after the first step, the regions run compiled, and the gradients match the
    uncompiled, resident model (the backward's recompute runs in the graphs, on streamed weights)."""
    reference, ref_params = build("kohya", "non-reentrant", double_blocks=3, single_blocks=3)
    model, params = build("kohya", "non-reentrant", double_blocks=3, single_blocks=3)
    model.load_state_dict(reference.state_dict())
    for p, q in zip(params, ref_params, strict=True):
        p.data.copy_(q.data)
    acceleration = compile_accel.apply(model, CompileConfig(mode=mode, backend="aot_eager"))
    conductor = BlockOffloadConductor(offload_fraction=0.67, device="cpu")
    conductor.attach([model.double_blocks, model.single_blocks])
    inputs = inputs_for(model)
    lora_step(model, params, inputs)
    graphs = acceleration.stats()["unique_graphs"]
    for _ in range(2):
        inputs = inputs_for(model)
        loss, grads = lora_step(model, params, inputs)
        expected_loss, expected = lora_step(reference, ref_params, inputs)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    stats = acceleration.stats()
    assert stats["unique_graphs"] == graphs
    assert stats["recompiles"] == 0
    assert stats["fallbacks"] == []


def test_int8_round_trip_error_is_within_half_a_step() -> None:
    weight = torch.randn(64, 48) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scale
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    restored = dequantize_int8_(torch.empty_like(weight), q, scale)
    assert ((restored - weight).abs() <= scale[:, None] / 2 + 1e-7).all()
    vector = torch.randn(40)  # one row per element
    q, scale = quantize_int8(vector)
    assert torch.allclose(dequantize_int8_(torch.empty_like(vector), q, scale), vector, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "out, q, scale",
    [
        (torch.zeros(8, 6), torch.ones(8, 6, dtype=torch.int8), torch.ones(6)),  # a scale per column
        (torch.zeros(8, 6), torch.ones(8, 6), torch.ones(8)),  # q not int8
        (torch.zeros(8, 6, dtype=torch.int32), torch.ones(8, 6, dtype=torch.int8), torch.ones(8)),
        (torch.zeros(6, 8).t(), torch.ones(8, 6, dtype=torch.int8), torch.ones(8)),  # out not contiguous
        (torch.zeros(()), torch.ones((), dtype=torch.int8), torch.ones(())),
    ],
)
def test_int8_dequantize_rejects_bad_tensors_and_writes_nothing(out, q, scale) -> None:
    before = out.clone()
    with pytest.raises(ValueError, match="dequantize_int8_ needs"):
        dequantize_int8_(out, q, scale)
    assert torch.equal(out, before)


@pytest.mark.parametrize(
    "matrix, error",
    [
        (Int8Matrix(24, 64, 16, torch.Size([4, 4]), torch.bfloat16), "multiples of 16"),
        (Int8Matrix(2**31 - 16, 16, 32, torch.Size([4, 4]), torch.bfloat16), "2\\*\\*31"),
    ],
)
def test_int8_matrices_reject_offsets_the_kernel_cannot_address(matrix: Int8Matrix, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Int8Matrices([matrix], torch.device("cuda"))  # checked before anything is allocated


def test_int8_streaming_halves_bytes_and_keeps_lora_exact() -> None:
    reference = Stack(n=4).to(torch.bfloat16)
    model = copy_of(reference).to(torch.bfloat16)
    lora = [p.detach().clone() for p in trainable(model)]
    plain = BlockOffloadConductor(offload_fraction=1.0, device="cpu").attach(
        copy_of(reference).to(torch.bfloat16).blocks
    )
    int8 = BlockOffloadConductor(offload_fraction=1.0, device="cpu", offload_dtype="int8").attach(model.blocks)
    assert int8.stats()["host_bytes"] < 0.6 * plain.stats()["host_bytes"]
    x, cond = (t.to(torch.bfloat16) for t in stack_inputs())
    with torch.no_grad():
        out, expected = model(x, cond), reference(x, cond)
    assert 0 < ((out - expected).float().norm() / expected.float().norm()).item() < 2e-2
    assert all(torch.equal(p, q) and p.dtype == torch.bfloat16 for p, q in zip(trainable(model), lora, strict=True))


def test_remove_gives_standalone_weights_back() -> None:
    model = Stack(n=4)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu").attach(model.blocks)
    step(model, stack_inputs())
    conductor.remove()
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())
    pointers = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(pointers) == len(list(model.parameters()))  # no longer views of shared slots
    assert not any(block._forward_pre_hooks or block._forward_hooks for block in model.blocks)
    BlockOffloadConductor(offload_fraction=0.5, device="cpu").attach(model.blocks)  # attachable again


@pytest.mark.parametrize("offload_dtype", [None, "int8"])
def test_weights_on_device_loads_a_streamed_block_between_its_calls(offload_dtype: str | None) -> None:
    """Between its calls a streamed block's weights point at their host copy; weights_on_device
    (a trace of the block outside the steps: precompile's capture) loads it into its slot, with
    its values, as its next call would. A module no conductor holds is left as it is."""
    model = Stack(n=6)
    if offload_dtype == "int8":
        for block in model.blocks:
            int8_round_trip_(block)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", offload_dtype=offload_dtype)
    conductor.attach(model.blocks)
    step(model, stack_inputs())
    away = [b.index for b in conductor.blocks if b.streamed and b.index not in conductor.resident_streamed_blocks()]
    assert away  # (two slots, three streamed blocks)
    index = away[0]
    linear = next(m for m in model.blocks[index].modules() if isinstance(m, nn.Linear))
    offload.conductor.weights_on_device(linear)  # a module inside the block
    assert index in conductor.resident_streamed_blocks()
    slots = {buffer.untyped_storage().data_ptr() for buffer in conductor._slots.buffers}
    assert linear.weight.untyped_storage().data_ptr() in slots
    prefix = f"blocks.{index}."
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items() if k.startswith(prefix))
    lone = nn.Linear(2, 2)
    before = _snapshot(lone)
    offload.conductor.weights_on_device(lone)
    assert _snapshot(lone) == before


def _snapshot(model: nn.Module) -> list[tuple[int, torch.device]]:
    return [(p.untyped_storage().data_ptr(), p.device) for p in model.parameters()]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"offload_fraction": -0.1}, "offload_fraction"),
        ({"offload_fraction": 1.5}, "offload_fraction"),
        ({"offload_fraction": True}, "offload_fraction"),
        ({"offload_fraction": "0.5"}, "offload_fraction"),
        ({"offload_dtype": "fp8"}, "offload_dtype"),
        ({"device": "meta"}, "device"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        BlockOffloadConductor(**{"device": "cpu", **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_absent_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        BlockOffloadConductor()


def test_bad_blocks_change_nothing() -> None:
    model = Stack(n=4)
    model.blocks[1].fc1 = nn.Linear(DIM, 4 * DIM, device="meta")  # a half-moved model
    before = [(p.device, p.shape) for p in model.parameters()]
    with pytest.raises(ValueError, match="all be on cpu"):
        BlockOffloadConductor(device="cpu").attach(model.blocks)
    assert [(p.device, p.shape) for p in model.parameters()] == before
    assert not any(block._forward_pre_hooks for block in model.blocks)

    model = Stack(n=4)
    conductor = BlockOffloadConductor(device="cpu").attach(model.blocks)
    with pytest.raises(RuntimeError, match="already attached"):
        BlockOffloadConductor(device="cpu").attach(model.blocks)
    with pytest.raises(RuntimeError, match="already attached"):
        conductor.attach(Stack(n=2).blocks)
    with pytest.raises(ValueError, match="same block twice"):
        BlockOffloadConductor(device="cpu").attach([Stack(n=1).blocks[0]] * 2)
    # Parts of attached blocks, or modules around them, belong to the first conductor.
    with pytest.raises(RuntimeError, match="already attached to another"):
        BlockOffloadConductor(device="cpu").attach([block.fc1 for block in model.blocks])
    with pytest.raises(RuntimeError, match="already attached to another"):
        BlockOffloadConductor(device="cpu").attach([nn.Sequential(*model.blocks[:2]), model.blocks[2]])
    with pytest.raises(ValueError, match="got no blocks"):
        BlockOffloadConductor(device="cpu").attach(nn.ModuleList())
    for index in (-1, 4, True):
        with pytest.raises(IndexError, match=r"block index must be an int in \[0, 4\)"):
            conductor.before_block(index)
    with pytest.raises(RuntimeError, match="not attached"):
        BlockOffloadConductor(device="cpu").before_block(0)

    model = Stack(n=2)
    model.blocks[1].register_buffer("table", torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="all be on cpu"):
        BlockOffloadConductor(device="cpu").attach(model.blocks)


def test_allocation_failure_leaves_the_model_as_it_was(monkeypatch) -> None:
    model = Stack(n=4)
    before = _snapshot(model)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu")
    real_empty, calls = torch.empty, []

    def failing_empty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(RuntimeError, match="out of memory"):
        conductor.attach(model.blocks)
    monkeypatch.undo()
    assert _snapshot(model) == before
    assert not any(block._forward_pre_hooks for block in model.blocks)
    conductor.attach(model.blocks)  # the same conductor works once memory is there


def test_pinning_failure_falls_back_to_pageable_with_a_warning(monkeypatch) -> None:
    conductor = BlockOffloadConductor(offload_fraction=1.0, device="cpu")
    conductor.pin_memory = True  # as on a CUDA machine
    real_empty = torch.empty

    def no_pinning(*args, pin_memory: bool = False, **kwargs):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc failed")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinning)
    model = Stack(n=2)
    with pytest.warns(RuntimeWarning, match="pageable"):
        conductor.attach(model.blocks)
    assert conductor.stats()["pinned"] is False
    assert all(not b.host.is_pinned() for b in conductor.blocks if b.streamed)


@pytest.mark.parametrize("offload_dtype", [None, "int8"])
def test_remove_after_every_slot_was_reused(offload_dtype: str | None) -> None:
    """All blocks streamed, so remove() loads each into a slot another restored block used."""
    model = Stack(n=4)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    conductor = BlockOffloadConductor(offload_fraction=1.0, device="cpu", offload_dtype=offload_dtype)
    conductor.attach(model.blocks)
    step(model, stack_inputs())
    hosts = {b.host.untyped_storage().data_ptr() for b in conductor.blocks}
    conductor.remove()
    for key, value in model.state_dict().items():
        if offload_dtype is None or value.dim() < 2:
            assert torch.equal(value, original[key]), key
        else:  # int8: within half a quantisation step of each row
            step_size = original[key].abs().amax(dim=1, keepdim=True) / 127
            assert ((value - original[key]).abs() <= step_size / 2 + 1e-6).all(), key
    assert not {p.untyped_storage().data_ptr() for p in model.parameters()} & hosts


def test_trainer_driven_visits_without_hooks() -> None:
    """attach(hooks=False): the trainer calls before_block/after_block around each block and
    remove() at the end."""
    reference = Stack(n=4, checkpointing=None)
    model = copy_of(reference)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    conductor = BlockOffloadConductor(offload_fraction=0.75, device="cpu").attach(model.blocks, hooks=False)
    before, after, remove = conductor.before_block, conductor.after_block, conductor.remove
    assert not any(block._forward_pre_hooks for block in model.blocks)
    x, cond = stack_inputs()
    h = x.detach().requires_grad_(True)
    for index, block in enumerate(model.blocks):
        before(index, (h, cond))
        h = block(h, cond)
        after(index, (h,))
    h.square().mean().backward()
    grads = [p.grad for p in trainable(model)]
    _, expected = step(reference, (x, cond))
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    remove()
    assert conductor.stats()["blocks"] == 0
    assert all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("bare", [True, False], ids=["bare-tensors", "tuples"])
def test_trainer_driven_visits_take_bare_tensors_and_warn_without_after_block(bare: bool) -> None:
    reference = Stack(n=4, checkpointing=None)
    model = copy_of(reference)
    conductor = BlockOffloadConductor(offload_fraction=0.75, device="cpu").attach(model.blocks, hooks=False)
    x, cond = stack_inputs()
    h = x.detach().requires_grad_(True)
    for index, block in enumerate(model.blocks):
        conductor.before_block(index, h if bare else (h, cond))
        h = block(h, cond)
        conductor.after_block(index, h if bare else (h,))
    h.square().mean().backward()
    _, expected = step(reference, (x, cond))
    assert all(torch.equal(p.grad, e) for p, e in zip(trainable(model), expected, strict=True))

    conductor.before_block(0, h)
    with pytest.warns(RuntimeWarning, match="block 0's forward got no after_block"):
        conductor.before_block(1, h)


def test_backward_of_a_forward_from_before_remove_is_refused() -> None:
    model = Stack(n=4, checkpointing=None)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu").attach(model.blocks)
    loss = model(*stack_inputs()).square().mean()
    conductor.remove()
    conductor.attach(model.blocks)
    with pytest.raises(RuntimeError, match="forward run before this BlockOffloadConductor's remove"):
        loss.backward()


def test_remove_gives_frozen_weights_back_in_their_layout() -> None:
    model = Stack(n=2)
    for block in model.blocks:
        block.fc1.weight.data = block.fc1.weight.data.t().contiguous().t()  # column-major
    before = [(p.stride(), p.clone()) for p in model.parameters()]
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu").attach(model.blocks)
    conductor.remove()
    assert model.blocks[0].fc1.weight.stride() == (1, 4 * DIM)
    assert all(p.stride() == s and torch.equal(p, v) for p, (s, v) in zip(model.parameters(), before, strict=True))


def test_budgeted_compiled_blocks_stream_without_checkpointing() -> None:
    """No checkpoint at all: the weights autograd saved are reloaded into their slot before
    each block's backward; compiled with a budget, no recompiles after the first step."""
    reference = Stack(n=6, checkpointing=None)
    model = copy_of(reference)
    acceleration = compile_accel.apply(
        model, CompileConfig(mode="blocks", activation_memory_budget=0.5, backend="aot_eager")
    )
    BlockOffloadConductor(offload_fraction=0.67, device="cpu").attach(model.blocks)
    step(model, stack_inputs())
    for _ in range(2):
        inputs = stack_inputs()
        assert_compiled_step_matches(model, reference, inputs)
    assert acceleration.stats()["recompiles"] == 0 and acceleration.stats()["unique_graphs"] == 1


@pytest.mark.parametrize("offload_dtype", [None, "int8"])
def test_streamed_blocks_with_int8_base_compute_train_as_resident_ones(offload_dtype: str | None) -> None:
    """Compiled blocks with their base matmuls in int8 while the conductor streams half of them
    (as they are, or stored in int8 and dequantized into the slots): every step as the same
    blocks resident with int8 compute (on the int8-rounded weights where streamed in int8), every
    base Linear in 8 bits, no eager call of a non-resident block, no recompile."""
    resident = Stack(n=6)
    model = copy_of(resident)
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend="aot_eager", base_compute="int8")
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", offload_dtype=offload_dtype)
    conductor.attach(model.blocks)
    streamed = [block.index for block in conductor.blocks if block.streamed]
    assert len(streamed) == 3
    if offload_dtype == "int8":
        for index in streamed:  # the values their slots receive
            int8_round_trip_(resident.blocks[index])
    expected_run = compile_accel.apply(resident, config)
    acceleration = compile_accel.apply(model, config)
    step(model, stack_inputs())
    step(resident, stack_inputs())
    for _ in range(2):
        assert_compiled_step_matches(model, resident, stack_inputs())
    stats = acceleration.stats()
    assert stats["base_compute"]["in_8_bits"] == stats["base_compute"]["base_linears"] == 12
    assert stats["eager_nonresident_calls"] == 0 and stats["recompiles"] == 0
    assert expected_run.stats()["base_compute"]["in_8_bits"] == 12


@pytest.mark.parametrize("activation_offload", [False, True])
def test_int8_streamed_weights_feed_int8_base_compute_as_they_are(activation_offload: bool, monkeypatch) -> None:
    monkeypatch.setattr(offload.activations, "MIN_ACTIVATION_BYTES", 0)
    check_int8_streamed_weights_feed_int8_compute("cpu", "aot_eager", activation_offload)


def check_int8_streamed_weights_feed_int8_compute(device: str, backend: str, activation_offload: bool) -> None:
    """Blocks compiled with base_compute="int8", then streamed in int8 (no checkpoint: the compiled
    blocks save their weights for backward): each streamed block's base Linears get an Int8Weight
    over the slot's int8 values and row scales, which int8_linear multiplies as they are. The slots
    hold int8 for them; the loss is that of the same blocks resident with int8 compute on the
    int8-rounded weights within 1e-4 (the forward multiplies the same int8 values), the LoRA
    gradients within a cosine of 0.9999 (the input gradient folds the row scales into the output
    gradient instead of quantizing the weight per input channel); streamed and resident blocks run
    a graph each, none compiled again; remove() puts the original parameters back, holding the
    int8 round trip. With activation offload, what the blocks save moves but for the int8 weights
    (in the slots). Also run on CUDA (tests/test_gpu.py)."""
    resident = Stack(n=6, checkpointing=None).to(device)
    model = copy_of(resident).to(device)
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend=backend, base_compute="int8")
    dequantizing = BlockOffloadConductor(offload_fraction=0.5, device=device, offload_dtype="int8")
    dequantized_slot_bytes = dequantizing.attach(copy_of(resident).to(device).blocks).stats()["slot_bytes"]
    originals = [[block.fc1.weight, block.fc2.weight] for block in model.blocks]
    keys = list(model.state_dict())
    acceleration = compile_accel.apply(model, config)
    conductor = BlockOffloadConductor(
        offload_fraction=0.5, device=device, offload_dtype="int8", activation_offload=activation_offload
    ).attach(model.blocks)
    streamed = [block.index for block in conductor.blocks if block.streamed]
    held = [isinstance(block.fc1.weight, Int8Weight) and isinstance(block.fc2.weight, Int8Weight) for block in model.blocks]
    assert held == [index in streamed for index in range(6)] and len(streamed) == 3
    assert list(model.state_dict()) == keys
    # fp32 weights as one byte each and a scale per row in the slots (and their staging buffers,
    # as before): under half the bytes that dequantized slots take
    assert conductor.stats()["slot_bytes"] < dequantized_slot_bytes / 2
    expected_run = _trains_as_resident_int8(model, acceleration, resident, streamed, config, device)
    assert expected_run.stats()["unique_graphs"] == 1
    assert acceleration.stats()["base_compute"]["matmuls_in_8_bits"] == 24
    if activation_offload:
        assert conductor.stats()["activation_bytes_offloaded"] > 0
    conductor.remove()
    for block, expected, weights in zip(model.blocks, resident.blocks, originals, strict=True):
        assert block.fc1.weight is weights[0] and block.fc2.weight is weights[1]
        assert torch.equal(block.fc1.weight, expected.fc1.weight) and torch.equal(block.fc2.weight, expected.fc2.weight)


def _trains_as_resident_int8(
    model: nn.Module,
    acceleration: compile_accel.Acceleration,
    resident: nn.Module,
    streamed: list[int],
    config: CompileConfig,
    device: str,
    graphs: int = 2,
    after_first_step: Callable[[], None] = lambda: None,
) -> compile_accel.Acceleration:
    """Three steps of `model` (its blocks `streamed` in int8, their int8 weights multiplied as they
    are) as `resident` with int8 compute on the int8-rounded weights: the loss within 1e-4, LoRA
    gradients' cosine above 0.9999; the streamed and the resident blocks run a graph each, none
    compiled again (`graphs` compiled in all: none where they ran precompiled), nothing eager. The
    resident run's acceleration."""
    for index in streamed:
        int8_round_trip_(resident.blocks[index])
    expected_run = compile_accel.apply(resident, config)
    for index in range(3):
        inputs = tuple(t.to(device) for t in stack_inputs())
        loss, grads = step(model, inputs)
        expected_loss, expected_grads = step(resident, inputs)
        assert torch.allclose(loss, expected_loss, rtol=1e-4, atol=0)
        for grad, expected in zip(grads, expected_grads, strict=True):
            assert torch.cosine_similarity(grad.flatten(), expected.flatten(), dim=0) > 0.9999
        if index == 0:
            after_first_step()
    stats = acceleration.stats()
    assert stats["unique_graphs"] == graphs and stats["recompiles"] == 0 and not stats["fallbacks"]
    assert stats["eager_nonresident_calls"] == 0
    return expected_run


@pytest.mark.skipif(
    not (precompile.SUPPORTED and HAS_CACHE_ARTIFACTS and compile_workers.SUPPORTED),
    reason="needs torch's aot_compile, cache artifacts and compile workers",
)
def test_held_weights_graphs_compile_in_the_workers_and_run_precompiled_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graphs of streamed blocks whose weights are held in int8 (Int8Weight inputs) go to the
    compile workers as the resident blocks' graph does, and are precompiled: a new start runs both
    without compiling any. Each start trains as the same blocks resident with int8 compute."""
    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path / "runs"))
    an_empty_inductor_cache(tmp_path / "inductor", monkeypatch)
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, base_compute="int8", compile_workers=2)
    reference = dataclasses.replace(config, compile_workers=0)

    def start() -> tuple[nn.Module, nn.Module, compile_accel.Acceleration, RunCompileCache, list[int]]:
        torch._dynamo.reset()
        resident = Stack(n=6, checkpointing=None)
        model = copy_of(resident)
        acceleration = compile_accel.apply(model, config)
        conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", offload_dtype="int8").attach(model.blocks)
        cache = RunCompileCache(model, acceleration.signature, acceleration)
        return model, resident, acceleration, cache, [block.index for block in conductor.blocks if block.streamed]

    brought_in: list[nn.Module] = []
    bring_in = BlockOffloadConductor.bring_in

    def noted_bring_in(conductor: BlockOffloadConductor, module: nn.Module) -> None:
        brought_in.append(module)
        bring_in(conductor, module)

    monkeypatch.setattr(BlockOffloadConductor, "bring_in", noted_bring_in)
    model, resident, acceleration, cache, streamed = start()
    with warnings.catch_warnings(record=True) as caught:  # (one would say a graph compiled here, or its first run failed)
        warnings.simplefilter("always")
        # (the steps after the first run what the workers compiled, each run once on stand-ins first)
        _trains_as_resident_int8(
            model, acceleration, resident, streamed, reference, "cpu", after_first_step=compile_workers.wait_and_load
        )
    assert not [w.message for w in caught if "compile_accel:" in str(w.message)]
    stats = acceleration.stats()
    assert stats["worker_graphs_compiled"] == stats["worker_graphs_started"] == 2 and not stats["worker_failures"]
    cache.save()
    assert cache.precompiling.join(timeout=600) == 2
    # Each graph traced again on a block whose weights were where its calls find them (on a GPU a
    # streamed one's point at their host copy between calls: the trace failed on a device mismatch).
    # One call noted per graph: a resident block's and a streamed one's.
    assert sorted(list(model.blocks).index(m) in streamed for m in brought_in) == [False, True]

    model, resident, acceleration, cache, streamed = start()
    _trains_as_resident_int8(model, acceleration, resident, streamed, reference, "cpu", graphs=0)
    assert cache.precompiled_loaded == 2 and sum(f.precompiled.used for f in acceleration.functions) == 2


def test_int8_streamed_weights_of_blocks_returning_views_of_one_tensor() -> None:
    """Blocks returning two views of one tensor (as Flux's single-stream blocks), which AOTAutograd
    does not compile with a tensor subclass input: the second is made a copy of its own in the
    graph of the streamed blocks, which then train as `_trains_as_resident_int8` says."""
    resident, model = JointStack(n=6), JointStack(n=6)
    model.load_state_dict(resident.state_dict())
    config = CompileConfig(mode="blocks", backend="aot_eager", base_compute="int8")
    acceleration = compile_accel.apply(model, config)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", offload_dtype="int8").attach(model.blocks)
    streamed = [block.index for block in conductor.blocks if block.streamed]
    assert all(isinstance(model.blocks[index].fc1.weight, Int8Weight) for index in streamed)
    _trains_as_resident_int8(model, acceleration, resident, streamed, config, "cpu")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_held_weight_whose_products_stay_in_its_dtype_keeps_no_dense_copy_for_backward(
    backend: str, monkeypatch
) -> None:
    """Where both products of a held layer stay in its dtype (on CUDA: a call of too few input
    rows), the call still goes through int8_linear, whose backward multiplies the int8 values with
    the row scales folded into dY: nothing the step saves for backward is a dequantized copy of a
    base weight, and the LoRA gradients are those of the same blocks run eager on the int8-rounded
    weights (1e-5). (inductor: the forward's dequantize and the backward's conversion of the
    int8 values share no node, which its partitioner would keep from the forward.)"""
    monkeypatch.setattr(base_compute_rewrite, "why_not_8_bits", lambda *args: ("stays (test)",) * 2)
    resident = Stack(n=4, checkpointing=None)
    model = copy_of(resident)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", backend=backend, base_compute="int8"))
    BlockOffloadConductor(offload_fraction=1.0, device="cpu", offload_dtype="int8").attach(model.blocks)
    int8_round_trip_(resident)
    step(model, stack_inputs(batch=1))
    shapes = {tuple(block.fc1.weight.shape) for block in model.blocks} | {tuple(model.blocks[0].fc2.weight.shape)}
    dense = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tuple(tensor.shape) in shapes:  # (batch 1: no activation of those shapes)
            dense.append(tuple(tensor.shape))
        return tensor

    inputs = stack_inputs(batch=1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, grads = step(model, inputs)
    _, expected = step(resident, inputs)
    assert dense == [] and acceleration.stats()["base_compute"]["matmuls_in_8_bits"] == 0
    assert all(relative_error(g, e) < 1e-5 for g, e in zip(grads, expected, strict=True))


def test_a_module_tied_to_a_held_weights_original_is_refused_by_another_conductor() -> None:
    """The conductor owns the parameters attach() found, a held weight's original included (which
    stands aside in the conductor while an Int8Weight takes its place): a module outside the
    blocks tied to it cannot be attached to a second conductor."""
    model = Stack(n=2, checkpointing=None)
    compile_accel.apply(model, CompileConfig(mode="blocks", backend="aot_eager", base_compute="int8"))
    tied = nn.Linear(DIM, 4 * DIM).requires_grad_(False)
    tied.weight = model.blocks[0].fc1.weight
    BlockOffloadConductor(offload_fraction=1.0, device="cpu", offload_dtype="int8").attach(model.blocks)
    assert isinstance(model.blocks[0].fc1.weight, Int8Weight)
    with pytest.raises(RuntimeError, match="already attached to another BlockOffloadConductor"):
        BlockOffloadConductor(device="cpu").attach([tied])


def test_int8_weight_reads_as_its_matrix_and_refuses_changes() -> None:
    """An Int8Weight computes as its dequantized matrix (what the conductor's dequantize writes);
    detach keeps its values; an in-place op raises and changes nothing."""
    weight = torch.randn(8, 12)
    q, scale = quantize_int8(weight)
    held = nn.Parameter(Int8Weight(q, scale, torch.float32), requires_grad=False)
    matrix = dequantize_int8_(torch.empty_like(weight), q, scale)
    x = torch.randn(3, 12)
    assert torch.equal(nn.functional.linear(x, held), nn.functional.linear(x, matrix))
    assert isinstance(held.detach(), Int8Weight) and held.detach().q is q
    with pytest.raises(RuntimeError, match="remove"):
        held.mul_(2.0)
    assert torch.equal(held.q, quantize_int8(weight)[0]) and torch.equal(held.scale, scale)


def test_failure_while_moving_weights_puts_the_model_back(monkeypatch) -> None:
    model = Stack(n=4)
    before = _snapshot(model)
    calls = []

    def failing_quantize(weight):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory")
        return quantize_int8(weight)

    monkeypatch.setattr(layout, "quantize_int8", failing_quantize)
    conductor = BlockOffloadConductor(offload_fraction=1.0, device="cpu", offload_dtype="int8")
    with pytest.raises(RuntimeError, match="out of memory"):
        conductor.attach(model.blocks)
    assert _snapshot(model) == before
    monkeypatch.undo()
    conductor.attach(model.blocks)  # nothing marked as attached
