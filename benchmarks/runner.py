"""A/B of compile settings on a LoRA training step, one process per setting.

`run_ab()` starts `python -m compile_accel.benchmarks.runner --mode SPEC ...` once per mode,
so each gets clean memory statistics and a cold dynamo state, and collects the JSON line
each child prints last. Modes:

    eager              no checkpointing, nothing compiled
    eager+ckpt         the model's own checkpointing, nothing compiled (the baseline)
    whole+ckpt         checkpointing kept, the whole model compiled (what sd-scripts' --torch_compile does)
    selective+ckpt     checkpointing kept, compute children of each block compiled
    blocks+ckpt        whole blocks compiled with their checkpoint inside
    blocks+budget=B    whole blocks compiled with activation memory budget B, no checkpointing
    blocks+auto        the budget chosen by calibration on the first step (--vram-limit-gib)

A mode can end in `+ddp=N` (N data-parallel processes, one per GPU, through torchrun and
compile_accel.distributed.apply_ddp; the same batch on each, reported as samples/s) or
`+split=N` (the blocks placed across N GPUs by compile_accel.placement.split_blocks; the
peak is the largest of the GPUs'), e.g. `blocks+budget=0.5+ddp=2`.

Any mode can end in `+offload=F` (BlockOffloadConductor streaming the first F of the blocks
from pinned host memory), optionally followed by `+act` (activation offload) and `+int8`
(int8 weight streaming), e.g. `blocks+ckpt+offload=0.9+act`. Those rows also report the bytes
sent per step, the time the same transfers take with no compute, and for int8 the output
error against the bf16 weights.

On a GPU each child also counts the FLOPs of one LoRA step without recompute (forward and
backward, torch.utils.flop_counter) and times a bf16 matmul, for the model FLOP utilisation:
step FLOPs / step time / matmul rate. With `--profile-steps N` it profiles N more steps and
adds where the GPU time goes: kernel time per step by kind (matmul, attention, inductor's
Triton kernels, copies, other) against the median step.

For the sd-scripts models, `--fp8-base` and `--blocks-to-swap N` are the trainers' own memory
options, applied their way (benchmarks/models.py). `--vram-cap-gib G` lets each child allocate
at most G GiB per GPU, so a large GPU shows what fits a smaller card; a mode that runs out of
memory (under the cap or not) is a row marked OOM with the error's first line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from compile_accel import BlockOffloadConductor, CompileConfig
from compile_accel.compile_cache import load_compile_cache, save_compile_cache
from compile_accel.distributed import apply_ddp
from compile_accel.memory import SavedActivationMeter
from compile_accel.memory import gib_argument as _gib
from compile_accel.placement import split_blocks

from .models import MODELS, BenchModel, SdScriptsOptions

logger = logging.getLogger("compile_accel.bench")

DEFAULT_MODES = ["eager+ckpt", "selective+ckpt", "blocks+budget=0.5", "blocks+budget=1.0"]


@dataclass
class OffloadSpec:
    fraction: float
    activation_offload: bool = False
    int8: bool = False


@dataclass
class ModeSpec:
    name: str
    config: CompileConfig
    checkpointing: bool
    whole_model: bool = False
    offload: OffloadSpec | None = None
    ddp: int = 1  # data-parallel processes
    split: int = 1  # GPUs the blocks are split across


def _parse_offload(spec: str, suffix: str) -> OffloadSpec:
    value, *flags = suffix.split("+")
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"mode {spec!r}: offload fraction must be a number in [0, 1]") from None
    if not 0.0 <= fraction <= 1.0 or not set(flags) <= {"act", "int8"} or len(set(flags)) != len(flags):
        raise ValueError(f"mode {spec!r}: expected +offload=F with F in [0, 1], then optionally +act and +int8")
    return OffloadSpec(fraction, "act" in flags, "int8" in flags)


def _parse_count(spec: str, value: str) -> int:
    if not value.isdecimal() or int(value) < 2:
        raise ValueError(f"mode {spec!r}: +ddp=N and +split=N need a whole number N >= 2")
    return int(value)


def parse_mode(spec: str) -> ModeSpec:
    """'blocks+budget=0.5' -> blocks mode, budget 0.5, no checkpointing; ValueError if unknown."""
    rest, counts = spec, {}
    for key in ("ddp", "split"):
        rest, found, value = rest.partition(f"+{key}=")
        if found:
            counts[key] = _parse_count(spec, value)
    base, _, offload = rest.partition("+offload=")
    mode = _parse_compile_mode(base)
    mode.name = spec
    if offload:
        mode.offload = _parse_offload(spec, offload)
    if len(counts) > 1 or (counts and mode.offload is not None):
        raise ValueError(f"mode {spec!r}: +ddp, +split and +offload are separate ways to use GPUs; give one")
    mode.ddp, mode.split = counts.get("ddp", 1), counts.get("split", 1)
    return mode


def _parse_compile_mode(spec: str) -> ModeSpec:
    head, _, rest = spec.partition("+")
    if head == "eager" and rest in ("", "ckpt"):
        return ModeSpec(spec, CompileConfig(mode="off"), rest == "ckpt")
    if head == "whole" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="off"), True, whole_model=True)
    if head == "selective" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="selective"), True)
    if head == "blocks" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="blocks"), True)
    if head == "blocks" and rest == "auto":
        return ModeSpec(spec, CompileConfig(mode="blocks", activation_memory_budget="auto"), False)
    if head == "blocks" and rest.startswith("budget="):
        try:
            budget = float(rest.removeprefix("budget="))
        except ValueError:
            raise ValueError(f"mode {spec!r}: budget must be a number in [0, 1]") from None
        config = CompileConfig(mode="blocks", activation_memory_budget=budget)
        config.validate()
        return ModeSpec(spec, config, False)
    raise ValueError(
        f"unknown mode {spec!r}; modes: eager, eager+ckpt, whole+ckpt, selective+ckpt, blocks+ckpt, blocks+budget=B, "
        "blocks+auto, each optionally followed by +offload=F[+act][+int8], +ddp=N or +split=N"
    )


def _sync(gpus: list[torch.device]) -> None:
    """Wait for every GPU the step uses (a split step ends work on several)."""
    for gpu in gpus:
        torch.cuda.synchronize(gpu)


@dataclass
class BenchSettings:
    """What every mode of one A/B shares (passed to each child process as flags)."""

    model: str = "tiny"
    device: str = "cpu"
    steps: int = 8
    warmup: int = 2
    lora_rank: int = 16
    batch: int | None = None
    res: int | None = None
    vram_limit_gib: float | None = None
    compile_cache: str | None = None
    profile_steps: int | None = None
    fp8_base: bool = False
    blocks_to_swap: int | None = None
    vram_cap_gib: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, device: str) -> BenchSettings:
        """From the parsed `add_settings_arguments` flags, for `device`."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "device"}
        return cls(device=device, **values)

    def flags(self) -> list[str]:
        flags = []
        for name, value in asdict(self).items():
            flag = f"--{name.replace('_', '-')}"
            if value is True:
                flags.append(flag)
            elif value is not None and value is not False:
                flags += [flag, str(value)]
        return flags

    def model_options(self) -> tuple[SdScriptsOptions, ...]:
        """The sd-scripts memory options, as the sd-scripts models' builders take them; none when
        not set (the other builders take none)."""
        options = SdScriptsOptions(self.fp8_base, self.blocks_to_swap)
        return (options,) if options != SdScriptsOptions() else ()


def _whole_number(minimum: int, multiple_of: int = 1) -> Callable[[str], int]:
    """argparse type: a whole number >= `minimum` (and a multiple of `multiple_of`)."""
    wanted = f"a whole number >= {minimum}" + (f" that is a multiple of {multiple_of}" if multiple_of > 1 else "")

    def parse(text: str) -> int:
        if not text.isdecimal() or int(text) < minimum or int(text) % multiple_of:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return int(text)

    return parse


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tiny",
        help="tiny: the embedded DiT; lumina2, flux, sd3, wan: diffusers Lumina 2 / Flux-dev / SD3-medium / Wan 2.1 "
        "14B at full size (random weights, needs diffusers and peft); sdscripts-lumina2, sdscripts-flux, "
        "sdscripts-sdxl, sdscripts-sd3: sd-scripts' own NextDiT / Flux-dev / SDXL U-Net / SD3-medium MMDiT at full "
        "size with its own LoRA network (random weights, needs SD_SCRIPTS_DIR, default .sd-scripts/)",
    )
    parser.add_argument("--steps", type=_whole_number(1), default=8, help="timed steps per mode (median reported)")
    parser.add_argument(
        "--warmup", type=_whole_number(0), default=2, help="steps after the first (compile) step before timing"
    )
    parser.add_argument("--lora-rank", type=_whole_number(1), default=16)
    parser.add_argument("--batch", type=_whole_number(1), help="batch size (default: the model's)")
    parser.add_argument(
        "--res",
        type=_whole_number(16, multiple_of=16),  # 8x VAE downsampling, then 2x2 patches
        help="image resolution in pixels, a multiple of 16 (default: the model's)",
    )
    parser.add_argument(
        "--vram-limit-gib", type=_gib, help="memory limit for the blocks+auto mode (default: free GPU memory)"
    )
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="load each mode's PyTorch cache artifacts from DIR before its first step (when there) and save "
        "them after; a second run with an empty inductor cache then measures a warm start elsewhere",
    )
    parser.add_argument(
        "--profile-steps",
        type=_whole_number(1),
        metavar="N",
        help="on a GPU, profile N more steps and report the kernel time per step by kind (matmul, attention, "
        "Triton, copies, other) against the median step",
    )
    parser.add_argument(
        "--fp8-base",
        action="store_true",
        help="sd-scripts models only: the frozen base model stored as float8_e4m3fn and computed in bf16 under "
        "autocast, as the trainers' --fp8_base does (the LoRA network stays fp32)",
    )
    parser.add_argument(
        "--blocks-to-swap",
        type=_whole_number(1),
        metavar="N",
        help="sd-scripts Flux, SD3 and Lumina 2 only: keep N blocks' weights on the CPU and swap them in during "
        "forward and backward with sd-scripts' own ModelOffloader, as the trainers' --blocks_to_swap does; "
        "no +offload, +ddp or +split mode with it",
    )
    parser.add_argument(
        "--vram-cap-gib",
        type=_gib,
        metavar="G",
        help="GPU only: each mode may allocate at most G GiB per GPU (torch.cuda.set_per_process_memory_fraction), "
        "so a large GPU shows what fits a G GiB card; a mode that runs out of memory is a row marked OOM",
    )


@dataclass
class StepResult:
    mode: str
    model: str
    description: str
    device: str
    steps: int
    step_s_median: float
    step_s_min: float
    first_step_s: float
    peak_bytes: int
    peak_kind: str
    reserved_bytes: int | None
    loss: float
    stats: dict[str, Any] = field(default_factory=dict)
    step_flops: int | None = None
    matmul_tflops: float | None = None
    mfu: float | None = None
    samples_per_s: float | None = None
    processes: int = 1
    devices: int = 1


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

    _sync(gpus)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(gpus)
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


def _inference_output(bench: BenchModel, device: str) -> torch.Tensor:
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        return bench.predict().float()


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


def _rank() -> int:
    """This process's rank under torch.distributed.run (0 when it runs alone)."""
    return int(os.environ.get("RANK", "0"))


def _wrap_ddp(bench: BenchModel, device: str) -> None:
    """DDP around the model. LoRA parameters that live outside it (a kohya-style network) are
    registered on it first, so that DDP averages their gradients too."""
    inside = {id(p) for p in bench.model.parameters()}
    outside = [p for p in bench.lora_params if id(p) not in inside]
    if outside:
        bench.model.register_module("bench_lora_parameters", nn.ParameterList(outside))
    device_ids = [torch.cuda.current_device()] if device == "cuda" else None
    bench.wrapper = apply_ddp(bench.model, device_ids=device_ids)


def cap_gpu_memory(gib: float, gpus: list[torch.device]) -> None:
    """Let this process allocate at most `gib` GiB on each of `gpus`, as on cards of that size."""
    for gpu in gpus:
        total = torch.cuda.get_device_properties(gpu).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), gpu)


def _peak_memory(devices: list[torch.device]) -> tuple[int, int]:
    """(max allocated, max reserved) of the busiest of `devices` since the last reset."""
    return (
        max(torch.cuda.max_memory_allocated(d) for d in devices),
        max(torch.cuda.max_memory_reserved(d) for d in devices),
    )


def run_mode(spec: ModeSpec, settings: BenchSettings) -> StepResult:
    """Build the model with LoRA, apply the mode, and time LoRA training steps."""
    device = settings.device
    # The GPUs this process's step runs on: the split's, or the current one.
    current = torch.cuda.current_device() if device == "cuda" else 0
    gpus = [torch.device("cuda", current + i) for i in range(spec.split)] if device == "cuda" else []
    if settings.vram_cap_gib is not None:
        cap_gpu_memory(settings.vram_cap_gib, gpus)  # before the model is built: building counts too
    torch.manual_seed(0)
    bench = MODELS[settings.model](device, settings.lora_rank, settings.batch, settings.res, *settings.model_options())
    model = bench.model
    model.train()
    # FLOPs are counted on a step without checkpointing, which an offloaded model has no room for.
    flops = step_flops(bench) if device == "cuda" and spec.offload is None else None
    bf16_output = _inference_output(bench, device) if spec.offload is not None and spec.offload.int8 else None
    # The int8 output is taken with these LoRA weights too, so that training does not count as error.
    lora_before = [p.detach().to("cpu", copy=True) for p in bench.lora_params] if bf16_output is not None else []
    if spec.checkpointing:
        bench.enable_checkpointing()
    config = dataclasses.replace(spec.config, exclude=bench.exclude)
    if config.activation_memory_budget == "auto":
        config.vram_limit_gib = settings.vram_limit_gib
    acceleration = bench.accelerate(model, config)
    if spec.whole_model:
        model.compile()
    if spec.ddp > 1:
        _wrap_ddp(bench, device)
    if spec.split > 1:
        split_blocks(model, gpus if device == "cuda" else ["cpu"] * spec.split)
    conductor = None
    if spec.offload is not None:
        conductor = BlockOffloadConductor(
            spec.offload.fraction,
            device=device,
            activation_offload=spec.offload.activation_offload,
            offload_dtype="int8" if spec.offload.int8 else None,
        ).attach(model)
        if device == "cuda":
            torch.cuda.empty_cache()
    optimizer = torch.optim.AdamW(bench.lora_params, lr=1e-4)
    cache_file = Path(settings.compile_cache, f"{settings.model}-{spec.name}.bin") if settings.compile_cache else None
    cache_loaded = load_compile_cache(cache_file) if cache_file else None

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = bench.predict()
        loss = (out.float() - bench.target.float()).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    start = time.perf_counter()
    step()
    _sync(gpus)
    first = time.perf_counter() - start
    for _ in range(settings.warmup):
        step()
    _sync(gpus)
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
    counters_before = dict(conductor.counters) if conductor is not None else {}
    times = []
    for _ in range(settings.steps):
        _sync(gpus)
        start = time.perf_counter()
        loss = step()
        _sync(gpus)
        times.append(time.perf_counter() - start)
    gpu_time = gpu_time_per_step(step, settings.profile_steps, gpus) if settings.profile_steps and gpus else None
    if device == "cuda":
        (peak, reserved), kind = _peak_memory(gpus), "cuda max allocated"
    else:
        with SavedActivationMeter([*model.parameters(), *bench.lora_params]) as meter:
            bench.predict().float().square().mean().backward()
        optimizer.zero_grad(set_to_none=True)
        peak, kind, reserved = meter.bytes, "activation bytes saved for backward", None
    stats = acceleration.stats()
    if gpu_time is not None:
        stats["gpu_time_per_step_s"] = gpu_time
    stats["fxgraph_cache_hits"] = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
    if cache_file is not None and _rank() == 0:
        stats["compile_cache"] = {"loaded": cache_loaded, "saved_bytes": save_compile_cache(cache_file)}
    if conductor is not None:
        per_step = {k: (v - counters_before[k]) / settings.steps for k, v in conductor.counters.items()}
        stats["offload"] = {
            **conductor.stats(),
            "bytes_to_device_per_step": per_step["bytes_to_device"],
            "activation_bytes_offloaded_per_step": per_step["activation_bytes_offloaded"],
            "transfer_only_s": transfer_only_seconds(conductor),
        }
        if bf16_output is not None:
            with torch.no_grad():
                for param, before in zip(bench.lora_params, lora_before, strict=True):
                    param.copy_(before)
            output = _inference_output(bench, device)
            stats["offload"]["int8_output_rel_error"] = ((output - bf16_output).norm() / bf16_output.norm()).item()
    if spec.whole_model:
        counters = torch._dynamo.utils.counters
        stats.update(
            unique_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values())
        )
    median = statistics.median(times)
    rate = matmul_tflops(device) * spec.split if device == "cuda" else None  # the rate of every GPU the step uses
    return StepResult(
        spec.name,
        settings.model,
        bench.description,
        device,
        settings.steps,
        median,
        min(times),
        first,
        peak,
        kind,
        reserved,
        loss,
        stats,
        flops,
        rate,
        flops / median / (rate * 1e12) if flops else None,
        bench.target.shape[0] * spec.ddp / median,
        spec.ddp,
        spec.ddp * spec.split,
    )


def _out_of_memory(error: BaseException | None) -> BaseException | None:
    """The torch.OutOfMemoryError behind `error` (itself, or one it was raised from or during), if any."""
    while error is not None and not isinstance(error, torch.OutOfMemoryError):
        error = error.__cause__ or error.__context__
    return error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def out_of_memory_result(spec: ModeSpec, settings: BenchSettings, error: BaseException) -> dict[str, Any]:
    """The row of a mode that ran out of memory: what ran, and the error's first line."""
    return {
        "mode": spec.name,
        "model": settings.model,
        "device": settings.device,
        "oom": _first_line(error),
        "oom_where": "".join(traceback.format_tb(error.__traceback__)[-4:]),  # which step, which call
        "processes": spec.ddp,
        "devices": spec.ddp * spec.split,
    }


def environment() -> dict[str, Any]:
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    if torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
    else:
        env["device_name"] = platform.processor() or "cpu"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def _run_child(mode: str, settings: BenchSettings, env: dict[str, str]) -> dict[str, Any]:
    processes = parse_mode(mode).ddp
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    cmd = [sys.executable, *launcher, "-m", "compile_accel.benchmarks.runner", "--mode", mode, *settings.flags()]
    if processes > 1 and sys.platform == "win32":
        env = {**env, "USE_LIBUV": "0"}  # torchrun's store needs libuv, which Windows builds lack
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_ab(
    modes: list[str], settings: BenchSettings, progress: Callable[[str], None] = print, warm: bool = False
) -> dict[str, Any]:
    """Each mode in a child process; returns {'environment', 'command', 'settings', 'results'}.

    warm: each mode compiles into an inductor cache of its own, empty (a cold start), then a
    second child with that cache runs one step: its first step is the warm start.
    """
    for mode in modes:
        parse_mode(mode)  # refuse a bad mode before spending minutes on the good ones
    results = []
    for i, mode in enumerate(modes, 1):
        progress(
            f"[{i}/{len(modes)}] {mode}: building {settings.model}, compiling, timing "
            f"{settings.warmup} + {settings.steps} steps on {settings.device} ..."
        )
        start = time.perf_counter()
        # A scanner holding a cache file on Windows must not lose the whole A/B at cleanup.
        with tempfile.TemporaryDirectory(prefix="compile_accel_bench_", ignore_cleanup_errors=True) as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache} if warm else os.environ.copy()
            result = _run_child(mode, settings, env)
            if warm and "oom" not in result:
                again = _run_child(mode, dataclasses.replace(settings, steps=1, warmup=0), env)
                result["warm_first_step_s"] = again["first_step_s"]
                result["warm_fxgraph_cache_hits"] = again["stats"]["fxgraph_cache_hits"]
        results.append(result)
        seconds = time.perf_counter() - start
        progress(f"[{i}/{len(modes)}] {mode}: {_progress_note(result, warm)}; {seconds:.0f} s in all")
    return {
        "environment": environment(),
        "command": " ".join(sys.argv),
        "settings": asdict(settings),
        "results": results,
    }


def _progress_note(result: dict[str, Any], warm: bool) -> str:
    if "oom" in result:
        return f"OOM ({result['oom']})"
    warm_note = f", warm first step {result['warm_first_step_s']:.1f} s" if warm else ""
    return f"{result['step_s_median'] * 1e3:.1f} ms/step (first step {result['first_step_s']:.1f} s{warm_note})"


def _format_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def measured(report: dict[str, Any]) -> dict[str, Any]:
    """The report without the modes that ran out of memory."""
    return {**report, "results": [r for r in report["results"] if "oom" not in r]}


def markdown_table(report: dict[str, Any], baseline: str = "eager+ckpt") -> str:
    """The main table (a mode that ran out of memory is a row marked OOM), the note on a memory
    cap, then the offload, parallel and GPU-time tables of the modes that ran."""
    ran = measured(report)
    base = next((r for r in ran["results"] if r["mode"] == baseline), None)
    kind = ran["results"][0]["peak_kind"] if ran["results"] else ""
    lines = [
        f"| mode | median s/step | min s/step | vs {baseline} | peak ({kind}) | reserved | first step s "
        "| warm first step s | MFU | graphs | recompiles | graph breaks | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "oom" in r:
            message = r["oom"].replace("|", "\\|")  # a bar would end the cell
            lines.append(f"| {r['mode']} | OOM: {message} |" + " - |" * 11)
            continue
        speedup = f"{base['step_s_median'] / r['step_s_median']:.2f}x" if base else "-"
        s = r["stats"]
        lines.append(
            f"| {r['mode']} | {r['step_s_median']:.4f} | {r['step_s_min']:.4f} | {speedup} | {_format_bytes(r['peak_bytes'])} "
            f"| {_format_bytes(r['reserved_bytes'])} | {r['first_step_s']:.1f} "
            f"| {'-' if r.get('warm_first_step_s') is None else format(r['warm_first_step_s'], '.1f')} "
            f"| {'-' if r.get('mfu') is None else format(r['mfu'], '.1%')} | {s.get('unique_graphs', 0)} "
            f"| {s.get('recompiles', 0)} | {s.get('graph_breaks', 0)} | {len(s.get('fallbacks', []))} |"
        )
    extra = [cap_note(report), auto_note(ran), offload_table(ran), parallel_table(ran), gpu_time_table(ran)]
    return "\n\n".join(["\n".join(lines), *(table for table in extra if table)])


def cap_note(report: dict[str, Any]) -> str:
    """What a run under --vram-cap-gib measured: a smaller card's memory at this GPU's speed."""
    cap = report.get("settings", {}).get("vram_cap_gib")
    if cap is None:
        return ""
    gpu = report.get("environment", {}).get("device_name", "the GPU it ran on")
    return (
        f"Under --vram-cap-gib {cap:g}: each process could allocate at most {cap:g} GiB per GPU, so the memory "
        f"columns and OOM rows are what a {cap:g} GiB card would see, while the speeds are those of {gpu}."
    )


def auto_note(report: dict[str, Any]) -> str:
    """What each +auto row chose, over which limit, and what its calibration measured."""
    notes = []
    for r in report["results"]:
        auto = r["stats"].get("auto_budget")
        if not auto:
            continue
        setting = f"budget {auto['budget']}"
        if auto.get("offload_name"):
            setting += f" at {auto['offload_name']} {auto['offload']:g}"
        tried = ", ".join(
            f"{row['budget']}" + ("" if row["offload"] is None else f"@{row['offload']:g}")
            + (": OOM" if row["out_of_memory"] else f": {row['seconds']:.3f} s {row['peak_bytes'] / 2**30:.2f} GiB")
            for row in auto["table"]
        )
        notes.append(
            f"{r['mode']} chose {setting} ({'fits' if auto['fits'] else 'nothing fit'} {auto['limit_gib']:g} GiB; "
            f"calibration {auto.get('calibration_seconds', 0):.1f} s{', cached' if auto['cached'] else ''}); "
            f"measured budget@offload: {tried}."
        )
    return "\n\n".join(notes)


def offload_table(report: dict[str, Any]) -> str:
    """Rows with +offload: step time against the same mode without offload (compute only, when
    it ran) and against the transfers alone; the overlap bar is step <= 1.15 x the larger."""
    by_mode = {r["mode"]: r for r in report["results"]}
    lines = [
        "| mode | median s/step | compute-only s/step | transfer-only s | step / max(both) | GiB to GPU per step "
        "| activations GiB per step | int8 output error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        offload = r["stats"].get("offload")
        if offload is None:
            continue
        compute = by_mode.get(r["mode"].partition("+offload=")[0])
        compute_s = compute["step_s_median"] if compute else None
        bound = max(compute_s or 0.0, offload["transfer_only_s"])
        error = offload.get("int8_output_rel_error")
        lines.append(
            f"| {r['mode']} | {r['step_s_median']:.4f} | {'-' if compute_s is None else format(compute_s, '.4f')} "
            f"| {offload['transfer_only_s']:.4f} | {r['step_s_median'] / bound:.2f} "
            f"| {offload['bytes_to_device_per_step'] / 2**30:.2f} "
            f"| {offload['activation_bytes_offloaded_per_step'] / 2**30:.2f} "
            f"| {'-' if error is None else format(error, '.2e')} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def gpu_time_table(report: dict[str, Any]) -> str:
    """Rows profiled with --profile-steps: GPU kernel time per step by kind, in ms, and the median
    step less all kernel time (the GPU waiting on the host, when kernels do not overlap)."""
    kinds = [kind for kind, _ in KERNEL_KINDS] + ["other"]
    lines = [
        f"| mode | median ms/step | {' | '.join(f'{kind} ms' for kind in kinds)} | all kernels ms | step less kernels ms |",
        "|---|---|" + "---|" * (len(kinds) + 2),
    ]
    for r in report["results"]:
        gpu_time = r["stats"].get("gpu_time_per_step_s")
        if gpu_time is None:
            continue
        busy = sum(gpu_time.values())
        cells = " | ".join(f"{gpu_time[kind] * 1e3:.1f}" for kind in kinds)
        step_ms = r["step_s_median"] * 1e3
        lines.append(f"| {r['mode']} | {step_ms:.1f} | {cells} | {busy * 1e3:.1f} | {step_ms - busy * 1e3:.1f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def parallel_table(report: dict[str, Any]) -> str:
    """Rows with +ddp or +split: throughput against the same mode on one device (when it ran)."""
    by_mode = {r["mode"]: r for r in report["results"]}
    lines = [
        "| mode | processes | devices | samples/s | vs one device | median s/step | peak of the busiest device |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if r.get("devices", 1) == 1:
            continue
        single = by_mode.get(r["mode"].split("+ddp=")[0].split("+split=")[0])
        ratio = f"{r['samples_per_s'] / single['samples_per_s']:.2f}x" if single else "-"
        lines.append(
            f"| {r['mode']} | {r['processes']} | {r['devices']} | {r['samples_per_s']:.2f} | {ratio} "
            f"| {r['step_s_median']:.4f} | {_format_bytes(r['peak_bytes'])} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> None:
    """Child-process entry: run one mode, print its result as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    add_settings_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # auto budget's table, to stderr
    settings = BenchSettings.from_args(args, args.device)
    spec = parse_mode(args.mode)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != spec.ddp:
        parser.error(f"mode {args.mode} needs {spec.ddp} processes, this is one of {world} (run it through `bench`)")
    if world > 1:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # Windows builds of torch have no NCCL.
        dist.init_process_group("nccl" if args.device == "cuda" and dist.is_nccl_available() else "gloo")
    try:
        result = asdict(run_mode(spec, settings))
    except Exception as error:  # an OOM anywhere (building, compiling, a step) is a row; anything else fails the A/B
        oom = _out_of_memory(error)
        if oom is None:
            raise
        result = out_of_memory_result(spec, settings, oom)
    finally:
        if world > 1:
            dist.destroy_process_group()
    if _rank() == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
