"""Saved activation bytes (what a CPU has instead of a peak-memory counter), the GiB amounts
command lines take, and the GPU's dedicated memory, past which Windows' driver spills."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

import torch

from .int8_weight import plain_tensors


class SavedActivationMeter:
    """Bytes autograd keeps for backward while the block is active.

    Counted per storage, so views of one tensor count once; parameters (saved by every
    Linear) are left out. Checkpoint inputs are seen too: both checkpoint flavours save them
    through `save_for_backward` outside their own hooks.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._skip = {t.untyped_storage().data_ptr() for p in parameters for t in plain_tensors(p)}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for plain in plain_tensors(tensor):  # (an eager Linear saves a streamed Int8Weight)
            storage = plain.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._skip and ptr not in self._seen:
                self._seen.add(ptr)
                self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def gib_argument(text: str) -> float:
    """argparse type of a memory amount: a finite number of GiB above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of GiB > 0, got {text!r}")
    return value


GIB = 2**30


def dedicated_bytes(device: torch.device) -> int:
    """The GPU memory the driver reports for `device`. Past it, Windows' driver (its "CUDA
    sysmem fallback", on by default) keeps allocations in shared system memory instead of failing
    them: a step that spills runs 50-100x slower (kohya_ss issues 1524 and 1730: 73-200 s/it
    instead of ~1.2) where elsewhere it would raise out-of-memory."""
    return torch.cuda.get_device_properties(device).total_memory


def spill_warning(device: torch.device, fix: str) -> str | None:
    """What to tell a user whose process reserved more than `device`'s dedicated memory (the
    condition under which Windows' driver spills), with `fix`, the flag that keeps it under; None
    when it did not. Costs no synchronization."""
    reserved, dedicated = torch.cuda.memory_reserved(device), dedicated_bytes(device)
    if reserved <= dedicated:
        return None
    return (
        f"this process reserved {reserved / GIB:.1f} GiB of GPU memory, more than the {dedicated / GIB:.1f} GiB "
        f"the GPU has: Windows' driver keeps the rest in shared system memory, where steps run 50-100x slower "
        f"(elsewhere this is an out-of-memory error); {fix}"
    )
