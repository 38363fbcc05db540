"""LayerOffloadConductor: stream a model's blocks between host and GPU memory around their calls.

Most blocks live in host memory and are copied into one of two GPU slots just before they
run; `1 - offload_fraction` of the blocks stay on the GPU: the smallest ones, spread evenly
over the execution order, so that copies go on while they compute. Only frozen parameters
move: trainable ones (LoRA) and buffers stay on the GPU, so gradients and optimizer state
never travel.

How it composes with compiled blocks: the conductor works in forward hooks on the block
modules, which run in `nn.Module.__call__` around the (compiled) forward, so dynamo never sees
it: no graph break, `fullgraph=True` possible. A streamed block's parameters are rebound
(`param.data = view`) to fixed views of its slot: same device, dtype, shape, stride and a
non-zero storage offset on every load, and the same offsets for every block of a class, so
swapping recompiles nothing (a view at offset 0 would let dynamo specialise the offset).
Evicted, a parameter points at its host copy; a compiled region called then runs eager and is
counted in `Acceleration.stats()["eager_nonresident_calls"]`.

Order and overlap: each block call is a visit. The conductor predicts the next visit from the
direction of the last two (forward ascends; with checkpointing, backward recomputes blocks in
descending order) and starts copying the next streamed block on a side stream while the
current block computes (from a resident block the next two, both slots being free then; in
int8 mode always two, see below). Measured with Flux at 1024x1024 the copy stream was
otherwise idle for the length of the resident blocks' compute when they sat together at the
end. Events order the streams: a copy into a slot waits for the work enqueued before it (which
includes the slot's previous block), and a block's compute waits for its copy. A wrong guess
costs a copy on demand, never correctness.

Backward: autograd may hold a streamed block's weights (saved for backward, or read by a
checkpoint's recompute) after the block has left its slot. So after each block's forward the
conductor puts a gradient hook on the block's outputs: when backward reaches the block, the
hook visits it again, which loads it back into its own slot (the same views, so whatever
autograd saved sees the right values) before any of its backward runs, and prefetches the
block before it. This holds with any checkpointing (reentrant or not, around or inside the
block, compiled into it) and with none, so a budgeted block can be streamed too. Eviction
happens only when a slot is taken; a non-reentrant recompute that stops early (and so never
finishes the block's forward) leaves nothing stale behind.

activation_offload: what a block keeps for backward is moved to pinned host memory once the
next block has started (the tensor's `.data`, so autograd's references stay valid), on a stream
of its own so that it leaves while weights arrive, and brought back, one block ahead, in
backward. Inside a non-reentrant checkpoint a block keeps its inputs (for the recompute).
Without a checkpoint (blocks compiled by compile_accel under an activation memory budget) it
keeps what its compiled regions save, which a saved-tensor hook notes during the forward (the
hook returns each tensor as it is); parameters, trainable leaves, the block's buffers and tensor
attributes, and its outputs stay. Eager code saves tensors that others may hold (module
attributes, a trainer's LoRA weights), so an eager block without a checkpoint keeps its
activations (with a warning). Tensors the next block reads (timestep embedding, rotary tables,
its input, nested in tuples too) stay. Tensors move by storage:
views (Flux's single-stream blocks get two slices of one tensor) go with the tensor they view,
which a view keeps alive, into one host buffer and back into one GPU buffer, layouts kept.
Among a block's inputs, tensors autograd did not make, and views of them, stay: the caller's
tensors, outputs of frozen layers (Flux's first block input). What is still on the host when
its block's next forward starts (a forward whose backward never came) goes back then, and so
does what a block reads again as its input (a long skip connection; with a warning).
Reentrant checkpoint copies its inputs before any hook could bring them back, so they stay on
the GPU (with a warning). Outside the blocks, the model must not read what a block keeps (its
input, the tensor it views, a tensor the block saves) after the next block has started (true
for plain block loops).

offload_dtype="int8": streamed frozen weight matrices are stored as per-row symmetric int8
plus an fp32 scale per row (the host copy is lossy; the bf16 originals are dropped), sent as
int8 into the slot's staging buffer and dequantized into the slot on the compute stream just
before the block runs (one kernel launch per block). A copy waits only for the last dequantize
out of its staging buffer, never for compute, so the copy engine runs two blocks ahead.

While attached, a streamed block's frozen parameters are views of its slot (when loaded) or of
host memory (when not); in int8 mode an unloaded one reads as zeros. Trainable parameters are
never touched, so saving LoRA weights is safe; for the base weights call `detach()` first.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from .auto_budget import OffloadLadder, spaced_levels
from .blocks import resolve_block_lists
from .backend import compiled_call_running
from .checkpointing import under_saved_tensor_checkpoint
from .int8 import Int8Matrices, Int8Matrix, quantize_int8, view_bytes
from .stats import warn

logger = logging.getLogger("compile_accel")

OFFLOAD_DTYPES = (None, "int8")
SLOTS = 2  # one block computing, the next one arriving
ALIGN = 16  # bytes; every view starts at a multiple of this and never at offset 0
MIN_ACTIVATION_BYTES = 1 << 20  # smaller block inputs are not worth a round trip
# Conductors attached now: attach() refuses blocks that share a module or parameter with one.
_ATTACHED: weakref.WeakSet[LayerOffloadConductor] = weakref.WeakSet()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class _Entry:
    """Where one frozen parameter sits: in the GPU slot, and in the host blob."""

    param: nn.Parameter
    offset: int  # bytes into the slot
    quantized: bool = False
    host_offset: int = 0  # bytes into the host blob (the int8 values when quantized)
    scale_offset: int = 0  # quantized: bytes into the host blob of the fp32 row scales

    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()


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


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage behind `tensor`, as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class _Block:
    """One block's offloaded parameters, their layout, and where they are now."""

    def __init__(self, index: int, name: str, module: nn.Module, quantize: bool) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        self.others = [p for p in module.parameters() if p.requires_grad] + list(module.buffers())
        self.entries = [
            _Entry(p, 0, quantize and p.dim() >= 2 and p.is_floating_point() and p.numel() > 0) for p in self.frozen
        ]
        # Entries kept as they are come first, at the same offsets in the slot and in the host
        # blob, so that in int8 mode one copy moves them all out of the staging buffer.
        offset = ALIGN
        for entry in (e for e in self.entries if not e.quantized):
            entry.offset = entry.host_offset = offset
            offset = _aligned(offset + entry.nbytes())
        self.unquantized_end = host = offset
        for entry in (e for e in self.entries if e.quantized):
            entry.offset, offset = offset, _aligned(offset + entry.nbytes())
            entry.host_offset, host = host, _aligned(host + entry.param.numel())
            entry.scale_offset, host = host, _aligned(host + entry.param.shape[0] * 4)
        self.nbytes = offset  # slot bytes
        self.host_nbytes = host
        self.int8: Int8Matrices | None = None  # int8 mode, streamed: how to dequantize the staging buffer
        self.streamed = False
        self.slot: int | None = None
        self.host: torch.Tensor | None = None  # pinned (or pageable) blob, streamed blocks only
        self.home: torch.Tensor | None = None  # GPU buffer of a block that stays resident
        self.device_views: list[torch.Tensor] = []
        self.host_views: list[torch.Tensor] = []
        self.loaded: torch.cuda.Event | None = None  # copy into the slot (int8: staging), not yet waited for
        # Offloaded inputs, referenced weakly: a forward that never gets its backward leaves
        # nothing alive here.
        self.offloaded: list[_OffloadedStorage] = []
        self.free_buffers: list[torch.Tensor] = []  # host buffers for inputs, reused across steps
        self.on_host: torch.cuda.Event | None = None  # inputs copied out (to-host stream)
        self.buffers_read: torch.cuda.Event | None = None  # inputs copied back out of the buffers
        self.activations_back: torch.cuda.Event | None = None  # the same, not yet waited for

    def bind(self, views: list[torch.Tensor]) -> None:
        for entry, view in zip(self.entries, views, strict=True):
            entry.param.data = view


class LayerOffloadConductor:
    """Keeps a fraction of a model's blocks in host memory and streams them to the GPU.

    offload_fraction: share of the blocks (by count) that live in host memory; 0.0 keeps all
        on the GPU, 1.0 streams all. The ones that stay are the smallest, spread evenly.
    device: the compute device (default: the current CUDA device). "cpu" runs the same
        bookkeeping with plain copies, for tests and debugging.
    async_transfers: copy on a side CUDA stream, the next blocks while the current computes
        (in forward and in backward's reverse order); False copies on the compute stream.
    activation_offload: move what each block keeps for backward to host memory between its
        forward and its backward: its inputs under non-reentrant checkpointing, the tensors its
        forward saves without checkpointing (see the module docstring).
    offload_dtype: None streams the weights as they are; "int8" stores and sends streamed
        weight matrices as per-row int8 + scale and dequantizes them on the GPU (lossy).
    pin_memory: keep host copies in page-locked memory (allocated once, reused every step);
        if pinning fails the conductor warns and uses pageable memory.

    Use `attach(blocks)` (hooks on each block) or `attach(blocks, hooks=False)` and call
    `before_layer(i, inputs)` / `after_layer(i, outputs)` around block i yourself. `detach()`
    undoes it.
    """

    def __init__(
        self,
        offload_fraction: float = 0.5,
        device: torch.device | str | None = None,
        async_transfers: bool = True,
        activation_offload: bool = False,
        offload_dtype: str | None = None,
        pin_memory: bool = True,
    ) -> None:
        _check_fraction(offload_fraction)
        if offload_dtype not in OFFLOAD_DTYPES:
            raise ValueError(f"offload_dtype must be one of {OFFLOAD_DTYPES}, got {offload_dtype!r}")
        device = torch.device(device if device is not None else "cuda")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "LayerOffloadConductor streams blocks to a CUDA device, but CUDA is not available "
                    "(pass device='cpu' only to exercise the bookkeeping)"
                )
            device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(f"device must be a CUDA device or 'cpu', got {device}")
        self.offload_fraction = float(offload_fraction)
        self.device = device
        self.cuda = device.type == "cuda"
        self.async_transfers = async_transfers and self.cuda
        self.activation_offload = activation_offload
        self.offload_dtype = offload_dtype
        self.pin_memory = pin_memory and self.cuda
        self.blocks: list[_Block] = []
        self._attached_as: tuple[nn.Module | Sequence[nn.Module], bool] | None = None  # attach()'s arguments
        self._slots: list[torch.Tensor] = []
        self._staging: list[torch.Tensor] = []  # int8 mode: where the host blob lands before dequantizing
        self._staging_read: list[torch.cuda.Event | None] = []  # int8: the last dequantize out of each
        self._staged: list[_Block | None] = []  # int8: the block in each staging buffer, not dequantized yet
        self._occupant: list[_Block | None] = []  # the block each slot holds (int8: dequantized)
        self._hooks: list[RemovableHandle] = []
        # Parameters' and buffers' device at attach, and the frozen weights' layout (strides) as
        # a meta tensor: detach() gives each back in the layout it had.
        self._original_devices: dict[int, torch.device] = {}
        self._original_layouts: dict[int, torch.Tensor] = {}
        # Bumped by attach() and detach(): a gradient hook from an earlier attach refuses to run.
        self._generation = 0
        self._awaiting_after: int | None = None  # a block's forward visit under grad, until its after_layer
        self._owned: set[int] = set()  # ids of the attached blocks' modules and parameters
        # Copies to the GPU (weights, inputs coming back) and to the host (inputs leaving) run on
        # their own streams: PCIe carries both directions at once.
        self._to_device = torch.cuda.Stream(device) if self.async_transfers else None
        self._to_host = torch.cuda.Stream(device) if self.async_transfers else None
        self._last: int | None = None  # index of the block visited last, and the one before
        self._previous: int | None = None
        self._last_in_backward = False
        # activation_offload: what the block visited last in forward keeps for backward (weak:
        # autograd holds what it still needs), and the storages among them that must stay.
        self._kept: list[weakref.ref] = []
        self._kept_staying: set[int] = set()
        self._saving: _Saving | None = None  # a block's forward without a checkpoint, until after_layer
        self._host_owner: dict[int, _Block] = {}  # host buffer (storage pointer) -> the block whose tensors it holds
        self._warned: set[str] = set()
        self.counters = {
            "loads": 0,
            "prefetched_loads": 0,
            "bytes_to_device": 0,
            "activation_bytes_offloaded": 0,
        }

    # ---- setup -------------------------------------------------------------------------

    def attach(self, blocks: nn.Module | Sequence[nn.Module], hooks: bool = True) -> LayerOffloadConductor:
        """Take over the blocks' frozen weights (execution order; a model, a ModuleList or a list
        of blocks/ModuleLists). Raises before anything moves when the input is wrong or memory
        cannot be allocated."""
        if self.blocks:
            raise RuntimeError("this LayerOffloadConductor is already attached; detach() it first")
        named = _named_blocks(blocks)
        for name, module in named:
            owner = _owner(module)
            if owner is not None:
                raise RuntimeError(
                    f"block {name} (or a module in it or around it) is already attached to "
                    f"{'this' if owner is self else 'another'} LayerOffloadConductor; detach() that first"
                )
        self._check_devices(named)
        plan = [_Block(i, name, module, self.offload_dtype == "int8") for i, (name, module) in enumerate(named)]
        seen: dict[int, str] = {}
        for block in plan:
            for p in block.frozen:
                if id(p) in seen:
                    raise ValueError(f"parameter shared by blocks {seen[id(p)]} and {block.name}; cannot offload it")
                seen[id(p)] = block.name
        streamed = int(self.offload_fraction * len(plan) + 0.5)
        resident = _spread_resident([b.nbytes for b in plan], len(plan) - streamed)
        for k, block in enumerate(b for b in plan if b.index not in resident):
            block.streamed, block.slot = True, k % SLOTS
        start = time.perf_counter()
        host_gib = sum(b.host_nbytes for b in plan if b.streamed) / 2**30
        logger.info("offload: %d of %d blocks to host memory (%.2f GiB)", streamed, len(plan), host_gib)
        self._allocate(plan)  # may raise; nothing has moved yet

        # From here on the model changes; a failure (out of memory while copying) puts it back.
        originals = {id(t): t.data for block in plan for t in (*block.module.parameters(), *block.module.buffers())}
        try:
            for block in plan:
                self._original_devices.update({id(t): t.device for t in (*block.frozen, *block.others)})
                self._original_layouts.update({id(p): torch.empty_like(p.data, device="meta") for p in block.frozen})
                for tensor in block.others:
                    tensor.data = tensor.data.to(self.device)
                self._fill(block)
        except BaseException:
            for block in plan:
                for tensor in (*block.module.parameters(), *block.module.buffers()):
                    tensor.data = originals[id(tensor)]
            self._slots, self._staging, self._original_devices, self._original_layouts = [], [], {}, {}
            raise
        self.blocks = plan
        self._attached_as = (blocks, hooks)
        self._owned = {id(t) for block in plan for t in (*block.module.modules(), *block.module.parameters())}
        _ATTACHED.add(self)
        self._generation += 1
        self._occupant = [None] * len(self._slots)
        self._staged = [None] * len(self._slots)
        if hooks:
            for block in plan:
                self._hooks.append(
                    block.module.register_forward_pre_hook(self._pre_hook(block.index), with_kwargs=True)
                )
                # always_call: a forward that raises still ends the saved-tensor hooks.
                self._hooks.append(
                    block.module.register_forward_hook(self._post_hook(block.index), always_call=True)
                )
        logger.info("offload: attached in %.1f s", time.perf_counter() - start)
        return self

    def _check_devices(self, named: list[tuple[str, nn.Module]]) -> None:
        devices = {(name, t.device) for name, module in named for t in (*module.parameters(), *module.buffers())}
        kinds = {device for _, device in devices}
        if len(kinds) > 1 or (kinds and next(iter(kinds)) not in (torch.device("cpu"), self.device)):
            listing = ", ".join(sorted({f"{name} on {device}" for name, device in devices}))
            raise ValueError(
                f"the blocks must all be on cpu or all on {self.device} before attach(); found {listing[:400]}"
            )

    def _host_empty(self, nbytes: int) -> torch.Tensor:
        if self.pin_memory:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:
                self.pin_memory = False
                warn(
                    f"could not allocate pinned host memory ({str(error).splitlines()[0]}); using pageable memory, "
                    "so copies to the GPU are slower and do not overlap compute. Free host memory or lower "
                    "offload_fraction to get pinned transfers"
                )
        return torch.empty(nbytes, dtype=torch.uint8)

    def _allocate(self, plan: list[_Block]) -> None:
        streamed = [b for b in plan if b.streamed]
        try:
            for block in streamed:
                block.host = self._host_empty(block.host_nbytes)
            slot_bytes = max((b.nbytes for b in streamed), default=0)
            self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in streamed[:SLOTS]]
            if self.offload_dtype == "int8":
                staging = max((b.host_nbytes for b in streamed), default=0)
                self._staging = [torch.empty(staging, dtype=torch.uint8, device=self.device) for _ in self._slots]
                self._staging_read = [None] * len(self._staging)
            for block in plan:
                if not block.streamed:
                    block.home = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)
        except (RuntimeError, MemoryError):
            for block in plan:
                block.host = block.home = None
            self._slots, self._staging = [], []
            raise

    def _fill(self, block: _Block) -> None:
        """Copy the block's frozen weights into their new home and point the parameters there."""
        if not block.streamed:
            block.device_views = [view_bytes(block.home, e.offset, e.param, e.param.dtype) for e in block.entries]
            for entry, view in zip(block.entries, block.device_views, strict=True):
                view.copy_(entry.param.data)
            block.bind(block.device_views)
            return
        slot = self._slots[block.slot]
        block.device_views = [view_bytes(slot, e.offset, e.param, e.param.dtype) for e in block.entries]
        if self.offload_dtype == "int8":
            matrices = [
                Int8Matrix(e.host_offset, e.scale_offset, e.offset, e.param.shape, e.param.dtype)
                for e in block.entries
                if e.quantized
            ]
            block.int8 = Int8Matrices(matrices, self.device)
        block.host_views = []
        for entry in block.entries:
            p = entry.param
            if entry.quantized:
                q, scale = quantize_int8(p.data)
                view_bytes(block.host, entry.host_offset, q, torch.int8).copy_(q)
                view_bytes(block.host, entry.scale_offset, scale, torch.float32).copy_(scale)
                # The bf16 original is dropped; while evicted the parameter is an empty placeholder.
                block.host_views.append(torch.zeros((), dtype=p.dtype).expand(p.shape))
            else:
                view = view_bytes(block.host, entry.host_offset, p, p.dtype)
                view.copy_(p.data)
                block.host_views.append(view)
        block.bind(block.host_views)

    def detach(self) -> None:
        """Remove the hooks and give every parameter a standalone copy on the device it had at
        attach (dequantized values in int8 mode)."""
        if not self.blocks:
            return
        self.synchronize()
        for hook in self._hooks:
            hook.remove()
        for block in self.blocks:
            self._bring_back(block)
            if block.streamed:
                self._load(block)
                self._wait(block)
                self._occupant[block.slot] = None  # restored below: no later load may evict it
            for entry, view in zip(block.entries, block.device_views, strict=True):
                layout = self._original_layouts[id(entry.param)]
                entry.param.data = torch.empty_like(layout, device=self._original_devices[id(entry.param)]).copy_(view)
            for tensor in block.others:
                tensor.data = tensor.data.to(self._original_devices[id(tensor)])
        _ATTACHED.discard(self)
        self._owned = set()
        self._stop_saving()
        self.synchronize()
        self._generation += 1
        self._original_devices, self._original_layouts, self._awaiting_after = {}, {}, None
        self.blocks, self._hooks, self._slots, self._staging, self._occupant = [], [], [], [], []
        self._staging_read, self._staged = [], []
        self._last = self._previous = None
        self._kept, self._kept_staying, self._host_owner = [], set(), {}

    def set_offload_fraction(self, offload_fraction: float) -> None:
        """Stream another share of the blocks: detach, then attach the same blocks again (between
        steps, never inside a forward). activation_memory_budget="auto" turns this when no budget
        fits. Detaching puts the weights where they were at attach: attach from the CPU when the
        GPU cannot hold them all."""
        _check_fraction(offload_fraction)
        attached_as = self._attached_as if self.blocks else None
        self.detach()
        self.offload_fraction = float(offload_fraction)
        if attached_as is not None:
            self.attach(*attached_as)

    # ---- per visit ---------------------------------------------------------------------

    def _pre_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.before_layer(index, (args, kwargs))  # before_layer takes the tensors out

        return hook

    def _post_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.after_layer(index, output)

        return hook

    def before_layer(self, index: int, inputs: Any = ()) -> None:
        """Make block `index` resident before it runs and start copying the next one.
        `inputs`: every tensor the block reads from its arguments, as a tensor or a (nested)
        tuple, list or dict (activation_offload keeps those the caller holds, and what the next
        block reads, on the GPU: pass them)."""
        block = self._block(index)
        inputs = _tensors(inputs)
        in_backward = torch._C._current_graph_task_id() != -1
        self._stop_saving()  # a forward that raised before its after_layer
        self._check_after_layer_called(index, in_backward)
        if in_backward and (self._last, self._last_in_backward) == (index, True):
            self._wait(block)  # the same visit again (a recompute after the gradient hook's visit)
            return
        # In forward a block called again is a new visit: its forward raised and is retried, or the
        # model calls it twice in a row; what the first call kept is dropped with its graph.
        self._previous, self._last, self._last_in_backward = self._last, index, in_backward
        if self.activation_offload:
            self._visit_activations(block, inputs, in_backward)
        if block.streamed:
            self._load(block)
        self._wait(block)
        upcoming = list(self._upcoming(index))
        if in_backward and self.activation_offload and upcoming:
            self._bring_back(self.blocks[upcoming[0]], prefetch=True)
        # Prefetch the next streamed blocks into the slots that no block still to come before
        # them holds: one ahead from a streamed block, two from a resident one (whose compute
        # then overlaps copies, as the resident blocks are spread among the streamed ones). int8
        # prefetches into staging buffers, and this block's is free once it is dequantized: two.
        claimed = {block.slot} if block.streamed and self.offload_dtype != "int8" else set()
        for ahead in (self.blocks[i] for i in upcoming):
            if not ahead.streamed:
                continue
            if ahead.slot in claimed:
                break
            claimed.add(ahead.slot)
            self._load(ahead, prefetch=True)

    def after_layer(self, index: int, outputs: Any = ()) -> None:
        """Block `index` has run its forward and returned `outputs` (a tensor or a nested tuple,
        list or dict): when backward reaches them, the block is visited (loaded) again before
        any of its backward runs. With activation_offload and no checkpoint, this ends the
        noting of what its forward saved."""
        block = self._block(index)
        outputs = _tensors(outputs)
        self._awaiting_after = None
        saving = self._stop_saving()
        if saving is not None:
            self._keep_saved(block, saving, outputs)
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(self._backward_visit(index))

    def _backward_visit(self, index: int):
        generation = self._generation

        def hook(grad: torch.Tensor) -> None:
            if generation != self._generation:
                raise RuntimeError(
                    f"backward reached the output of block {index} from a forward run before this "
                    "LayerOffloadConductor's detach() (or a later attach()): its weights are gone from where "
                    "autograd saved them. Run backward before detach(), or run the forward again"
                )
            self.before_layer(index)

        return hook

    def _block(self, index: int) -> _Block:
        if not self.blocks:
            raise RuntimeError("this LayerOffloadConductor is not attached; call attach(blocks) first")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.blocks):
            raise IndexError(f"block index must be an int in [0, {len(self.blocks)}), got {index!r}")
        return self.blocks[index]

    def _check_after_layer_called(self, index: int, in_backward: bool) -> None:
        """Backward brings a block back only through the hooks after_layer puts on its outputs;
        without them it would run on whatever weights its slot holds by then."""
        awaiting = self._awaiting_after
        if awaiting is not None and awaiting != index:  # the same index: a retried forward
            self._warn_once(
                "after_layer",
                f"block {awaiting}'s forward got no after_layer({awaiting}, outputs) before block {index} was "
                "visited: backward will not load its weights again, so its gradients would be computed with "
                "another block's weights. Call after_layer after each block's forward (attach() with hooks=True "
                "does it for you)",
            )
        self._awaiting_after = index if not in_backward and torch.is_grad_enabled() else None

    def _upcoming(self, index: int) -> Iterator[int]:
        """The blocks expected after `index`, in order, for one round: ascending in forward; at
        the last block a training forward turns into backward (descending), an inference pass
        starts over; backward's end turns into the next forward."""
        n = len(self.blocks)
        if n < 2:
            return
        previous = self._previous
        training = torch.is_grad_enabled() or self.blocks[index].module.training
        for _ in range(n):
            if previous is not None and previous > index:
                following = index - 1 if index > 0 else 1
            elif index + 1 < n:
                following = index + 1
            else:
                following = n - 2 if training else 0
            yield following
            previous, index = index, following

    # ---- weights -----------------------------------------------------------------------

    def _load(self, block: _Block, prefetch: bool = False) -> None:
        """Start copying the block's weights to the GPU: into its slot, evicting the slot's block;
        int8: into the slot's staging buffer, and `_wait` dequantizes them into the slot."""
        if block in (self._occupant[block.slot], self._staged[block.slot]):
            return
        if self.offload_dtype == "int8":
            # The copy waits only for the last dequantize out of that buffer, not for the compute
            # of the slot's block (which may not have run yet): the copy engine gets up to two
            # blocks ahead of the compute, so it keeps going while the host is slower than a copy.
            replaced, self._staged[block.slot] = self._staged[block.slot], block
            if replaced is not None:
                replaced.loaded = None  # a prefetch that was never used
            target, after = self._staging[block.slot][: block.host_nbytes], self._staging_read[block.slot]
            self._copy(block.host, target, self._to_device, after, behind_compute=False)
        else:
            # Straight into the slot, behind the work enqueued so far (the previous occupant's).
            self._occupy(block)
            self._copy(block.host, self._slots[block.slot][: block.nbytes], self._to_device, None)
        if self._to_device is not None:
            block.loaded = self._to_device.record_event()
        self.counters["loads"] += 1
        self.counters["prefetched_loads"] += prefetch
        self.counters["bytes_to_device"] += block.host_nbytes

    def _occupy(self, block: _Block) -> None:
        """Give the block its slot: the slot's previous block points at its host copy again."""
        previous = self._occupant[block.slot]
        if previous is not None:
            previous.bind(previous.host_views)
            previous.loaded = None
        self._occupant[block.slot] = block
        block.bind(block.device_views)

    def _dequantize(self, block: _Block) -> None:
        staging, slot = self._staging[block.slot], self._slots[block.slot]
        if block.unquantized_end > ALIGN:
            slot[ALIGN : block.unquantized_end].copy_(staging[ALIGN : block.unquantized_end])
        block.int8(staging, slot)

    def _wait(self, block: _Block) -> None:
        """Order the compute stream after the block's copies; int8: dequantize it into its slot."""
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        for event in (block.loaded, block.activations_back):
            if event is not None:
                stream.wait_event(event)
        block.loaded = block.activations_back = None
        if block.streamed and self._staged[block.slot] is block:
            # On the compute stream, so after the slot's previous block has run.
            self._staged[block.slot] = None
            self._occupy(block)
            self._dequantize(block)
            if self._to_device is not None:
                self._staging_read[block.slot] = stream.record_event()

    # ---- activations -------------------------------------------------------------------

    def _visit_activations(self, block: _Block, inputs: Sequence[torch.Tensor], in_backward: bool) -> None:
        """Forward: offload what the previous block keeps for backward, except what this block
        shares; what the next-to-last block keeps stays: backward needs it first. Then note what
        this block keeps: inside a non-reentrant checkpoint its inputs, without a checkpoint what
        its forward saves. Backward: this block's tensors must be back before it reads them."""
        previous_kept, self._kept = self._kept, []
        previous_staying, self._kept_staying = self._kept_staying, set()
        if in_backward:
            self._bring_back(block)
            return
        if self._previous != block.index - 1 or block.index == len(self.blocks) - 1:
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
                    "(before_layer(i, inputs)); without them the activations stay on the GPU",
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
            return
        # Moved by storage: the tensors that share one, and the tensors they are views of, go
        # together. Storages this block reads stay, and so do those that must (see `_keep`).
        previous = self.blocks[self._previous]
        staying = previous_staying | {t.untyped_storage().data_ptr() for t in inputs}
        storages: dict[int, list[torch.Tensor]] = {}
        for tensor in (ref() for ref in previous_kept):
            if tensor is None:
                continue
            key = tensor.untyped_storage().data_ptr()
            if key in staying or not tensor.is_floating_point() or tensor.device != self.device:
                storages.pop(key, None)
                continue
            members = storages.setdefault(key, [])
            for alias in (tensor if tensor._base is None else tensor._base, tensor):
                if all(alias is not m for m in members):
                    members.append(alias)
        for members in storages.values():
            self._offload_storage(previous, members)
        if self._to_host is not None and previous.offloaded:
            previous.on_host = self._to_host.record_event()

    def _keep(
        self, inputs: Sequence[torch.Tensor], kept: Sequence[torch.Tensor], staying: Iterable[int] = ()
    ) -> None:
        """The block visited now keeps `kept` for its backward. Of those, the storages in
        `staying` and those behind an input that autograd did not make (the caller's tensor,
        whole or sliced by the model, a frozen layer's output) must stay: someone else holds them."""
        self._kept = [weakref.ref(t) for t in kept]
        self._kept_staying = set(staying) | {
            t.untyped_storage().data_ptr() for t in inputs if (t if t._base is None else t._base).grad_fn is None
        }

    def _start_saving(self, inputs: Sequence[torch.Tensor]) -> None:
        """Note the tensors the block's compiled regions save for backward, until after_layer
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

    def _stop_saving(self) -> _Saving | None:
        """End `_start_saving`'s hooks, if on (on the thread that started them)."""
        saving = self._saving
        if saving is None or saving.thread != threading.get_ident():
            return None
        self._saving = None
        saving.hooks.__exit__(None, None, None)
        return saving

    def _keep_saved(self, block: _Block, saving: _Saving, outputs: Sequence[torch.Tensor]) -> None:
        """What the block's compiled regions saved, except storages others read: its outputs
        (the model may use them before backward), its parameters, buffers and tensor attributes."""
        if saving.eager_saves[0] and not saving.saved:
            self._warn_once(
                "eager",
                f"block {block.name} runs eager without a checkpoint: activation_offload moves what compiled "
                "blocks save and the inputs of checkpointed ones, so the activations of such blocks stay on the GPU",
            )
        owned = [*block.module.parameters(), *block.module.buffers()]
        owned += [v for m in block.module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
        staying = {t.untyped_storage().data_ptr() for t in (*owned, *outputs)}
        self._keep(saving.inputs, [t for t in (ref() for ref in saving.saved) if t is not None], staying)

    def _offload_storage(self, block: _Block, members: list[torch.Tensor]) -> None:
        source = _storage_bytes(members[0])
        nbytes = source.numel()
        if nbytes < MIN_ACTIVATION_BYTES:
            return
        buffer = self._take_buffer(block, nbytes)
        host = buffer[ALIGN : ALIGN + nbytes]
        # A reused buffer is written once the last step's copy back out of it is done.
        self._copy(source, host, self._to_host, block.buffers_read)
        stored = _OffloadedStorage(
            [(weakref.ref(t), t.dtype, t.shape, t.stride(), t.storage_offset()) for t in members], buffer, nbytes
        )
        stored.point_at(host)
        block.offloaded.append(stored)
        self._host_owner[buffer.untyped_storage().data_ptr()] = block
        self.counters["activation_bytes_offloaded"] += nbytes

    def _take_buffer(self, block: _Block, nbytes: int) -> torch.Tensor:
        """A host buffer of at least `nbytes` (after the ALIGN lead) from the block's free ones."""
        for i, buffer in enumerate(block.free_buffers):
            if buffer.numel() >= nbytes + ALIGN:
                return block.free_buffers.pop(i)
        return self._host_empty(_aligned(nbytes) + ALIGN)

    def _copy(
        self,
        source: torch.Tensor,
        target: torch.Tensor,
        stream: torch.cuda.Stream | None,
        after: torch.cuda.Event | None,
        behind_compute: bool = True,
    ) -> None:
        """target <- source on `stream`, behind `after` and (unless told otherwise) the compute
        enqueued so far."""
        if stream is None:
            target.copy_(source)
        else:
            ready = torch.cuda.current_stream(self.device).record_event() if behind_compute else None
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                if after is not None:
                    stream.wait_event(after)
                target.copy_(source, non_blocking=self.pin_memory)
                # GPU memory that dies before the copy is done is reused only after it.
                for tensor in (source, target):
                    if tensor.is_cuda:
                        tensor.record_stream(stream)

    def _bring_back(self, block: _Block, prefetch: bool = False) -> None:
        """Copy the block's offloaded tensors back to the GPU; unless `prefetch`, the compute
        stream waits for them."""
        if not block.offloaded:
            return
        for stored in block.offloaded:
            if not stored.alive():
                continue
            target = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
            self._copy(stored.buffer[ALIGN : ALIGN + stored.nbytes], target, self._to_device, block.on_host)
            stored.point_at(target)
        # The buffers are free once the copies out of them are done (`buffers_read`).
        for stored in block.offloaded:
            del self._host_owner[stored.buffer.untyped_storage().data_ptr()]
        block.free_buffers += [stored.buffer for stored in block.offloaded]
        block.offloaded = []
        block.on_host = None
        if self._to_device is not None:
            block.buffers_read = block.activations_back = self._to_device.record_event()
            if not prefetch:
                torch.cuda.current_stream(self.device).wait_event(block.activations_back)
                block.activations_back = None

    # ---- reporting ---------------------------------------------------------------------

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def stats(self) -> dict[str, Any]:
        """Layout and cumulative transfer counters (diff two calls for per-step figures)."""
        streamed = [b for b in self.blocks if b.streamed]
        return {
            "blocks": len(self.blocks),
            "streamed_blocks": len(streamed),
            "slots": len(self._slots),
            "host_bytes": sum(b.host_nbytes for b in streamed),
            "slot_bytes": sum(s.numel() for s in (*self._slots, *self._staging)),
            "pinned": self.pin_memory,
            "offload_dtype": self.offload_dtype,
            **self.counters,
        }

    def resident_streamed_blocks(self) -> list[int]:
        """Indices of streamed blocks whose weights are in a GPU slot now."""
        return [b.index for b in self._occupant if b is not None]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    def __repr__(self) -> str:
        streamed = sum(b.streamed for b in self.blocks)
        return (
            f"LayerOffloadConductor(offload_fraction={self.offload_fraction}, device={self.device}, "
            f"blocks={len(self.blocks)}, streamed={streamed}, offload_dtype={self.offload_dtype!r})"
        )


def _check_fraction(offload_fraction: Any) -> None:
    if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, numbers.Real):
        raise ValueError(f"offload_fraction must be a number in [0.0, 1.0], got {offload_fraction!r}")
    if not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"offload_fraction must be in [0.0, 1.0], got {offload_fraction!r}")


def offload_fraction_ladder(blocks: Iterable[nn.Module]) -> OffloadLadder | None:
    """The offload ladder of the conductor attached to `blocks` (from its offload_fraction up to
    streaming every block), or None when no conductor holds them."""
    conductor = next(filter(None, map(_owner, blocks)), None)
    if conductor is None:
        return None
    levels = spaced_levels(conductor.offload_fraction, 1.0)
    return OffloadLadder("offload_fraction", levels, conductor.set_offload_fraction)


def _spread_resident(sizes: list[int], count: int) -> set[int]:
    """Which `count` blocks stay on the GPU: the smallest (fewest bytes), and among blocks of one
    size evenly spread over the execution order, so that copies keep going while they compute."""
    resident: set[int] = set()
    for size in sorted(set(sizes)):
        need = count - len(resident)
        if need <= 0:
            break
        members = [i for i, s in enumerate(sizes) if s == size]
        resident.update(
            members
            if len(members) <= need
            else (members[(2 * k + 1) * len(members) // (2 * need)] for k in range(need))
        )
    return resident


def _tensors(values: Any) -> list[torch.Tensor]:
    """Every tensor in `values`, nested in tuples, lists and dicts too (Flux's blocks take their
    rotary tables as a tuple)."""
    return [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]


def _owner(module: nn.Module) -> LayerOffloadConductor | None:
    """The attached conductor that holds `module`, a module in it, or one of its parameters."""
    ids = {id(t) for t in (*module.modules(), *module.parameters())}
    return next((c for c in _ATTACHED if not ids.isdisjoint(c._owned)), None)


def _named_blocks(blocks: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(name, block) in execution order from a model, a ModuleList, or a list of either."""
    if isinstance(blocks, nn.ModuleList):
        blocks = list(blocks)
    elif isinstance(blocks, nn.Module):
        return [named for block_list in resolve_block_lists(blocks, None) for named in block_list.named_blocks()]
    named: list[tuple[str, nn.Module]] = []
    for i, item in enumerate(blocks):
        if isinstance(item, nn.ModuleList):
            named += [(f"{i}.{j}", b) for j, b in enumerate(item)]
        elif isinstance(item, nn.Module):
            named.append((str(i), item))
        else:
            raise TypeError(f"attach() takes modules or ModuleLists, got {type(item).__name__} at position {i}")
    if not named:
        raise ValueError("attach() got no blocks")
    if len({id(m) for _, m in named}) != len(named):
        raise ValueError("attach() got the same block twice")
    return named
