"""A/B of compile settings on a LoRA training step, one process per setting.

`run_ab()` starts `python -m compile_accel.benchmarks.runner --mode SPEC ...` once per mode
(the grammar: benchmarks/modes.py), so each gets clean memory statistics and a cold dynamo
state, and collects the JSON line each child prints last; benchmarks/report.py tabulates them.

A mode ending in `+ddp=N` runs N data-parallel processes, one per GPU, through torchrun and
compile_accel.distributed.apply_ddp, the same batch on each, reported as samples/s; `+split=N`
places the blocks across N GPUs by compile_accel.placement.split_blocks, the peak being the
largest of the GPUs'. `+offload=F` attaches a BlockOffloadConductor streaming the first F of the
blocks from pinned host memory (`+act`: activation offload, `+int8`: int8 weight streaming);
those rows also report the bytes sent per step, the time the same transfers take with no
compute, and for int8 the output error against the bf16 weights.

On a GPU each child also measures what benchmarks/measure.py describes: the step's FLOPs and
the matmul rate for the model FLOP utilisation, and with `--profile-steps N` the kernel time by
kind over N more steps.

For the sd-scripts models, `--fp8-base`, `--fp8-scaled` and `--blocks-to-swap N` are the
trainers' own memory options, applied their way (benchmarks/models.py). `--vram-cap-gib G` lets
each child allocate at most G GiB per GPU, so a large GPU shows what fits a smaller card; a mode
that runs out of memory (under the cap or not) is a row marked OOM with the error's first line.
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

from compile_accel import BlockOffloadConductor
from compile_accel import compile_workers
from compile_accel.auto_budget import AutoBudget
from compile_accel.compile_cache import RunCompileCache, load_compile_cache, save_compile_cache
from compile_accel.dynamo_settings import HAS_CACHE_ARTIFACTS
from compile_accel.distributed import apply_ddp
from compile_accel.first_step import end_first_step
from compile_accel.memory import SavedActivationMeter
from compile_accel.memory import gib_argument as _gib
from compile_accel.placement import split_blocks
from compile_accel.preload import start_preloading

from . import gpu_like
from .measure import (
    cap_gpu_memory,
    gpu_time_per_step,
    matmul_tflops,
    peak_memory,
    step_flops,
    synchronize,
    transfer_only_seconds,
)
from .models import MODELS, BenchModel, SdScriptsOptions
from .modes import ModeSpec, parse_mode


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
    fp8_scaled: bool = False
    vram_cap_gib: float | None = None
    compile_workers: int = 0
    compile_workers_wait: bool = False
    gpu_sms: int | None = None

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
        options = SdScriptsOptions(
            fp8_base=self.fp8_base, blocks_to_swap=self.blocks_to_swap, fp8_scaled=self.fp8_scaled
        )
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
        help="sd-scripts Flux, SD3, Lumina 2, SDXL and SD 1.5 only: the frozen base model stored as float8_e4m3fn "
        "and computed in bf16 under autocast, as the trainers' --fp8_base does (the LoRA network stays fp32)",
    )
    parser.add_argument(
        "--fp8-scaled",
        action="store_true",
        help="sd-scripts HunyuanImage only: its blocks' Linear weights stored as float8_e4m3fn with a "
        "scale per 64 inputs and dequantized to bf16 before each matmul, as the trainers' --fp8_scaled does",
    )
    parser.add_argument(
        "--blocks-to-swap",
        type=_whole_number(1),
        metavar="N",
        help="sd-scripts Flux, SD3, Lumina 2, Anima and HunyuanImage only: keep N blocks' weights on the CPU and "
        "swap them in during forward and backward with sd-scripts' own ModelOffloader, as the trainers' "
        "--blocks_to_swap does; no +offload, +ddp or +split mode with it",
    )
    parser.add_argument(
        "--vram-cap-gib",
        type=_gib,
        metavar="G",
        help="GPU only: each mode may allocate at most G GiB per GPU (torch.cuda.set_per_process_memory_fraction), "
        "so a large GPU shows what fits a G GiB card; a mode that runs out of memory is a row marked OOM",
    )
    parser.add_argument(
        "--compile-workers",
        type=_whole_number(0),
        default=0,
        metavar="N",
        help="compiled modes compile their graphs in N worker processes (CompileConfig.compile_workers); "
        "the second step is timed too (it runs what is not compiled yet uncompiled), then the bench waits for the "
        "workers and reports when the last graph was back",
    )
    parser.add_argument(
        "--gpu-sms",
        type=_whole_number(1),
        metavar="N",
        help="GPU only: each mode runs its CUDA work on a green context of N SMs, as on a smaller card "
        "(--gpu-like chooses N by measurement)",
    )
    parser.add_argument(
        "--compile-workers-wait",
        action="store_true",
        help="with --compile-workers: the first step waits for the workers' graphs and loads them "
        "(compile_workers.wait_and_load), so that every step after it runs compiled",
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
    step_s_each: list[float]  # every timed step, in order: the spread behind the median
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


def _inference_output(bench: BenchModel, device: str) -> torch.Tensor:
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        return bench.predict().float()


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
    # FLOPs are counted on a step without checkpointing, which an offloaded model has no room for;
    # in a block-swapped one, such a step running out of memory leaves the swap half done.
    counted = device == "cuda" and spec.offload is None and not settings.blocks_to_swap
    flops = step_flops(bench) if counted else None
    bf16_output = _inference_output(bench, device) if spec.offload is not None and spec.offload.int8 else None
    # The int8 output is taken with these LoRA weights too, so that training does not count as error.
    lora_before = [p.detach().to("cpu", copy=True) for p in bench.lora_params] if bf16_output is not None else []
    if spec.checkpointing:
        bench.enable_checkpointing()
    config = dataclasses.replace(spec.config, exclude=bench.exclude, compile_workers=settings.compile_workers)
    if config.activation_memory_budget == "auto":
        config.vram_limit_gib = settings.vram_limit_gib
    acceleration = bench.accelerate(model, config)
    # The launcher's run cache: loaded at the first forward, saved after the first step (precompiling
    # while the worker pool is up) and again once the workers' graphs run compiled.
    run_cache = None
    if HAS_CACHE_ARTIFACTS and acceleration.regions:
        run_cache = RunCompileCache(model, acceleration.signature, acceleration)
    if spec.torch_compile == "model":
        model.compile()
    elif spec.torch_compile == "blocks":
        blocks = [block for block_list in acceleration.block_lists for block in block_list.blocks]
        compile_each_block(blocks, _swapped_blocks(model, blocks))
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
    stepped = time.perf_counter()
    if settings.compile_workers_wait:
        compile_workers.wait_and_load()
    synchronize(gpus)
    first = time.perf_counter() - start
    auto = acceleration.auto_budget
    waiting = compile_workers.pending() or (auto is not None and auto.waiting_for is not None)
    workers = _await_compile_workers(step, gpus, start, auto) if waiting else None
    if workers is None and settings.compile_workers_wait:  # every graph back and loaded in the first step
        workers = {"second_step_s": None, "compiled_after_s": first, "waited_s": round(start + first - stepped, 3)}
    ended = end_first_step(acceleration, run_cache if _rank() == 0 else None)  # as the launcher
    for _ in range(settings.warmup):
        step()
    if run_cache is not None and _rank() == 0:  # again, with the workers' graphs loaded here since
        run_cache.save()
    # Timed once the graphs for the next start are precompiled: that compile, in the workers after
    # the first step (after auto's choice), slowed the host-bound steps of SDXL it overlapped.
    waited = time.perf_counter()
    written = None if run_cache is None or run_cache.precompiling is None else run_cache.precompiling.join()
    precompile_wait_s = time.perf_counter() - waited
    synchronize(gpus)
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
    counters_before = dict(conductor.counters) if conductor is not None else {}
    times = []
    for _ in range(settings.steps):
        synchronize(gpus)
        start = time.perf_counter()
        loss = step()
        synchronize(gpus)
        times.append(time.perf_counter() - start)
    gpu_time = gpu_time_per_step(step, settings.profile_steps, gpus) if settings.profile_steps and gpus else None
    if device == "cuda":
        (peak, reserved), kind = peak_memory(gpus), "cuda max allocated"
    else:
        with SavedActivationMeter([*model.parameters(), *bench.lora_params]) as meter:
            bench.predict().float().square().mean().backward()
        optimizer.zero_grad(set_to_none=True)
        peak, kind, reserved = meter.bytes, "activation bytes saved for backward", None
    stats = acceleration.stats()
    if gpu_time is not None:
        stats["gpu_time_per_step_s"] = gpu_time
    stats["fxgraph_cache_hits"] = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
    # torch's own compile timers, nested (compile_times above is their exclusive summary)
    stats["torch_compile_timers_s"] = {
        name: round(sum(seconds), 3) for name, seconds in torch._dynamo.utils.compilation_time_metrics.items()
    }
    if workers is not None:
        stats["compile_workers"] = workers
    if ended.frozen is not None:
        stats["gc_freeze"] = {"objects": ended.frozen, "seconds": round(ended.freeze_s, 3)}
    if run_cache is not None:
        stats["precompiled"] = {
            "loaded": run_cache.precompiled_loaded,
            "ran": sum(f.precompiled.used for f in acceleration.functions),
            "written": written,
            "waited_before_timing_s": round(precompile_wait_s, 2),
        }
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
    if spec.torch_compile is not None:
        counters = torch._dynamo.utils.counters
        stats.update(
            unique_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values())
        )
    median = statistics.median(times)
    rate = matmul_tflops(device) * spec.split if device == "cuda" else None  # the rate of every GPU the step uses
    return StepResult(
        mode=spec.name,
        model=settings.model,
        description=bench.description,
        device=device,
        steps=settings.steps,
        step_s_median=median,
        step_s_min=min(times),
        step_s_each=times,
        first_step_s=first,
        peak_bytes=peak,
        peak_kind=kind,
        reserved_bytes=reserved,
        loss=loss,
        stats=stats,
        step_flops=flops,
        matmul_tflops=rate,
        mfu=flops / median / (rate * 1e12) if flops else None,
        samples_per_s=bench.target.shape[0] * spec.ddp / median,
        processes=spec.ddp,
        devices=spec.ddp * spec.split,
    )


# sd-scripts' docs for its per-block --compile recommend this recompile limit
# (docs/anima_torch_compile.md): each bucket shape compiles once more.
PER_BLOCK_RECOMPILE_LIMIT = 32


def compile_each_block(blocks: list[nn.Module], swapped: list[nn.Module]) -> None:
    """The peers' per-block compile, as musubi-tuner's, OneTrainer's and sd-scripts' Anima
    `--compile` do it: each block `torch.compile`d as a module (default mode, dynamic=None), the
    model's own checkpointing left around or inside it. The `swapped` blocks (their weights moved
    by a block swap) keep their Linear layers out of the compiled code, as those trainers do."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    setattr(config, name, max(getattr(config, name), PER_BLOCK_RECOMPILE_LIMIT))
    for block in swapped:
        for linear in block.modules():
            if isinstance(linear, nn.Linear):
                linear.forward = torch._dynamo.disable(linear.forward)
    for block in blocks:
        block.compile()


def _swapped_blocks(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks sd-scripts' block swap keeps on the CPU (--blocks-to-swap) while the rest of the
    model is on the GPU."""
    if not any(p.is_cuda for p in model.parameters()):
        return []
    return [block for block in blocks if not any(p.is_cuda for p in block.parameters())]


def _await_compile_workers(
    step: Callable[[], float], gpus: list[torch.device], start: float, auto: AutoBudget | None
) -> dict[str, float]:
    """After a first step that left graphs compiling in workers, or auto waiting for them: the
    second step's seconds (its graphs still compiling run uncompiled) and when, from the first
    step's start, the last compiled graph was back. With auto, steps go on until its choice is
    made: the workers' partitions of its traced step are read at the first step after they are
    back, which hands a candidate's graphs over; a candidate is measured at the first step after
    its graphs are back, and one over the limit hands the next to the workers."""
    second_start = time.perf_counter()
    step()
    synchronize(gpus)
    second = time.perf_counter() - second_start
    compile_workers.wait()
    while auto is not None and auto.waiting_for is not None:
        step()
        compile_workers.wait()
    return {"second_step_s": second, "compiled_after_s": time.perf_counter() - start}


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


def _run_child(mode: str, settings: BenchSettings, env: dict[str, str], log: Path | None) -> dict[str, Any]:
    processes = parse_mode(mode).ddp
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
    cmd = [sys.executable, *launcher, "-m", "compile_accel.benchmarks.runner", "--mode", mode, *settings.flags()]
    if processes > 1 and sys.platform == "win32":
        env = {**env, "USE_LIBUV": "0"}  # torchrun's store needs libuv, which Windows builds lack
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if log is not None:  # the child's warnings and progress, kept when it succeeds too
        with log.open("a", encoding="utf-8") as file:
            file.write(f"$ {' '.join(cmd)}\n{proc.stderr}\n")
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_ab(
    modes: list[str],
    settings: BenchSettings,
    progress: Callable[[str], None] = print,
    warm: bool = False,
    log_dir: Path | None = None,
    on_report: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Each mode in a child process; returns {'environment', 'command', 'settings', 'results'}.

    warm: each mode compiles into an inductor cache of its own, empty (a cold start), then a
    second child with that cache runs one step: its first step is the warm start.
    log_dir: each mode's children write their standard error to `<log_dir>/<mode>.log`.
    on_report: called after each mode but the last with the report so far (no 'environment': it
    would start CUDA in this process while a child runs; 'modes_left' instead), so that a bench cut
    short (a timeout, a closed terminal) keeps the modes it finished.
    """
    for mode in modes:
        parse_mode(mode)  # refuse a bad mode before spending minutes on the good ones
    results: list[dict[str, Any]] = []
    report = {"command": " ".join(sys.argv), "settings": asdict(settings), "results": results}
    for i, mode in enumerate(modes, 1):
        progress(
            f"[{i}/{len(modes)}] {mode}: building {settings.model}, compiling, timing "
            f"{settings.warmup} + {settings.steps} steps on {settings.device} ..."
        )
        start = time.perf_counter()
        # A scanner holding a cache file on Windows must not lose the whole A/B at cleanup.
        with tempfile.TemporaryDirectory(prefix="compile_accel_bench_", ignore_cleanup_errors=True) as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache} if warm else os.environ.copy()
            log = None if log_dir is None else log_dir / f"{mode}.log"
            if log is not None:
                log.unlink(missing_ok=True)  # an earlier bench's into the same --out
            result = _run_child(mode, settings, env, log)
            if warm and "oom" not in result:
                again = _run_child(mode, dataclasses.replace(settings, steps=1, warmup=0), env, log)
                result["warm_first_step_s"] = again["first_step_s"]
                result["warm_fxgraph_cache_hits"] = again["stats"]["fxgraph_cache_hits"]
                result["warm_compile_times"] = again["stats"]["compile_times"]
                result["warm_precompiled"] = again["stats"].get("precompiled")
        results.append(result)
        seconds = time.perf_counter() - start
        progress(f"[{i}/{len(modes)}] {mode}: {_progress_note(result, warm)}; {seconds:.0f} s in all")
        if on_report is not None and i < len(modes):
            on_report({**report, "modes_left": modes[i:]})
    return {"environment": environment(), **report}


def _progress_note(result: dict[str, Any], warm: bool) -> str:
    if "oom" in result:
        return f"OOM ({result['oom']})"
    warm_note = f", warm first step {result['warm_first_step_s']:.1f} s" if warm else ""
    return f"{result['step_s_median'] * 1e3:.1f} ms/step (first step {result['first_step_s']:.1f} s{warm_note})"


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
    # Before any CUDA work: this thread's work, and the backward of it, runs on the restricted stream.
    if settings.gpu_sms:
        gpu_like.restrict(settings.gpu_sms)
    if spec.config.mode != "off" or spec.torch_compile is not None:
        # Beside the model's build, as the sd-scripts launcher does beside the trainer's set-up.
        start_preloading()
        if settings.compile_workers and spec.config.mode != "off" and compile_workers.SUPPORTED:
            compile_workers.start(settings.compile_workers)
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
