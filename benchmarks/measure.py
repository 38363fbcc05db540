"""What a bench child measures besides step time: the GPUs' peaks, the bf16 matmul rate and a
step's FLOPs (for the model FLOP utilisation: step FLOPs / step time / matmul rate), GPU kernel
time by kind (--profile-steps), an offloaded step's transfers alone, and the memory cap."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

import torch

from compile_accel import BlockOffloadConductor

from .models import BenchModel

logger = logging.getLogger("compile_accel.bench")


def synchronize(gpus: list[torch.device]) -> None:
    """Wait for every GPU the step uses (a split step ends work on several)."""
    for gpu in gpus:
        torch.cuda.synchronize(gpu)


def matmul_tflops(device: str, n: int = 8192, repeats: int = 20) -> float:
    """Measured bf16 matmul rate of the card (median of `repeats` after warm-up)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


# Kernel kinds by name (lower case), first match wins: cuDNN's attention kernels contain "sdpa"
# and "flash" (and "wgmma", which is why attention is looked for before "gemm").
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("triton", ("triton",)),
    ("copies", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    """The KERNEL_KINDS kind of a GPU kernel named `name`, or "other"."""
    name = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(part in name for part in parts)), "other")


def gpu_time_per_step(step: Callable[[], Any], steps: int, gpus: list[torch.device]) -> dict[str, float]:
    """Seconds of GPU kernel time per step, by kernel kind, over `steps` profiled steps (kernels on
    several streams at once each count in full)."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(gpus)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        synchronize(gpus)
    seconds = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            seconds[kernel_kind(event.name)] += event.time_range.elapsed_us() / 1e6
    return {kind: total / steps for kind, total in seconds.items()}


def step_flops(bench: BenchModel) -> int | None:
    """FLOPs of one LoRA step without recompute: an eager forward and backward, counted. None
    (no MFU in the table) when such a step does not fit in GPU memory."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter, torch.autocast("cuda", dtype=torch.bfloat16):
            bench.predict().float().square().mean().backward()
    except torch.OutOfMemoryError:
        logger.warning("bench: a step without checkpointing does not fit in GPU memory; no MFU for this mode")
        return None
    finally:
        for p in bench.lora_params:
            p.grad = None
        bench.reset_block_swap()  # an out-of-memory forward leaves swapped blocks half moved
        torch.cuda.empty_cache()
    return counter.get_total_flops()


@torch.no_grad()  # visits with no forward behind them: nothing for backward to come back for
def transfer_only_seconds(conductor: BlockOffloadConductor, repeats: int = 3) -> float:
    """The weight copies of one training step (forward order, then backward's) with no compute."""
    order = [*range(len(conductor.blocks)), *reversed(range(len(conductor.blocks)))]
    times = []
    for _ in range(repeats):
        conductor.synchronize()
        start = time.perf_counter()
        for index in order:
            conductor.before_block(index)
        conductor.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cap_gpu_memory(gib: float, gpus: list[torch.device]) -> None:
    """Let this process allocate at most `gib` GiB on each of `gpus`, as on cards of that size."""
    for gpu in gpus:
        total = torch.cuda.get_device_properties(gpu).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), gpu)


def peak_memory(devices: list[torch.device]) -> tuple[int, int]:
    """(max allocated, max reserved) of the busiest of `devices` since the last reset."""
    return (
        max(torch.cuda.max_memory_allocated(d) for d in devices),
        max(torch.cuda.max_memory_reserved(d) for d in devices),
    )

