"""BlockOffloadConductor's activation offload on the CPU: what checkpointed and compiled blocks
save moves to host memory and comes back for the backward, with gradients equal to a resident run;
views, outputs the model reads again, retried forwards, other saved-tensor hooks, threads."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn
from conftest import lora_step
from torch.multiprocessing.reductions import StorageWeakRef

import compile_accel
from compile_accel import CompileConfig
from compile_accel.offload import BlockOffloadConductor, activations
from offload_stand_ins import (
    DIM,
    TOKENS,
    Block,
    JointStack,
    Stack,
    TanhStack,
    assert_compiled_step_matches,
    copy_of,
    stack_inputs,
    step,
    trainable,
    twins,
)


def test_activation_offload_moves_checkpointed_inputs_and_brings_them_back(monkeypatch) -> None:
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference = Stack(n=6)
    model = copy_of(reference)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    inputs = stack_inputs()
    loss, grads = step(model, inputs)
    expected_loss, expected = step(reference, inputs)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    # The inputs of blocks 1..3, not the shared `cond`; block 0's is the caller's tensor, block 4's
    # stay (backward needs them first), block 5's were never left behind.
    per_input = inputs[0].numel() * inputs[0].element_size()
    assert conductor.counters["activation_bytes_offloaded"] == 3 * per_input


def test_activation_offload_moves_view_inputs_with_their_base(monkeypatch) -> None:
    """Views leave with the tensor they view (freeing its GPU storage), in one host buffer; views of
    a leaf (here the caller's input, sliced by the model) stay where they are."""
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference, model = twins(lambda: JointStack())
    conductor = BlockOffloadConductor(offload_fraction=0.6, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    block_1_inputs, block_1_storage, at_block_3 = [], [], []

    def keep(module: nn.Module, args: tuple) -> None:
        block_1_inputs.extend(args[:2])
        block_1_storage.append(StorageWeakRef(args[0].untyped_storage()))

    def check(module: nn.Module, args: tuple) -> None:
        text, image = block_1_inputs
        buffers = {stored.buffer.untyped_storage().data_ptr() for stored in conductor._activations.blocks[1].offloaded}
        moved = {t.untyped_storage().data_ptr() in buffers for t in (text, image, text._base)}
        at_block_3.append((moved, block_1_storage[0].expired()))

    model.blocks[1].register_forward_pre_hook(keep)
    model.blocks[3].register_forward_pre_hook(check)
    x, cond = stack_inputs()
    x_storage = x.untyped_storage().data_ptr()
    loss, grads = lora_step(model, trainable(model), (x, cond))
    expected_loss, expected = lora_step(reference, trainable(reference), (x, cond))
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert at_block_3[0] == ({True}, True)  # in forward: views and base in the buffer, old storage freed
    assert x.untyped_storage().data_ptr() == x_storage
    joint = x.numel() * x.element_size()
    # One storage each for blocks 1 and 2; block 0's inputs are slices of the caller's x and stay,
    # block 3's stay (backward needs them first), block 4's are never left behind.
    assert conductor.counters["activation_bytes_offloaded"] == 2 * joint


class PairBlock(Block):
    """Takes two shared tables in a tuple and saves them for backward, as Flux's blocks do with
    their rotary tables."""

    def forward(self, x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = pair
        return super().forward(x * cos + x.roll(1, -1) * sin, cos)


class PairStack(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(PairBlock() for _ in range(n))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        pair = (cond.cos().expand_as(x).contiguous(), cond.sin().expand_as(x).contiguous())
        self.pair_storages = [t.untyped_storage().data_ptr() for t in pair]
        for block in self.blocks:
            assert [t.untyped_storage().data_ptr() for t in pair] == self.pair_storages
            x = block(x, pair)
        return x


def _host_buffers(conductor: BlockOffloadConductor) -> set[int]:
    return {stored.buffer.untyped_storage().data_ptr() for b in conductor._activations.blocks for stored in b.offloaded}


def _before_each_move(monkeypatch, conductor: BlockOffloadConductor, note) -> None:
    """Call `note(tensor)` with a tensor of each storage the conductor moves to the host, first."""
    offload_storage = conductor._activations._offload_storage

    def noting(block, members: list[torch.Tensor]) -> int:
        note(members[0])
        return offload_storage(block, members)

    monkeypatch.setattr(conductor._activations, "_offload_storage", noting)


def test_activation_offload_moves_what_compiled_blocks_save(monkeypatch) -> None:
    """No checkpoint, blocks compiled under a budget: what a block's compiled forward saves for
    backward leaves once the next block has started (its GPU storage freed) and comes back before
    the block's backward; parameters (frozen and LoRA), the caller's tensors, the blocks' outputs
    and the tables every block reads (passed in a tuple) stay."""
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference, model = twins(lambda: PairStack())
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend="aot_eager")
    acceleration = compile_accel.apply(model, config)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    lora = {id(p): p.data_ptr() for p in trainable(model)}
    frozen_resident = {id(p): p.data_ptr() for b in conductor.blocks if not b.streamed for p in b.frozen}
    moved, outputs, at_last_block = [], [], []
    _before_each_move(monkeypatch, conductor, lambda tensor: moved.append(StorageWeakRef(tensor.untyped_storage())))

    def check(module: nn.Module, args: tuple) -> None:
        on_host = _host_buffers(conductor)
        at_last_block.append(
            (len(moved), all(m.expired() for m in moved), any(o.untyped_storage().data_ptr() in on_host for o in outputs))
        )

    for block in model.blocks[:-1]:
        block.register_forward_hook(lambda module, args, out: outputs.append(out))
    model.blocks[-1].register_forward_pre_hook(check)
    for _ in range(2):
        moved.clear()
        outputs.clear()
        inputs = stack_inputs()
        x_storage = inputs[0].untyped_storage().data_ptr()
        assert_compiled_step_matches(model, reference, inputs)
        assert inputs[0].untyped_storage().data_ptr() == x_storage
        count, freed, output_moved = at_last_block[-1]
        assert count >= 4 and freed and not output_moved  # blocks 0-3 kept something; it all left
    assert {id(p): p.data_ptr() for p in trainable(model)} == lora
    assert {id(p): p.data_ptr() for b in conductor.blocks if not b.streamed for p in b.frozen} == frozen_resident
    assert acceleration.stats()["recompiles"] == 0 and acceleration.stats()["unique_graphs"] == 1


def test_activation_offload_keeps_block_outputs_the_model_reads(monkeypatch) -> None:
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference, model = twins(lambda: TanhStack())
    config = CompileConfig(mode="blocks", activation_memory_budget=1.0, backend="aot_eager")
    compile_accel.apply(model, config)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    outputs, moved = set(), []  # storages; an output is alive from its block's return until backward
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: outputs.add(out.untyped_storage().data_ptr()))
    _before_each_move(monkeypatch, conductor, lambda tensor: moved.append(tensor.untyped_storage().data_ptr() in outputs))
    inputs = stack_inputs()
    assert_compiled_step_matches(model, reference, inputs)
    assert moved and not any(moved)  # something left, never an output


SHARED_TABLE = torch.rand(2, TOKENS, DIM) + 0.5  # read by every block through an eager submodule


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * SHARED_TABLE  # saves the shared table for backward


class ScaledBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Scale()

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return super().forward(self.scale(x), cond)


def test_activation_offload_moves_nothing_eager_code_saves_inside_a_compiled_block(monkeypatch) -> None:
    """An excluded submodule runs eager inside the compiled block: what it saves (here a table
    that every block reads) is not the compiled function's and stays."""
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)

    def make() -> Stack:
        stack = Stack(checkpointing=None)
        stack.blocks = nn.ModuleList(ScaledBlock() for _ in range(6))
        return stack

    reference, model = twins(make)
    config = CompileConfig(mode="blocks", activation_memory_budget=0.5, backend="aot_eager", exclude=["*.scale"])
    compile_accel.apply(model, config)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    table = SHARED_TABLE.untyped_storage().data_ptr()
    assert_compiled_step_matches(model, reference, stack_inputs())
    assert conductor.counters["activation_bytes_offloaded"] > 0  # the compiled parts' activations left
    assert SHARED_TABLE.untyped_storage().data_ptr() == table


def test_activation_offload_leaves_eager_blocks_without_checkpoint_with_a_warning(monkeypatch) -> None:
    """Eager code saves tensors that others may hold (module attributes, a trainer's LoRA
    weights), so an eager block without a checkpoint keeps its activations on the GPU."""
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference, model = twins(lambda: PairStack())
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    inputs = stack_inputs()
    with pytest.warns(RuntimeWarning, match="runs eager without a checkpoint"):
        loss, grads = step(model, inputs)
    expected_loss, expected = step(reference, inputs)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert conductor.counters["activation_bytes_offloaded"] == 0


class SkipStack(Stack):
    """Block 4 reads block 0's output again (a long skip connection), which block 1 keeps."""

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        first = x = self.blocks[0](x, cond)
        for index, block in enumerate(self.blocks[1:], start=1):
            x = block(x, first if index == 4 else cond)
        return x


def test_activation_offload_brings_back_a_kept_tensor_read_again(monkeypatch) -> None:
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference, model = twins(lambda: SkipStack(checkpointing=None))
    config = CompileConfig(mode="blocks", activation_memory_budget=1.0, backend="aot_eager")
    compile_accel.apply(model, config)  # budget 1.0: block 1 saves its input
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    on_host = []

    def check(module: nn.Module, args: tuple) -> None:
        on_host.append(args[1].untyped_storage().data_ptr() in _host_buffers(conductor))

    model.blocks[4].register_forward_pre_hook(check)  # runs after the conductor's hook
    inputs = stack_inputs()
    with pytest.warns(RuntimeWarning, match="reads a tensor that block 1 keeps"):
        assert_compiled_step_matches(model, reference, inputs)
    assert on_host == [False]


def test_activation_offload_warns_under_reentrant_checkpoint(monkeypatch) -> None:
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    model = Stack(n=4, checkpointing="reentrant")
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    with pytest.warns(RuntimeWarning, match="non-reentrant"):
        step(model, stack_inputs())
    assert conductor.counters["activation_bytes_offloaded"] == 0


class RetryingStack(Stack):
    """Calls a block again when its forward raises (a trainer that frees memory and retries)."""

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            try:
                x = block(x, cond)
            except RuntimeError:
                x = block(x, cond)
        return x


def _fail_once(module: nn.Module) -> None:
    """The module's next forward raises after computing, as an out-of-memory error would."""
    failures = [1]

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("out of memory (test)")

    module.register_forward_hook(hook)


def test_activation_offload_moves_a_retried_forwards_activations(monkeypatch) -> None:
    """A block whose forward raised and ran again is a new visit: what the retried forward saves
    moves like any other block's (it was once taken for the same visit and kept nothing)."""
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    config = CompileConfig(mode="blocks", activation_memory_budget=1.0, backend="aot_eager")
    moved = []
    for fails in (False, True):
        reference, model = twins(lambda: RetryingStack(checkpointing=None))
        compile_accel.apply(model, config)
        if fails:
            _fail_once(model.blocks[2])  # before attach: the conductor's hooks run after it
        conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
        conductor.attach(model.blocks)
        assert_compiled_step_matches(model, reference, stack_inputs())
        moved.append(conductor.counters["activation_bytes_offloaded"])
    assert moved[0] > 0
    assert moved[1] == moved[0]


def test_activation_offload_steps_aside_for_other_saved_tensor_hooks(monkeypatch) -> None:
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference, model = twins(lambda: Stack(checkpointing=None))
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    inputs = stack_inputs()
    with pytest.warns(RuntimeWarning, match="saved-tensor hooks of someone else"):
        with torch.autograd.graph.save_on_cpu():
            loss, grads = step(model, inputs)
    expected_loss, expected = step(reference, inputs)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    assert conductor.counters["activation_bytes_offloaded"] == 0


def _driven_by_hand(monkeypatch) -> tuple[Stack, BlockOffloadConductor]:
    """Blocks compiled under a budget (no checkpoint), a conductor with activation offload that
    the test drives itself (hooks=False)."""
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    model = Stack(checkpointing=None)
    compile_accel.apply(model, CompileConfig(mode="blocks", activation_memory_budget=1.0, backend="aot_eager"))
    step(model, stack_inputs())  # (the class's first call runs eager: compile_accel.region_inputs)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    return model, conductor.attach(model.blocks, hooks=False)


def test_activation_offload_without_block_inputs_warns_and_moves_nothing(monkeypatch) -> None:
    """Driven by hand (hooks=False) without checkpointing, the conductor needs each block's
    inputs to know what it must leave; without them it leaves everything, with a warning."""
    model, conductor = _driven_by_hand(monkeypatch)
    x, cond = stack_inputs()
    with pytest.warns(RuntimeWarning, match="needs each block's input tensors"):
        for index, block in enumerate(model.blocks):
            conductor.before_block(index)
            x = block(x, cond)
            conductor.after_block(index, [x])
    x.square().mean().backward()
    assert conductor.counters["activation_bytes_offloaded"] == 0


def test_saved_tensor_hooks_are_ended_only_on_their_own_thread(monkeypatch) -> None:
    """Saved-tensor hooks are per thread: a call from another thread (autograd's device threads
    run gradient hooks) must not end the hooks a forward on the main thread runs under, nor lose
    what that forward saved."""
    model, conductor = _driven_by_hand(monkeypatch)
    x, cond = stack_inputs()
    top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
    conductor.before_block(0, [x, cond])
    out = model.blocks[0](x, cond)
    other = threading.Thread(target=conductor.after_block, args=(0,))
    other.start()
    other.join()
    assert top_hooks(False) is not None  # still on: the other thread left them alone
    conductor.after_block(0, [out])
    assert top_hooks(False) is None
    conductor.before_block(1, [out, cond])  # block 0's saved activations leave now
    assert conductor.counters["activation_bytes_offloaded"] > 0
    conductor.after_block(1, [model.blocks[1](out, cond)])
    assert top_hooks(False) is None  # (nothing left on for the tests after)


def test_activation_offload_every_step_and_no_leak_from_forwards_without_backward(monkeypatch) -> None:
    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    model = Stack(n=6)
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach(model.blocks)
    allocations = []
    host_empty = conductor._transfers.host_empty
    monkeypatch.setattr(conductor._transfers, "host_empty", lambda n: allocations.append(n) or host_empty(n))
    per_step = []
    for _ in range(2):
        before = conductor.counters["activation_bytes_offloaded"]
        step(model, stack_inputs())
        per_step.append(conductor.counters["activation_bytes_offloaded"] - before)
    assert per_step[0] == per_step[1] > 0
    first = len(allocations)
    held = stack_inputs()  # the caller's tensors: they never leave, not even between blocks
    storages = [t.untyped_storage().data_ptr() for t in held]
    kept = []  # block 1's input from one dropped forward, kept alive: it went to the host
    hook = model.blocks[1].register_forward_pre_hook(lambda module, args: kept.append(args[0]) if not kept else None)
    for i in range(3):  # e.g. a skipped step: its graph is dropped without backward
        model(*held).sum()
        assert [t.untyped_storage().data_ptr() for t in held] == storages
        if i == 0:
            hook.remove()
            values = kept[0].detach().clone()  # read through the host buffer
            assert kept[0].untyped_storage().data_ptr() in {
                stored.buffer.untyped_storage().data_ptr() for stored in conductor._activations.blocks[1].offloaded
            }
        model(*stack_inputs()).sum()
    step(model, stack_inputs())
    assert len(allocations) == first  # the dropped forwards' buffers were reused
    assert all(len(b.offloaded) == 0 for b in conductor._activations.blocks)
    buffers = {b.untyped_storage().data_ptr() for block in conductor._activations.blocks for b in block.free_buffers}
    assert kept[0].untyped_storage().data_ptr() not in buffers and torch.equal(kept[0], values)


@pytest.mark.parametrize("mode", ["selective", "blocks"])
def test_activation_offload_moves_what_a_trainers_checkpoint_traced_in_compiled_code_saves(monkeypatch, mode) -> None:
    """The trainer's checkpoint inside each block's forward (sd-scripts' way), traced into the
    compiled graphs (selective: the body's, called by the eager checkpoint; blocks: the whole
    block's): what those graphs save leaves for the host as a compiled block's saves do, with no
    warning, and the gradients match a resident eager run. (Eager, such a block keeps its
    activations, with a warning: the checkpoint is inside its forward.)"""
    from conftest import build, inputs_for

    monkeypatch.setattr(activations, "MIN_ACTIVATION_BYTES", 0)
    reference, ref_params = build("kohya", "non-reentrant", double_blocks=3, single_blocks=3)
    model, params = build("kohya", "non-reentrant", double_blocks=3, single_blocks=3)
    model.load_state_dict(reference.state_dict())
    for p, q in zip(params, ref_params, strict=True):
        p.data.copy_(q.data)
    budget = 0.0 if mode == "blocks" else None
    compile_accel.apply(model, CompileConfig(mode=mode, activation_memory_budget=budget, backend="aot_eager"))
    conductor = BlockOffloadConductor(offload_fraction=0.5, device="cpu", activation_offload=True)
    conductor.attach([model.double_blocks, model.single_blocks])
    inputs = inputs_for(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        lora_step(model, params, inputs_for(model))  # (a class's first block runs eager, checkpointed)
        before = conductor.counters["activation_bytes_offloaded"]
        loss, grads = lora_step(model, params, inputs)
    expected_loss, expected = lora_step(reference, ref_params, inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    assert conductor.counters["activation_bytes_offloaded"] > before
