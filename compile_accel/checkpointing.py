"""The model's own gradient checkpointing: switched off for blocks that get a memory budget,
and traced into selective mode's graph of a body that torch's checkpoint calls.

A checkpoint inside (or around) a budgeted block makes the partitioner's choice moot: it
discards every activation and recomputes the whole block. Trainers switch checkpointing with
a `gradient_checkpointing` flag, either on each block (kohya sd-scripts' mixins) or on the
module that loops over the blocks (diffusers models); both are turned off here and put back
by `Acceleration.remove()`.

Selective mode compiles the body a block hands to its checkpoint (compile_accel.selective). Run
inside torch's eager checkpoint, that compiled body saves its activations for the checkpoint to
discard, and the backward runs the whole compiled forward again. Where torch's non-reentrant
checkpoint itself calls the body (`checkpoint(self._forward, ...)`: sd-scripts' Flux, SD3,
Lumina 2, Anima), the region runs `traced_checkpoint(body)` instead, in which dynamo traces the
checkpoint as it does inside a torch.compile'd block: the partitioner saves the body's inputs and
recomputes in the backward only what the backward needs. It runs with the eager checkpoint's
saved-tensor hooks off (`past_the_checkpoint`), so that checkpoint has nothing to recompute and
what the graph saves (the inputs it holds) goes where a compiled block's saves go: to an
activation offloader's hooks, or kept as they are. A body reached through a wrapper of the trainer's
(sd-scripts' CPU-offload checkpointing, which moves the inputs to the GPU and the outputs to the
host; Anima's unsloth offload), a checkpoint with a selective policy (`context_fn`) or a reentrant
one (SDXL's U-Net: compile_accel.selective compiles its forward instead) runs as before.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from .blocks import BlockList

logger = logging.getLogger("compile_accel")


@dataclass
class CheckpointSwitch:
    name: str
    module: nn.Module

    def turn_off(self) -> None:
        self.module.gradient_checkpointing = False

    def restore(self) -> None:
        self.module.gradient_checkpointing = True


def _ancestors(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    parts = path.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts))]
    return [(prefix or type(model).__name__, model.get_submodule(prefix)) for prefix in prefixes]


def find_checkpoint_switches(
    model: nn.Module, block_lists: list[BlockList], compiled: set[str]
) -> tuple[list[CheckpointSwitch], list[str]]:
    """The `gradient_checkpointing` flags that are True on a compiled block (named in `compiled`),
    on a module inside it, or on a module above its block list; and the blocks left uncompiled that one of those
    flags above them governs too, which lose their checkpointing with it."""
    switches: dict[int, CheckpointSwitch] = {}
    governed: dict[int, list[str]] = {}  # id(module above block lists) -> their blocks' names
    for block_list in block_lists:
        blocks = block_list.named_blocks()
        for name, module in _ancestors(model, block_list.path):
            if getattr(module, "gradient_checkpointing", None) is True:
                governed.setdefault(id(module), []).extend(n for n, _ in blocks)
                if any(n in compiled for n, _ in blocks):
                    switches.setdefault(id(module), CheckpointSwitch(name, module))
        for name, block in blocks:
            if name not in compiled:
                continue
            # The block's own flag, or one inside it (a U-Net's Transformer2DModel checkpoints
            # each of its transformer blocks).
            for sub_name, module in block.named_modules(prefix=name):
                if getattr(module, "gradient_checkpointing", None) is True:
                    switches.setdefault(id(module), CheckpointSwitch(sub_name, module))
    uncompiled = [n for key in switches if key in governed for n in governed[key] if n not in compiled]
    return list(switches.values()), list(dict.fromkeys(uncompiled))


def turn_off(switches: list[CheckpointSwitch]) -> None:
    for switch in switches:
        switch.turn_off()
    if switches:
        logger.info(
            "activation memory budget replaces checkpointing: turned gradient_checkpointing off on %s",
            ", ".join(s.name for s in switches),
        )


def under_saved_tensor_checkpoint() -> bool:
    """True inside a non-reentrant torch.utils.checkpoint region (its saved-tensor hooks are on)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = hooks[0] if hooks else None
    return pack is not None and getattr(pack, "__module__", None) == "torch.utils.checkpoint"


_TORCH_CHECKPOINT_CODE = inspect.unwrap(checkpoint).__code__


def called_by_torch_checkpoint(caller: FrameType) -> bool:
    """True when `caller` is torch.utils.checkpoint.checkpoint itself running its function
    non-reentrant, not a wrapper of the trainer's around the function, and without a selective
    checkpoint policy (`context_fn`), which the traced checkpoint would not keep."""
    return (
        caller.f_code is _TORCH_CHECKPOINT_CODE
        and under_saved_tensor_checkpoint()
        and caller.f_locals.get("context_fn") is noop_context_fn
    )


def traced_checkpoint(body: Callable) -> Callable:
    """`body` under torch's non-reentrant checkpoint, for dynamo to trace. Named after `body`,
    its code object too: compile_accel.precompile keeps graphs by name, and dynamo names a
    function by its code's name (with file and line) where it hits the recompile limit."""

    def under_checkpoint(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(body, *args, use_reentrant=False, **kwargs)

    name = f"{body.__qualname__} under its checkpoint"
    under_checkpoint.__code__ = under_checkpoint.__code__.replace(co_name=name)
    under_checkpoint.__module__, under_checkpoint.__qualname__ = body.__module__, name
    return under_checkpoint


@contextlib.contextmanager
def past_the_checkpoint() -> Iterator[None]:
    """Inside torch's eager checkpoint (under_saved_tensor_checkpoint): its saved-tensor hooks off
    the stack meanwhile, so that what is saved inside goes to the hooks beneath, as from a
    checkpoint traced in a compiled block (an activation offloader's, `save_on_cpu`'s, or none)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        torch._C._autograd._push_saved_tensors_default_hooks(*hooks)


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    # Detached: a saved output kept as itself holds its own grad_fn, a cycle through autograd's
    # C++ graph that Python's gc never collects. A graph dropped without its backward (the accuracy
    # check's run of a block without LoRA) then stayed in memory for good: 0.39 GiB on SDXL.
    return tensor.detach()


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def keep_saved_tensors() -> torch.autograd.graph.saved_tensors_hooks:
    """Tensors saved inside stay with what saved them, out of an eager checkpoint's reach."""
    return torch.autograd.graph.saved_tensors_hooks(_kept, _unpacked)
