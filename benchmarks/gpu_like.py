"""`compile-accel bench --gpu-like NAME`: a large GPU measured as the card users have.

Each mode's process runs its CUDA work on the stream of a green context holding N of the GPU's
SMs (torch.cuda.green_contexts, torch >= 2.10) and under the card's memory size. The stream, not
`set_context()`: autograd runs a backward op on its forward op's stream, so both are restricted
(`set_context()` restricted the forward only, torch 2.11 on an H200). N is measured, not a
constant: the smallest N (in steps of SM_STEP) whose bf16 matmul rate reaches the card's.

What this does not emulate, said in every report: the host CPU (this machine's), the L2 cache
and memory bandwidth (the bench reports the restricted device's copy rate beside the card's),
and the card's int8/fp8 rates relative to bf16.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .measure import matmul_tflops
from .modes import ModeSpec


@dataclass(frozen=True)
class CardSpec:
    """A card's dense tensor rates (no sparsity) and memory."""

    bf16_tflops: float  # bf16 inputs, fp32 accumulate: what autocast's matmuls run at
    int8_tops: float
    fp8_tflops: float | None  # fp8 inputs, fp32 accumulate; None: the card has no fp8
    bandwidth_gbs: float
    memory_gib: float
    sms: int
    l2_mib: float


# Sources: NVIDIA Ada GPU Architecture whitepaper (v1.01), appendix tables for GeForce RTX 4090 and
# RTX 4080 16GB ("Peak BF16 Tensor TFLOPS with FP32 Accumulate", "Peak FP8 Tensor TFLOPS with FP32
# Accumulate", "Peak INT8 Tensor TOPS", dense figures); NVIDIA Ampere GA102 GPU Architecture
# whitepaper (v2.0), table for GeForce RTX 3090 (GA102 has no fp8). Memory: the cards' 24 / 16 GB.
CARDS: dict[str, CardSpec] = {
    "rtx4090": CardSpec(
        bf16_tflops=165.2, int8_tops=660.6, fp8_tflops=330.3, bandwidth_gbs=1008, memory_gib=24, sms=128, l2_mib=72
    ),
    "rtx4080": CardSpec(
        bf16_tflops=97.5, int8_tops=389.9, fp8_tflops=194.9, bandwidth_gbs=716.8, memory_gib=16, sms=76, l2_mib=64
    ),
    "rtx3090": CardSpec(
        bf16_tflops=71.0, int8_tops=284.0, fp8_tflops=None, bandwidth_gbs=936, memory_gib=24, sms=82, l2_mib=6
    ),
}

# Hopper hands out SMs to green contexts in multiples of 8 (Ampere and Ada in multiples of 2).
SM_STEP = 8
# A rate within this of the card's counts as reaching it: the spec is a peak that the card's own
# cuBLAS does not quite reach either, and the measurement varies by about as much.
RATE_TOLERANCE = 0.05

NOT_EMULATED = (
    "not emulated: the host CPU (this machine's), the L2 cache and the memory bandwidth (the copy rate "
    "above against the card's), and the card's int8/fp8 rates relative to bf16"
)


def refusal(
    flag: str, device: str, modes: list[ModeSpec], vram_cap_gib: float | None, gpu_sms: int | None = None
) -> str | None:
    """Why `flag` (--gpu-like or --gpu-sms) cannot restrict the SMs for these modes here, or None."""
    if device != "cuda":
        return f"{flag} restricts a GPU's SMs, and this run is on the CPU"
    if not getattr(torch.cuda, "green_contexts", None) or not torch.cuda.green_contexts.SUPPORTED:
        return f"{flag} needs CUDA green contexts (torch >= 2.10 built with them); this is torch {torch.__version__}"
    several = [m.name for m in modes if m.ddp > 1 or m.split > 1]
    if several:
        return f"{flag} emulates one card; {several[0]} uses several GPUs"
    if flag == "--gpu-like" and vram_cap_gib is not None:
        return "--gpu-like caps memory at the card's size; drop --vram-cap-gib"
    if flag == "--gpu-like" and gpu_sms is not None:
        return "--gpu-like chooses the SM count by measurement; drop --gpu-sms"
    return None


def choose_sm_count(rate_at: Callable[[int], float], target_tflops: float, total_sms: int) -> int:
    """The fewest SMs (a multiple of SM_STEP, or all of them) whose rate_at(n) reaches target_tflops
    less RATE_TOLERANCE; ValueError when even all total_sms fall short (a GPU smaller than the card)."""
    counts = [*range(SM_STEP, total_sms, SM_STEP), total_sms]
    rate = 0.0
    for count in counts:
        rate = rate_at(count)
        if rate >= target_tflops * (1 - RATE_TOLERANCE):
            return count
    raise ValueError(
        f"this GPU's {total_sms} SMs reach {rate:.1f} TFLOP/s of bf16 matmul, below the card's {target_tflops:g}: "
        "it cannot stand in for that card"
    )


# The green contexts whose streams restrict() made current: alive as long as the process.
_restricting: list[Any] = []


def restrict(num_sms: int, device: int = 0) -> None:
    """Run this thread's CUDA work (and autograd's backward of it) on a green context of
    `num_sms` SMs from here on."""
    context = torch.cuda.green_contexts.GreenContext.create(num_sms=num_sms, device_id=device)
    torch.cuda.set_stream(context.Stream())
    _restricting.append(context)


def _event_seconds(work: Callable[[], Any], repeats: int = 10) -> float:
    """Median seconds of `work` on the current stream, timed by CUDA events after one warm-up."""
    work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_gbs(size_bytes: int = 2**30) -> float:
    """Device-to-device copy rate on the current stream, bytes read and written per second (GB/s)."""
    source = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * size_bytes / _event_seconds(lambda: target.copy_(source)) / 1e9


def cuda_graph_replay(stream: torch.cuda.Stream, n: int = 8192, matmuls: int = 4) -> dict[str, Any]:
    """Whether a CUDA graph replayed on the restricted `stream` stays restricted. The graph is
    recorded on a stream of the whole GPU, as inductor's CUDA graph trees record theirs; its
    replay is timed against the same matmuls launched on `stream` and on the whole GPU. A second
    graph recorded on `stream` itself is timed too (`replay_of_restricted_recording_s`): whether
    recording there would keep CUDA graphs restricted."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)

    def work() -> None:
        for _ in range(matmuls):
            torch.mm(a, b, out=out)

    def recorded_on(recording: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        recording.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(recording):
            work()  # cuBLAS's workspace and plans before the recording
            with torch.cuda.graph(graph, stream=recording):
                work()
        torch.cuda.synchronize()
        return graph

    plain, restricted = recorded_on(torch.cuda.Stream()), recorded_on(stream)  # (a plain stream: all SMs)
    with torch.cuda.stream(stream):
        restricted_s = _event_seconds(work)
        replay_s = _event_seconds(plain.replay)
        replay_of_restricted_recording_s = _event_seconds(restricted.replay)
    with torch.cuda.stream(torch.cuda.default_stream()):
        whole_s = _event_seconds(work)
    return {
        "restricted": abs(replay_s - restricted_s) < abs(replay_s - whole_s),
        "replay_s": replay_s,
        "replay_of_restricted_recording_s": replay_of_restricted_recording_s,
        "launched_restricted_s": restricted_s,
        "launched_whole_gpu_s": whole_s,
    }


def calibrate(name: str, device: int = 0) -> dict[str, Any]:
    """Choose the SM count for card `name` on this GPU by measurement, and measure what else the
    report gives beside the card's specs (the restricted copy rate, CUDA graph replay). Raises
    ValueError when this GPU cannot stand in for the card."""
    card = CARDS[name]
    properties = torch.cuda.get_device_properties(device)
    total_gib = properties.total_memory / 2**30
    if card.memory_gib > total_gib:
        raise ValueError(f"{name} has {card.memory_gib:g} GiB, more than this GPU's {total_gib:.1f} GiB")
    contexts, rates = {}, {}

    def rate_at(count: int) -> float:
        contexts[count] = torch.cuda.green_contexts.GreenContext.create(num_sms=count, device_id=device)
        with torch.cuda.stream(contexts[count].Stream()):
            rates[count] = matmul_tflops("cuda")
        return rates[count]

    sms = choose_sm_count(rate_at, card.bf16_tflops, properties.multi_processor_count)
    stream = contexts[sms].Stream()
    with torch.cuda.stream(stream):
        copy = copy_gbs()
    graphs = cuda_graph_replay(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {
        "card": name,
        "card_spec": asdict(card),
        "gpu": properties.name,
        "all_sms": properties.multi_processor_count,
        "sms": sms,
        "matmul_tflops_by_sms": rates,
        "matmul_tflops": rates[sms],
        "copy_gbs": copy,
        "cuda_graphs": graphs,
        "not_emulated": NOT_EMULATED,
    }


def cuda_graph_refusal(calibration: dict[str, Any]) -> str | None:
    """Why +cudagraphs rows cannot run under this emulation, or None."""
    graphs = calibration["cuda_graphs"]
    if graphs["restricted"]:
        return None
    return (
        f"a CUDA graph replayed on the restricted stream ran on the whole GPU ({graphs['replay_s'] * 1e3:.1f} ms "
        f"against {graphs['launched_restricted_s'] * 1e3:.1f} ms launched restricted and "
        f"{graphs['launched_whole_gpu_s'] * 1e3:.1f} ms on the whole GPU), so +cudagraphs rows would not be "
        f"{calibration['card']}'s speed"
    )


def note(calibration: dict[str, Any]) -> str:
    """The report's paragraph on the emulation: the measured restricted device beside the card."""
    card = calibration["card_spec"]
    return (
        f"As {calibration['card']} (--gpu-like): every mode ran on {calibration['sms']} of the "
        f"{calibration['all_sms']} SMs of {calibration['gpu']} (a green context's stream) under a "
        f"{card['memory_gib']:g} GiB memory cap. bf16 matmul measured {calibration['matmul_tflops']:.1f} TFLOP/s "
        f"(card: {card['bf16_tflops']:g}); device-to-device copy {calibration['copy_gbs']:.0f} GB/s (card's memory: "
        f"{card['bandwidth_gbs']:g} GB/s); CUDA graphs replayed {'restricted' if calibration['cuda_graphs']['restricted'] else 'on the whole GPU'}; "
        f"{calibration['not_emulated']}."
    )
