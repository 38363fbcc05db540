"""Activation offload: what a block keeps for backward goes to pinned host memory once the next
block has started (the tensor's `.data`, so autograd's references stay valid), on a stream of
its own so that it leaves while weights arrive, and comes back, one block ahead, in backward.

What a block keeps: inside a non-reentrant checkpoint, its inputs (for the recompute). Without a
checkpoint around it (blocks compiled by compile_accel under an activation memory budget; a
trainer's checkpoint inside the block's forward traced into compiled code, selective mode's
included), what its compiled regions save, which a saved-tensor hook notes during the forward
(the hook returns each tensor as it is); parameters, trainable leaves, the block's buffers and
tensor attributes, and its outputs stay. Eager code saves tensors that others may hold (module
attributes, a trainer's LoRA weights), so an eager block without a checkpoint keeps its
activations (with a warning).
Tensors the next block reads (timestep embedding, rotary tables, its input, nested in tuples
too) stay.

Tensors move by storage: views (Flux's single-stream blocks get two slices of one tensor) go
with the tensor they view, which a view keeps alive, into one host buffer and back into one GPU
buffer, layouts kept. Among a block's inputs, tensors autograd did not make, and views of them,
stay: the caller's tensors, outputs of frozen layers (Flux's first block input). What is still
on the host when its block's next forward starts (a forward whose backward never came) goes back
then, and so does what a block reads again as its input (a long skip connection; with a
warning). Reentrant checkpoint copies its inputs before any hook could bring them back, so they
stay on the GPU (with a warning). Outside the blocks, the model must not read what a block keeps
(its input, the tensor it views, a tensor the block saves) after the next block has started
(true for plain block loops).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from ..backend import compiled_call_running
from ..checkpointing import under_saved_tensor_checkpoint
from ..int8_weight import plain_tensors
from ..stats import warn
from .layout import ALIGN, aligned
from .transfers import Transfers

MIN_ACTIVATION_BYTES = 1 << 20  # smaller storages are not worth a round trip


@dataclass
class _OffloadedStorage:
    """A GPU storage behind some of a block's inputs, now in a host buffer. Every tensor that
    used it (the inputs and the tensor they are views of: a view keeps its base alive) points
    at the buffer in its old layout, so aliasing survives the round trip."""

    tensors: list[tuple[weakref.ref, torch.dtype, torch.Size, tuple[int, ...], int]]  # (tensor, layout)
    buffer: torch.Tensor  # host bytes; the storage starts at ALIGN
    nbytes: int

    def alive(self) -> bool:
        return any(ref() is not None for ref, *_ in self.tensors)

    def point_at(self, storage: torch.Tensor) -> None:
        """Rebind every tensor still alive to `storage` (flat bytes), each in its own layout."""
        for ref, dtype, shape, stride, offset in self.tensors:
            if (tensor := ref()) is not None:
                whole = storage.numel() // dtype.itemsize * dtype.itemsize  # a storage may end mid-element
                flat = storage[:whole].view(dtype)
                # as_strided's offset counts from the start of the storage, not of `flat`.
                tensor.data = flat.as_strided(shape, stride, flat.storage_offset() + offset)


@dataclass
class _Saving:
    """A block's forward in progress without a checkpoint: the saved-tensor hooks on (on
    `thread`), its inputs, what its compiled regions saved so far (weak references), and how many
    tensors were saved outside them (eager code)."""

    hooks: saved_tensors_hooks
    thread: int
    inputs: list[torch.Tensor]
    saved: list[weakref.ref]
    eager_saves: list[int]  # one count, shared with the pack hook


@dataclass(eq=False)  # one per block, told apart by identity (kept in sets and dicts)
class _BlockActivations:
    """What one block has on the host now, and the events that order its copies."""

    index: int
    name: str
    module: nn.Module
    # Offloaded tensors, referenced weakly: a forward that never gets its backward leaves
    # nothing alive here.
    offloaded: list[_OffloadedStorage] = field(default_factory=list)
    free_buffers: list[torch.Tensor] = field(default_factory=list)  # host buffers, reused across steps
    on_host: torch.cuda.Event | None = None  # copied out (to-host stream)
    buffers_read: torch.cuda.Event | None = None  # copied back out of the buffers
    back: torch.cuda.Event | None = None  # the same, not yet waited for by the compute stream


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage behind `tensor`, as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class ActivationOffload:
    """Moves what each block keeps for backward to host memory between its forward and its
    backward (see the module docstring), for a conductor that tells it about every block visit.

    Knob: MIN_ACTIVATION_BYTES (this module's), the smallest storage worth a round trip; smaller
    ones stay. Host buffers are allocated through `transfers` (pinned), one per storage, and
    reused by the same block on later steps.

    Streams and events, per block: copies out run on `transfers.to_host` behind the compute so
    far and behind `buffers_read` (the last copy out of a reused buffer), and record `on_host`;
    copies back run on `transfers.to_device` behind `on_host` and record `buffers_read` and
    `back`; the compute stream waits for `back` before the block runs (`wait`). Without side
    streams every copy is done when issued and no events are recorded.

    Calls, from the conductor: `attach(named)` once the blocks are known; at each visit
    `stop_saving()`, then in forward `before_block(...)` (in backward `bring_back` of the block
    and a prefetching one of the next), `wait(index)` and `after_block(index, outputs)`;
    `remove()` at the end, after `bring_back` of every block.
    """

    def __init__(self, transfers: Transfers) -> None:
        self.transfers = transfers
        self.blocks: list[_BlockActivations] = []
        # What the block visited last in forward keeps for backward (weak: autograd holds what it
        # still needs), and the storages among them that must stay.
        self._kept: list[weakref.ref] = []
        self._kept_staying: set[int] = set()
        self._saving: _Saving | None = None  # a block's forward without a checkpoint, until after_block
        self._host_owner: dict[int, _BlockActivations] = {}  # host buffer (storage pointer) -> whose tensors
        self._warned: set[str] = set()

    def attach(self, named: Sequence[tuple[str, nn.Module]]) -> None:
        """The blocks (name, module) in execution order."""
        self.blocks = [_BlockActivations(i, name, module) for i, (name, module) in enumerate(named)]

    def remove(self) -> None:
        """End the saved-tensor hooks and forget the blocks (bring every block back first)."""
        self.stop_saving()
        self.blocks, self._kept, self._kept_staying, self._host_owner = [], [], set(), {}

    def before_block(self, index: int, inputs: Sequence[torch.Tensor], in_backward: bool, previous: int | None) -> int:
        """Block `index` is visited with `inputs`, after block `previous`. Forward: offload what the
        previous block keeps for backward, except what this block shares; what the next-to-last
        block keeps stays: backward needs it first. Then note what this block keeps: inside a
        non-reentrant checkpoint its inputs, without a checkpoint what its forward saves.
        Backward: this block's tensors must be back before it reads them. Returns the bytes
        sent to the host."""
        block = self.blocks[index]
        previous_kept, self._kept = self._kept, []
        previous_staying, self._kept_staying = self._kept_staying, set()
        if in_backward:
            self.bring_back(index)
            return 0
        if previous != index - 1 or index == len(self.blocks) - 1:
            previous_kept = []  # not offloaded; and they may hold a dropped forward's graph
        # Tensors still on the host from an earlier forward of this block, whose backward never
        # came (or comes after this forward): the live ones go back, the dead ones free their buffers.
        self._bring_back(block)
        # A tensor an earlier block kept, read again as this block's input (a long skip connection).
        for owner in {self._host_owner.get(t.untyped_storage().data_ptr()) for t in inputs} - {None}:
            self._warn_once(
                f"read again {owner.index}",
                f"block {block.name} reads a tensor that block {owner.name} keeps for backward and that "
                "activation_offload had moved to host memory; it is brought back now, and what block "
                f"{owner.name} keeps stays on the GPU until its backward",
            )
            self._bring_back(owner)
        if torch.is_grad_enabled():
            if under_saved_tensor_checkpoint():
                self._keep(inputs, inputs)
            elif (
                torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
                or not torch._C._autograd._saved_tensors_hooks_is_enabled()
            ):
                self._warn_once(
                    "other hooks",
                    f"block {block.name} runs under saved-tensor hooks of someone else's (save_on_cpu, a "
                    "meter), or with such hooks disabled; activation_offload leaves its activations",
                )
            elif not inputs:
                self._warn_once(
                    "no inputs",
                    "activation_offload without checkpointing needs each block's input tensors "
                    "(before_block(i, inputs)); without them the activations stay on the GPU",
                )
            else:
                self._start_saving(inputs)
        elif block.module.training and any(t.requires_grad for t in inputs):
            self._warn_once(
                "reentrant",
                "activation_offload needs non-reentrant checkpointing (torch.utils.checkpoint(..., "
                "use_reentrant=False)) or none; with reentrant checkpointing block inputs stay on the GPU",
            )
        if not previous_kept:
            return 0
        # Moved by storage: the tensors that share one, and the tensors they are views of, go
        # together. Storages this block reads stay, and so do those that must (see `_keep`).
        previous_block = self.blocks[previous]
        staying = previous_staying | {t.untyped_storage().data_ptr() for t in inputs}
        storages: dict[int, list[torch.Tensor]] = {}
        for tensor in (ref() for ref in previous_kept):
            if tensor is None:
                continue
            key = tensor.untyped_storage().data_ptr()
            if key in staying or not tensor.is_floating_point() or tensor.device != self.transfers.device:
                storages.pop(key, None)
                continue
            members = storages.setdefault(key, [])
            for alias in (tensor if tensor._base is None else tensor._base, tensor):
                if all(alias is not m for m in members):
                    members.append(alias)
        moved = sum(self._offload_storage(previous_block, members) for members in storages.values())
        if previous_block.offloaded:
            previous_block.on_host = self.transfers.done(self.transfers.to_host)
        return moved

    def after_block(self, index: int, outputs: Sequence[torch.Tensor]) -> None:
        """Block `index` has returned `outputs`: end the noting of what its forward saved."""
        saving = self.stop_saving()
        if saving is not None:
            self._keep_saved(self.blocks[index], saving, outputs)

    def stop_saving(self) -> _Saving | None:
        """End `_start_saving`'s hooks, if on (on the thread that started them)."""
        saving = self._saving
        if saving is None or saving.thread != threading.get_ident():
            return None
        self._saving = None
        saving.hooks.__exit__(None, None, None)
        return saving

    def bring_back(self, index: int, prefetch: bool = False) -> None:
        """Copy block `index`'s offloaded tensors back to the GPU; unless `prefetch`, the compute
        stream waits for them."""
        self._bring_back(self.blocks[index], prefetch)

    def wait(self, index: int) -> None:
        """Order the compute stream after the copies that bring block `index`'s tensors back."""
        block = self.blocks[index]
        self.transfers.wait(block.back)
        block.back = None

    def _keep(self, inputs: Sequence[torch.Tensor], kept: Sequence[torch.Tensor], staying: Iterable[int] = ()) -> None:
        """The block visited now keeps `kept` for its backward. Of those, the storages in
        `staying` and those behind an input that autograd did not make (the caller's tensor,
        whole or sliced by the model, a frozen layer's output) must stay: someone else holds them."""
        self._kept = [weakref.ref(t) for t in kept]
        self._kept_staying = set(staying) | {
            t.untyped_storage().data_ptr() for t in inputs if (t if t._base is None else t._base).grad_fn is None
        }

    def _start_saving(self, inputs: Sequence[torch.Tensor]) -> None:
        """Note the tensors the block's compiled regions save for backward, until after_block
        (the hook returns each tensor as it is). Only those: eager code saves tensors that others
        may hold (module attributes, a trainer's LoRA weights), which must not move."""
        # Autograd keeps `pack` with every tensor saved until backward: it holds no strong reference.
        saved: list[weakref.ref] = []
        eager_saves = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            root = tensor if tensor._base is None else tensor._base
            if not compiled_call_running():
                eager_saves[0] += 1
            elif type(tensor) is torch.Tensor and not (
                isinstance(root, nn.Parameter) or (root.grad_fn is None and root.requires_grad)
            ):
                saved.append(weakref.ref(tensor))  # not a parameter (here or elsewhere) nor a trainable leaf
            return tensor

        hooks = saved_tensors_hooks(pack, lambda tensor: tensor)
        hooks.__enter__()
        self._saving = _Saving(hooks, threading.get_ident(), list(inputs), saved, eager_saves)

    def _keep_saved(self, block: _BlockActivations, saving: _Saving, outputs: Sequence[torch.Tensor]) -> None:
        """What the block's compiled regions saved, except storages others read: its outputs
        (the model may use them before backward), its parameters, buffers and tensor attributes."""
        if saving.eager_saves[0] and not saving.saved:
            self._warn_once(
                "eager",
                f"block {block.name} runs eager without a checkpoint around it: activation_offload moves what "
                "compiled code saves and the inputs of blocks checkpointed from outside, so its activations stay "
                "on the GPU (a checkpoint inside its forward: compile it, selective or blocks mode)",
            )
        owned = [*block.module.parameters(), *block.module.buffers()]
        owned += [v for m in block.module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
        staying = {plain.untyped_storage().data_ptr() for t in (*owned, *outputs) for plain in plain_tensors(t)}
        self._keep(saving.inputs, [t for t in (ref() for ref in saving.saved) if t is not None], staying)

    def _offload_storage(self, block: _BlockActivations, members: list[torch.Tensor]) -> int:
        """Move the storage behind `members` into one of the block's host buffers; the bytes moved."""
        source = _storage_bytes(members[0])
        nbytes = source.numel()
        if nbytes < MIN_ACTIVATION_BYTES:
            return 0
        buffer = self._take_buffer(block, nbytes)
        host = buffer[ALIGN : ALIGN + nbytes]
        # A reused buffer is written once the last step's copy back out of it is done.
        self.transfers.copy(source, host, self.transfers.to_host, block.buffers_read)
        stored = _OffloadedStorage(
            [(weakref.ref(t), t.dtype, t.shape, t.stride(), t.storage_offset()) for t in members], buffer, nbytes
        )
        stored.point_at(host)
        block.offloaded.append(stored)
        self._host_owner[buffer.untyped_storage().data_ptr()] = block
        return nbytes

    def _take_buffer(self, block: _BlockActivations, nbytes: int) -> torch.Tensor:
        """A host buffer of at least `nbytes` (after the ALIGN lead) from the block's free ones."""
        for i, buffer in enumerate(block.free_buffers):
            if buffer.numel() >= nbytes + ALIGN:
                return block.free_buffers.pop(i)
        return self.transfers.host_empty(aligned(nbytes) + ALIGN)

    def _bring_back(self, block: _BlockActivations, prefetch: bool = False) -> None:
        if not block.offloaded:
            return
        transfers = self.transfers
        for stored in block.offloaded:
            if not stored.alive():
                continue
            target = torch.empty(stored.nbytes, dtype=torch.uint8, device=transfers.device)
            transfers.copy(stored.buffer[ALIGN : ALIGN + stored.nbytes], target, transfers.to_device, block.on_host)
            stored.point_at(target)
        # The buffers are free once the copies out of them are done (`buffers_read`).
        for stored in block.offloaded:
            del self._host_owner[stored.buffer.untyped_storage().data_ptr()]
        block.free_buffers += [stored.buffer for stored in block.offloaded]
        block.offloaded = []
        block.on_host = None
        block.buffers_read = block.back = transfers.done(transfers.to_device)
        if not prefetch:
            self.wait(block.index)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)
