"""BlockOffloadConductor on the CPU (device="cpu": the same bookkeeping with plain copies):
LoRA gradients equal to a resident run under every checkpointing style, residency and order,
eviction after an early-stopped recompute, activation offload, int8 streaming, composition
with compiled blocks, and bad input that changes nothing."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
from conftest import build, inputs_for, lora_step
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import compile_accel
from compile_accel import CompileConfig, offload
from compile_accel.int8 import Int8Matrices, Int8Matrix, dequantize_int8_, quantize_int8
from compile_accel.offload import BlockOffloadConductor, activations, layout

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


def int8_round_trip_(module: nn.Module) -> None:
    """Give the module's frozen matrices the values the conductor streams in int8 mode."""
    for p in module.parameters():
        if not p.requires_grad and p.dim() >= 2:
            p.data = dequantize_int8_(torch.empty_like(p), *quantize_int8(p.data))


def step(model: nn.Module, inputs: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x, cond = inputs
    x = x.detach().requires_grad_(True)
    return lora_step(model, trainable(model), (x, cond))


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


def test_inner_checkpoint_and_compiled_blocks_stream_without_recompiles() -> None:
    """The trainer-style checkpoint inside each block's forward, blocks compiled: swapping
    weights through the slots compiles nothing new after the first step, the regions run
    compiled, and the gradients match the uncompiled, resident model."""
    reference, ref_params = build("kohya", "non-reentrant", double_blocks=3, single_blocks=3)
    model, params = build("kohya", "non-reentrant", double_blocks=3, single_blocks=3)
    model.load_state_dict(reference.state_dict())
    for p, q in zip(params, ref_params, strict=True):
        p.data.copy_(q.data)
    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", backend="aot_eager"))
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


class JointBlock(Block):
    """Takes two token streams and returns them as views of one joint tensor, as Flux's
    single-stream blocks do (a view keeps its base, so offloading the views alone frees nothing)."""

    def forward(self, text: torch.Tensor, image: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        joint = super().forward(torch.cat([text, image], dim=1), cond)
        return joint[:, :TEXT], joint[:, TEXT:]


TEXT = 4


class JointStack(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(JointBlock() for _ in range(n))

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        text, image = x[:, :TEXT], x[:, TEXT:]
        for block in self.blocks:
            text, image = checkpoint(block, text, image, cond, use_reentrant=False)
        return torch.cat([text, image], dim=1)


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


def _assert_compiled_step_matches(model: nn.Module, reference: nn.Module, inputs: tuple) -> None:
    """A LoRA step of `model` (compiled blocks) against the eager `reference` on `inputs`: loss
    and LoRA gradients equal up to float32 reordering (rtol 1e-5 and 1e-4)."""
    loss, grads = step(model, inputs)
    expected_loss, expected = step(reference, inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-7)


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
        _assert_compiled_step_matches(model, reference, inputs)
        assert inputs[0].untyped_storage().data_ptr() == x_storage
        count, freed, output_moved = at_last_block[-1]
        assert count >= 4 and freed and not output_moved  # blocks 0-3 kept something; it all left
    assert {id(p): p.data_ptr() for p in trainable(model)} == lora
    assert {id(p): p.data_ptr() for b in conductor.blocks if not b.streamed for p in b.frozen} == frozen_resident
    assert acceleration.stats()["recompiles"] == 0 and acceleration.stats()["unique_graphs"] == 1


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
    _assert_compiled_step_matches(model, reference, inputs)
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
    _assert_compiled_step_matches(model, reference, stack_inputs())
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
        _assert_compiled_step_matches(model, reference, inputs)
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
        _assert_compiled_step_matches(model, reference, stack_inputs())
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
        _assert_compiled_step_matches(model, reference, inputs)
    assert acceleration.stats()["recompiles"] == 0 and acceleration.stats()["unique_graphs"] == 1


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
