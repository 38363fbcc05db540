"""The tensors a region's compiled graph is called with: one layout and one requires_grad pattern
for every block of a class, so that the blocks share one graph.

Layout: strided inputs (Flux's single blocks get slices of a concatenated tensor) are copied
contiguous; boolean broadcast masks keep their stride-0 layout (the values repeat). Views are
passed as plain tensors: dynamo guards a view's base, which recompiles a dynamic graph for a
later non-view input (sd-scripts' Lumina 2).

requires_grad, in training: a block's stream inputs (the hidden states blocks pass on) come with
grad from every block but the first, which frozen embedders feed; they are marked as requiring
grad in every call, so the first block runs the others' graph (its input gradient is computed and
dropped). The model's conditioning (the timestep embedding, rotary tables, a text embedding nothing
trains), handed to every block as the same tensor, keeps the caller's requires_grad: marked too,
every block computed gradients through its modulation into a tensor nothing trains, and for the
gates the partitioner kept or recomputed what only their gradient needs (sd-scripts' Anima as a
4090: 9% of the step, benchmarks/results/h200_gpu_like_rtx4090/README.md).

Which inputs are conditioning is seen once per block class and call signature (`SharedInputs`):
the first call of a class with several blocks runs eager, and the first call of another block of
it compares its tensors with that call's.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn as nn

from .checkpointing import under_saved_tensor_checkpoint

# A tensor input's place in a call: its position, or its keyword.
Slot = int | str


def _tensor_slots(args: tuple, kwargs: dict) -> dict[Slot, torch.Tensor]:
    slots: dict[Slot, Any] = {**dict(enumerate(args)), **kwargs}
    return {slot: value for slot, value in slots.items() if isinstance(value, torch.Tensor)}


class SharedInputs:
    """Per block class and call signature, the slots whose tensor every block of the class is
    given as the same tensor (its conditioning). `slots` is None until known: then the caller
    runs the call eager, and the next call of another block of the class decides."""

    def __init__(self) -> None:
        self._known: dict[tuple, frozenset[Slot]] = {}
        # The first call of each undecided key: its module and weak references to its tensors.
        self._first: dict[tuple, tuple[weakref.ref, dict[Slot, weakref.ref]]] = {}
        # Modules whose first call ran eager, until their next call outside a backward.
        self._ran_eager: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def ran_eager(self, module: nn.Module) -> bool:
        """Whether `module`'s last call was its class's first, run eager."""
        return module in self._ran_eager

    def repeats_eager_call(self, module: nn.Module) -> bool:
        """Whether this call is a trainer's non-reentrant checkpoint recomputing, in the backward,
        a first call that ran eager: it must run eager again (such a checkpoint checks that its
        recompute saves the tensors its forward saved; a reentrant one runs a forward of its own)."""
        if module not in self._ran_eager:
            return False
        if torch._C._current_graph_task_id() != -1 and under_saved_tensor_checkpoint():
            return True
        self._ran_eager.discard(module)
        return False

    def slots(
        self, module: nn.Module, instances: Callable[[], int], args: tuple, kwargs: dict
    ) -> frozenset[Slot] | None:
        """The shared slots for this training call of `module`, one of `instances()` blocks of
        its class (asked until the slots are known); None for the class's first call (run it eager)."""
        key = (type(module), len(args), tuple(kwargs))
        known = self._known.get(key)
        if known is not None:
            return known
        tensors = _tensor_slots(args, kwargs)
        first = self._first.get(key)
        if instances() < 2 or (first is not None and first[0]() is module):
            # One block (or one of a signature): the same caller each step, its pattern as it is.
            known = frozenset(tensors)
        elif first is None:
            self._first[key] = (weakref.ref(module), {slot: weakref.ref(t) for slot, t in tensors.items()})
            self._ran_eager.add(module)
            return None
        else:
            known = frozenset(slot for slot, t in tensors.items() if slot in first[1] and first[1][slot]() is t)
            del self._first[key]
        self._known[key] = known
        return known


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _is_broadcast_mask(value: torch.Tensor) -> bool:
    return value.dtype == torch.bool and any(
        stride == 0 and size > 1 for stride, size in zip(value.stride(), value.shape)
    )


class _NotAView(torch.autograd.Function):
    """The same tensor (storage, layout, gradient), no longer marked as a view of another."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def canonical_inputs(
    args: tuple, kwargs: dict, training: bool, shared: frozenset[Slot] = frozenset()
) -> tuple[tuple, dict, list[tuple[torch.Tensor, int]]]:
    """The call's inputs as the module docstring says (`shared`: the conditioning's slots, which
    keep the caller's requires_grad), and the aliased views with their versions, for the caller
    to check after the call (`check_aliased_views`)."""

    aliased_views = []
    done: dict[int, torch.Tensor] = {}  # by id: a tensor given in two slots stays one tensor

    def canonical(slot: Slot, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in done:
            done[id(value)] = _canonical(slot, value)
        return done[id(value)]

    def _canonical(slot: Slot, value: torch.Tensor) -> torch.Tensor:
        if (
            value.stride() != _contiguous_strides(value.shape)
            and not value.is_contiguous(memory_format=torch.channels_last)
            and not _is_broadcast_mask(value)
        ):
            copy = value.clone(memory_format=torch.contiguous_format)
            aliased_views.append((copy, copy._version))  # an in-place change would not reach `value`
            value = copy
        if value.requires_grad and torch.is_grad_enabled():  # (without grad, one graph whatever they are)
            if not value._is_view():
                return value
            alias = _NotAView.apply(value)
            aliased_views.append((alias, alias._version))
            return alias
        if training and value.is_floating_point() and slot not in shared:
            # Not a leaf, so an in-place change in the block is allowed as in eager (same storage).
            return _NotAView.apply(value.detach().requires_grad_(True))
        return value.detach()

    args = tuple(canonical(slot, v) for slot, v in enumerate(args))
    kwargs = {k: canonical(k, v) for k, v in kwargs.items()}
    return args, kwargs, aliased_views


def check_aliased_views(name: str, aliased_views: list[tuple[torch.Tensor, int]]) -> None:
    if any(alias._version != version for alias, version in aliased_views):
        raise RuntimeError(
            f"compile_accel: {name} changed a view or non-contiguous input in place; compiled regions get "
            "such inputs as plain (or copied) tensors, so the change or its base's gradient would be lost. "
            "Leave the module eager (CompileConfig.exclude)."
        )
