"""BlockOffloadConductor: set-up, visit order, and the hooks that drive the weight slots and the
activation offload around each block call.

How it composes with compiled blocks: the conductor works in forward hooks on the block
modules, which run in `nn.Module.__call__` around the (compiled) forward, so dynamo never sees
it: no graph break, `fullgraph=True` possible.

Order and overlap: each block call is a visit. The conductor predicts the next visit from the
direction of the last two (forward ascends; with checkpointing, backward recomputes blocks in
descending order) and starts copying the next streamed block on a side stream while the
current block computes (from a resident block the next two, both slots being free then; in
int8 mode always two), so that the copy stream does not idle through the resident blocks'
compute (benchmarks/results/h200_flux_offload/README.md). A wrong guess
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
"""

from __future__ import annotations

import logging
import numbers
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from ..auto_budget import OffloadLadder, spaced_levels
from ..blocks import resolve_block_lists
from ..int8_weight import dequantize
from ..stats import warn
from .activations import ActivationOffload
from .layout import BlockWeights, spread_resident
from .slots import SLOTS, Slots
from .transfers import Transfers

logger = logging.getLogger("compile_accel")

OFFLOAD_DTYPES = (None, "int8")
# Conductors attached now: attach() refuses blocks that share a module or parameter with one.
_ATTACHED: weakref.WeakSet[BlockOffloadConductor] = weakref.WeakSet()


class BlockOffloadConductor:
    """Keeps a fraction of a model's blocks in host memory and streams them to the GPU.

    offload_fraction: share of the blocks (by count) that live in host memory; 0.0 keeps all
        on the GPU, 1.0 streams all. The ones that stay are the smallest, spread evenly.
    device: the compute device (default: the current CUDA device). "cpu" runs the same
        bookkeeping with plain copies, for tests and debugging.
    async_transfers: copy on a side CUDA stream, the next blocks while the current computes
        (in forward and in backward's reverse order); False copies on the compute stream.
    activation_offload: move what each block keeps for backward to host memory between its
        forward and its backward: its inputs under non-reentrant checkpointing, the tensors its
        forward saves without checkpointing (see `activations.py`).
    offload_dtype: None streams the weights as they are; "int8" stores and sends streamed
        weight matrices as per-row int8 + scale and dequantizes them on the GPU (lossy), but for
        the base Linear weights of blocks compiled with base_compute="int8" (apply() before
        attach()), which stay int8 and are multiplied as they are (`layout.py`).
    pin_memory: keep host copies in page-locked memory (allocated once, reused every step);
        if pinning fails the conductor warns and uses pageable memory.

    Use `attach(blocks)` (hooks on each block) or `attach(blocks, hooks=False)` and call
    `before_block(i, inputs)` / `after_block(i, outputs)` around block i yourself. `remove()`
    undoes it.

    While attached, a streamed block's frozen parameters are views of its slot (when loaded) or
    of host memory (when not); in int8 mode an unloaded one reads as zeros (an Int8Weight: as
    its host copy's values). Trainable parameters
    are never touched, so saving LoRA weights is safe; for the base weights call `remove()` first.
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
                    "BlockOffloadConductor streams blocks to a CUDA device, but CUDA is not available "
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
        self._transfers = Transfers(device, self.async_transfers, pin_memory and self.cuda)
        self._slots = Slots(self._transfers, offload_dtype == "int8")
        self._activations = ActivationOffload(self._transfers)
        self.blocks: list[BlockWeights] = []
        self._attached_as: tuple[nn.Module | Sequence[nn.Module], bool] | None = None  # attach()'s arguments
        self._hooks: list[RemovableHandle] = []
        # Parameters' and buffers' device at attach, and the frozen weights' layout (strides) as
        # a meta tensor: remove() gives each back in the layout it had.
        self._original_devices: dict[int, torch.device] = {}
        self._original_layouts: dict[int, torch.Tensor] = {}
        # Bumped by attach() and remove(): a gradient hook from an earlier attach refuses to run.
        self._generation = 0
        self._awaiting_after: int | None = None  # a block's forward visit under grad, until its after_block
        self._warned_no_after_block = False
        self._owned: set[int] = set()  # ids of the attached blocks' modules and parameters
        self._last: int | None = None  # index of the block visited last, and the one before
        self._previous: int | None = None
        self._last_in_backward = False
        self.counters = {
            "loads": 0,
            "prefetched_loads": 0,
            "bytes_to_device": 0,
            "activation_bytes_offloaded": 0,
        }

    @property
    def pin_memory(self) -> bool:
        """Host copies are page-locked (False after pinning failed)."""
        return self._transfers.pin_memory

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        self._transfers.pin_memory = value

    # ---- setup -------------------------------------------------------------------------

    def attach(self, blocks: nn.Module | Sequence[nn.Module], hooks: bool = True) -> BlockOffloadConductor:
        """Take over the blocks' frozen weights (execution order; a model, a ModuleList or a list
        of blocks/ModuleLists). Raises before anything moves when the input is wrong or memory
        cannot be allocated."""
        if self.blocks:
            raise RuntimeError("this BlockOffloadConductor is already attached; remove() it first")
        named = _named_blocks(blocks)
        for name, module in named:
            owner = _owner(module)
            if owner is not None:
                raise RuntimeError(
                    f"block {name} (or a module in it or around it) is already attached to "
                    f"{'this' if owner is self else 'another'} BlockOffloadConductor; remove() that first"
                )
        self._check_devices(named)
        plan = [BlockWeights(i, name, module, self.offload_dtype == "int8") for i, (name, module) in enumerate(named)]
        seen: dict[int, str] = {}
        for block in plan:
            for p in block.frozen:
                if id(p) in seen:
                    raise ValueError(f"parameter shared by blocks {seen[id(p)]} and {block.name}; cannot offload it")
                seen[id(p)] = block.name
        streamed = int(self.offload_fraction * len(plan) + 0.5)
        resident = spread_resident([b.nbytes for b in plan], len(plan) - streamed)
        for k, block in enumerate(b for b in plan if b.index not in resident):
            block.stream(k % SLOTS)
        start = time.perf_counter()
        host_gib = sum(b.host_nbytes for b in plan if b.streamed) / 2**30
        logger.info("offload: %d of %d blocks to host memory (%.2f GiB)", streamed, len(plan), host_gib)
        self._slots.allocate(plan)  # may raise; nothing has moved yet

        # From here on the model changes; a failure (out of memory while copying) puts it back.
        originals = {id(t): t.data for block in plan for t in (*block.module.parameters(), *block.module.buffers())}
        try:
            for block in plan:
                self._original_devices.update({id(t): t.device for t in (*block.frozen, *block.others)})
                self._original_layouts.update({id(p): torch.empty_like(p.data, device="meta") for p in block.frozen})
                for tensor in block.others:
                    tensor.data = tensor.data.to(self.device)
                self._slots.place(block)
        except BaseException:
            for block in plan:
                block.release_held()
                for tensor in (*block.module.parameters(), *block.module.buffers()):
                    tensor.data = originals[id(tensor)]
            self._slots.clear()
            self._original_devices, self._original_layouts = {}, {}
            raise
        self.blocks = plan
        self._activations.attach(named)
        self._attached_as = (blocks, hooks)
        # (the frozen parameters as attach() found them: a held one's stands aside while attached)
        owned = (t for block in plan for t in (*block.module.modules(), *block.module.parameters(), *block.frozen))
        self._owned = {id(t) for t in owned}
        _ATTACHED.add(self)
        self._generation += 1
        if hooks:
            for block in plan:
                self._hooks.append(
                    block.module.register_forward_pre_hook(self._pre_hook(block.index), with_kwargs=True)
                )
                # always_call: a forward that raises still ends the saved-tensor hooks.
                self._hooks.append(block.module.register_forward_hook(self._post_hook(block.index), always_call=True))
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

    def remove(self) -> None:
        """Remove the hooks and give every parameter a standalone copy on the device it had at
        attach (dequantized values in int8 mode)."""
        if not self.blocks:
            return
        self.synchronize()
        for hook in self._hooks:
            hook.remove()
        for block in self.blocks:
            self._activations.bring_back(block.index)
            if block.streamed:
                self._load(block)
                self._wait(block)
                self._slots.release(block)  # restored below
            for entry, view in zip(block.entries, block.device_views, strict=True):
                layout = self._original_layouts[id(entry.param)]
                if entry.held_as is not None:
                    view = dequantize(*view, entry.param.dtype)
                entry.param.data = torch.empty_like(layout, device=self._original_devices[id(entry.param)]).copy_(view)
            block.release_held()
            for tensor in block.others:
                tensor.data = tensor.data.to(self._original_devices[id(tensor)])
        _ATTACHED.discard(self)
        self._owned = set()
        self.synchronize()
        self._activations.remove()
        self._slots.clear()
        self._generation += 1
        self._original_devices, self._original_layouts, self._awaiting_after = {}, {}, None
        self.blocks, self._hooks = [], []
        self._last = self._previous = None

    def set_offload_fraction(self, offload_fraction: float) -> None:
        """Stream another share of the blocks: remove, then attach the same blocks again (between
        steps, never inside a forward). activation_memory_budget="auto" turns this when no budget
        fits. Removing puts the weights where they were at attach: attach from the CPU when the
        GPU cannot hold them all."""
        _check_fraction(offload_fraction)
        attached_as = self._attached_as if self.blocks else None
        self.remove()
        self.offload_fraction = float(offload_fraction)
        if attached_as is not None:
            self.attach(*attached_as)

    # ---- per visit ---------------------------------------------------------------------

    def _pre_hook(self, index: int) -> Callable[[nn.Module, tuple, dict], None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.before_block(index, (args, kwargs))  # before_block takes the tensors out

        return hook

    def _post_hook(self, index: int) -> Callable[[nn.Module, tuple, Any], None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.after_block(index, output)

        return hook

    def before_block(self, index: int, inputs: Any = ()) -> None:
        """Make block `index` resident before it runs and start copying the next one.
        `inputs`: every tensor the block reads from its arguments, as a tensor or a (nested)
        tuple, list or dict (activation_offload keeps those the caller holds, and what the next
        block reads, on the GPU: pass them)."""
        block = self._block(index)
        inputs = _tensors(inputs)
        in_backward = torch._C._current_graph_task_id() != -1
        self._activations.stop_saving()  # a forward that raised before its after_block
        self._check_after_block_called(index, in_backward)
        if in_backward and (self._last, self._last_in_backward) == (index, True):
            self._wait(block)  # the same visit again (a recompute after the gradient hook's visit)
            return
        # In forward a block called again is a new visit: its forward raised and is retried, or the
        # model calls it twice in a row; what the first call kept is dropped with its graph.
        self._previous, self._last, self._last_in_backward = self._last, index, in_backward
        if self.activation_offload:
            moved = self._activations.before_block(index, inputs, in_backward, self._previous)
            self.counters["activation_bytes_offloaded"] += moved
        if block.streamed:
            self._load(block)
        self._wait(block)
        upcoming = list(self._upcoming(index))
        if in_backward and self.activation_offload and upcoming:
            self._activations.bring_back(upcoming[0], prefetch=True)
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

    def after_block(self, index: int, outputs: Any = ()) -> None:
        """Block `index` has run its forward and returned `outputs` (a tensor or a nested tuple,
        list or dict): when backward reaches them, the block is visited (loaded) again before
        any of its backward runs. With activation_offload and no checkpoint, this ends the
        noting of what its forward saved."""
        self._block(index)
        outputs = _tensors(outputs)
        self._awaiting_after = None
        self._activations.after_block(index, outputs)
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        for tensor in outputs:
            if tensor.requires_grad:
                tensor.register_hook(self._backward_visit(index))

    def _backward_visit(self, index: int) -> Callable[[torch.Tensor], None]:
        generation = self._generation

        def hook(grad: torch.Tensor) -> None:
            if generation != self._generation:
                raise RuntimeError(
                    f"backward reached the output of block {index} from a forward run before this "
                    "BlockOffloadConductor's remove() (or a later attach()): its weights are gone from where "
                    "autograd saved them. Run backward before remove(), or run the forward again"
                )
            self.before_block(index)

        return hook

    def _block(self, index: int) -> BlockWeights:
        if not self.blocks:
            raise RuntimeError("this BlockOffloadConductor is not attached; call attach(blocks) first")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.blocks):
            raise IndexError(f"block index must be an int in [0, {len(self.blocks)}), got {index!r}")
        return self.blocks[index]

    def _check_after_block_called(self, index: int, in_backward: bool) -> None:
        """Backward brings a block back only through the hooks after_block puts on its outputs;
        without them it would run on whatever weights its slot holds by then."""
        awaiting = self._awaiting_after
        # The same index: a retried forward.
        if awaiting is not None and awaiting != index and not self._warned_no_after_block:
            self._warned_no_after_block = True
            warn(
                f"block {awaiting}'s forward got no after_block({awaiting}, outputs) before block {index} was "
                "visited: backward will not load its weights again, so its gradients would be computed with "
                "another block's weights. Call after_block after each block's forward (attach() with hooks=True "
                "does it for you)"
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

    def bring_in(self, module: nn.Module) -> None:
        """Load the streamed block that holds `module` (itself or a module inside it) into its
        slot now, as its next call would; the next load into that slot evicts it as usual."""
        block = next((b for b in self.blocks if any(m is module for m in b.module.modules())), None)
        if block is not None and block.streamed:
            self._load(block)
            self._wait(block)

    def _load(self, block: BlockWeights, prefetch: bool = False) -> None:
        """Start copying the block's weights to the GPU (see `Slots.load`), and count the copy."""
        if self._slots.load(block):
            self.counters["loads"] += 1
            self.counters["prefetched_loads"] += prefetch
            self.counters["bytes_to_device"] += block.host_nbytes

    def _wait(self, block: BlockWeights) -> None:
        """Order the compute stream after the copies the block reads (its activations coming back,
        its weights); int8: dequantize the weights into the slot."""
        self._activations.wait(block.index)
        self._slots.wait(block)

    # ---- reporting ---------------------------------------------------------------------

    def synchronize(self) -> None:
        self._transfers.synchronize()

    def stats(self) -> dict[str, Any]:
        """Layout and cumulative transfer counters (diff two calls for per-step figures)."""
        streamed = [b for b in self.blocks if b.streamed]
        return {
            "blocks": len(self.blocks),
            "streamed_blocks": len(streamed),
            "slots": len(self._slots.buffers),
            "host_bytes": sum(b.host_nbytes for b in streamed),
            "slot_bytes": self._slots.nbytes(),
            "pinned": self.pin_memory,
            "offload_dtype": self.offload_dtype,
            **self.counters,
        }

    def resident_streamed_blocks(self) -> list[int]:
        """Indices of streamed blocks whose weights are in a GPU slot now."""
        return self._slots.held()

    def __repr__(self) -> str:
        streamed = sum(b.streamed for b in self.blocks)
        return (
            f"BlockOffloadConductor(offload_fraction={self.offload_fraction}, device={self.device}, "
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


def weights_on_device(module: nn.Module) -> None:
    """Put `module`'s weights where its calls find them: a block (or a module inside one) that a
    conductor streams is loaded into its slot; between its calls its weights point at their host
    copy, and a trace of it outside its calls (compile_accel.precompile's capture, after a step)
    would see them there. Any other module is left as it is."""
    conductor = _owner(module)
    if conductor is not None:
        conductor.bring_in(module)


def _tensors(values: Any) -> list[torch.Tensor]:
    """Every tensor in `values`, nested in tuples, lists and dicts too (Flux's blocks take their
    rotary tables as a tuple)."""
    return [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]


def _owner(module: nn.Module) -> BlockOffloadConductor | None:
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
