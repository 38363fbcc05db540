"""Measuring a candidate: seconds and peak bytes of one step, and the memory auto may use."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .. import compile_workers
from ..memory import GIB, SavedActivationMeter, dedicated_bytes
from ..stats import Stats
from .search import Waiting


def default_limit_bytes(device: torch.device) -> int:
    """What this process may use: the GPU's free memory plus what torch already reserved (at
    most the per-process memory fraction's share of the card, as `--vram-cap-gib` sets it, and
    never more than the card's dedicated memory: memory.dedicated_bytes), less a margin (1 GiB or
    5% of that, the larger) for fragmentation and the optimizer."""
    free, total = torch.cuda.mem_get_info(device)
    # (A process that spilled already has reserved more than the card has.)
    usable = min(free + torch.cuda.memory_reserved(device), dedicated_bytes(device))
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        usable = min(usable, int(fraction(device) * total))
    return usable - max(GIB, usable // 20)


def run_once(
    run: Callable[[], None], device: torch.device, parameters: list[torch.Tensor], reserved: bool = False
) -> tuple[float, int]:
    """Seconds and peak bytes of one `run`: allocated, or (`reserved`) reserved by the allocator
    with its free cache emptied first (CUDA graphs keep their memory in pools of their own,
    reserved while they live, which the allocated peak of a replay does not show)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if reserved:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device) if reserved else torch.cuda.max_memory_allocated(device)
        return time.perf_counter() - start, peak
    with SavedActivationMeter(parameters) as meter:
        start = time.perf_counter()
        run()
    return time.perf_counter() - start, meter.bytes


def measure(
    run: Callable[[], None], device: torch.device, parameters: list[torch.Tensor], reserved: bool = False
) -> tuple[float, int]:
    """Seconds and peak bytes (see run_once) of one `run`, once the candidate's graphs compiled
    (the run before did) or came back from the compile workers and were switched to (one more
    run). With CUDA graphs the measured run is the one that records them (the one before ran
    them once as torch's warm-up), so their pools are in its reserved peak, and its seconds
    include the recording."""
    if compile_workers.pending():
        run()
    return run_once(run, device, parameters, reserved)


# (run, device, parameters) -> seconds, peak bytes; with CUDA graphs also called with reserved=True.
Measure = Callable[..., tuple[float, int]]
# (run, device, parameters, counts, limit) -> predicted peak bytes of candidates, among them the
# largest predicted to fit `limit` and the next larger one ({}: no prediction; a larger budget
# is taken to need more, a smaller one less).
Predict = Callable[[Callable[[], None], torch.device, list[torch.Tensor], list[Stats], int], dict[float, int] | Waiting]
