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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

import compile_accel
from compile_accel import CompileConfig

from .measure import SavedActivationMeter
from .models import MODELS

DEFAULT_MODES = ["eager+ckpt", "selective+ckpt", "blocks+budget=0.5", "blocks+budget=1.0"]


@dataclass
class ModeSpec:
    name: str
    config: CompileConfig
    checkpointing: bool
    whole_model: bool = False


def parse_mode(spec: str) -> ModeSpec:
    """'blocks+budget=0.5' -> blocks mode, budget 0.5, no checkpointing; ValueError if unknown."""
    head, _, rest = spec.partition("+")
    if head == "eager" and rest in ("", "ckpt"):
        return ModeSpec(spec, CompileConfig(mode="off"), rest == "ckpt")
    if head == "whole" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="off"), True, whole_model=True)
    if head == "selective" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="selective"), True)
    if head == "blocks" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="blocks"), True)
    if head == "blocks" and rest.startswith("budget="):
        try:
            budget = float(rest.removeprefix("budget="))
        except ValueError:
            raise ValueError(f"mode {spec!r}: budget must be a number in [0, 1]") from None
        config = CompileConfig(mode="blocks", activation_memory_budget=budget)
        config.validate()
        return ModeSpec(spec, config, False)
    raise ValueError(
        f"unknown mode {spec!r}; modes: eager, eager+ckpt, whole+ckpt, selective+ckpt, blocks+ckpt, blocks+budget=B"
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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


def run_mode(spec: ModeSpec, model_name: str, device: str, steps: int, warmup: int, lora_rank: int,
             batch: int | None = None, res: int | None = None) -> StepResult:
    """Build the model with LoRA, apply the mode, and time LoRA training steps."""
    torch.manual_seed(0)
    bench = MODELS[model_name](device, lora_rank, batch, res)
    model = bench.model
    model.train()
    if spec.checkpointing:
        bench.enable_checkpointing()
    acceleration = bench.accelerate(model, dataclasses.replace(spec.config, exclude=bench.exclude))
    if spec.whole_model:
        model.compile()
    optimizer = torch.optim.AdamW(bench.lora_params, lr=1e-4)

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
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(warmup):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - start)
    if device == "cuda":
        peak, kind, reserved = torch.cuda.max_memory_allocated(), "cuda max allocated", torch.cuda.max_memory_reserved()
    else:
        with SavedActivationMeter([*model.parameters(), *bench.lora_params]) as meter:
            bench.predict().float().square().mean().backward()
        optimizer.zero_grad(set_to_none=True)
        peak, kind, reserved = meter.bytes, "activation bytes saved for backward", None
    stats = acceleration.stats()
    if spec.whole_model:
        counters = torch._dynamo.utils.counters
        stats.update(unique_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))
    return StepResult(
        spec.name, model_name, bench.description, device, steps, statistics.median(times), min(times), first,
        peak, kind, reserved, loss, stats,
    )


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

    def flags(self) -> list[str]:
        flags = []
        for name, value in asdict(self).items():
            if value is not None:
                flags += [f"--{name.replace('_', '-')}", str(value)]
        return flags


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny: the embedded DiT; lumina2: diffusers Lumina 2 at full size (random weights)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="steps after the first (compile) step before timing")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--batch", type=int, help="batch size (default: the model's)")
    parser.add_argument("--res", type=int, help="image resolution in pixels (default: the model's)")


def run_ab(modes: list[str], settings: BenchSettings, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Each mode in a child process; returns {'environment', 'command', 'settings', 'results'}."""
    for mode in modes:
        parse_mode(mode)  # refuse a bad mode before spending minutes on the good ones
    results = []
    for i, mode in enumerate(modes, 1):
        progress(f"[{i}/{len(modes)}] {mode}: building {settings.model}, compiling, timing "
                 f"{settings.warmup} + {settings.steps} steps on {settings.device} ...")
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "compile_accel.benchmarks.runner", "--mode", mode, *settings.flags()]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if proc.returncode != 0:
            raise RuntimeError(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        progress(f"[{i}/{len(modes)}] {mode}: {result['step_s_median'] * 1e3:.1f} ms/step "
                 f"(first step {result['first_step_s']:.1f} s; {time.perf_counter() - start:.0f} s in all)")
    return {"environment": environment(), "command": " ".join(sys.argv), "settings": asdict(settings), "results": results}


def _format_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def markdown_table(report: dict[str, Any], baseline: str = "eager+ckpt") -> str:
    results = report["results"]
    base = next((r for r in results if r["mode"] == baseline), None)
    kind = results[0]["peak_kind"] if results else ""
    lines = [
        f"| mode | median s/step | min s/step | vs {baseline} | peak ({kind}) | reserved | first step s | graphs | recompiles | graph breaks | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        speedup = f"{base['step_s_median'] / r['step_s_median']:.2f}x" if base else "-"
        s = r["stats"]
        lines.append(
            f"| {r['mode']} | {r['step_s_median']:.4f} | {r['step_s_min']:.4f} | {speedup} | {_format_bytes(r['peak_bytes'])} "
            f"| {_format_bytes(r['reserved_bytes'])} | {r['first_step_s']:.1f} | {s.get('unique_graphs', 0)} "
            f"| {s.get('recompiles', 0)} | {s.get('graph_breaks', 0)} | {len(s.get('fallbacks', []))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Child-process entry: run one mode, print its result as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    add_settings_arguments(parser)
    args = parser.parse_args(argv)
    result = run_mode(parse_mode(args.mode), args.model, args.device, args.steps, args.warmup, args.lora_rank,
                      args.batch, args.res)
    print(json.dumps(asdict(result)), flush=True)


if __name__ == "__main__":
    main()
