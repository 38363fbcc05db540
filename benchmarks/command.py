"""`compile-accel bench`: its arguments, the refusals that come before any mode runs, and the run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .modes import ModeSpec


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `bench` subcommand and its arguments."""
    from .gpu_like import CARDS
    from .modes import DEFAULT_MODES, MODES_HELP
    from .runner import add_settings_arguments

    b = sub.add_parser("bench", help="A/B compile settings on an embedded small DiT with LoRA")
    b.add_argument("--modes", help=f"comma-separated from: {MODES_HELP} (default: {','.join(DEFAULT_MODES)})")
    b.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if present, else cpu")
    b.add_argument("--out", help="directory for bench.json, bench.md and each mode's log (<mode>.log)")
    b.add_argument(
        "--warm",
        action="store_true",
        help="start each mode from an empty inductor cache of its own (cold), then time one more first step "
        "from that cache (the warm-start column)",
    )
    b.add_argument(
        "--compile-profile",
        action="store_true",
        help="--warm, and a table of each mode's first step cold and warm split into compile phases (dynamo, "
        "guards, AOTAutograd, inductor, kernel compilation, autotuning) and running the step",
    )
    b.add_argument(
        "--gpu-like",
        choices=sorted(CARDS),
        metavar="CARD",
        help=f"GPU only: measure as that card ({', '.join(sorted(CARDS))}): each mode runs on the fewest SMs whose "
        "measured bf16 matmul rate reaches the card's, under the card's memory size; the report says what is not "
        "emulated",
    )
    add_settings_arguments(b)


def _refuse(message: str) -> int:
    print(f"compile-accel bench: {message}", file=sys.stderr)
    return 2


def _sd_scripts_option_refusal(args: argparse.Namespace, specs: list[ModeSpec]) -> str | None:
    """Why --fp8-base, --fp8-scaled or --blocks-to-swap cannot run with this model and these modes, or None."""
    from .models import BLOCK_SWAP_MODELS, FP8_BASE_MODELS, FP8_SCALED_MODELS
    from compile_accel.config import CUDA_GRAPH_MODES, cuda_graph_refusal

    if args.fp8_base and args.model not in FP8_BASE_MODELS:
        return f"--fp8-base is sd-scripts' --fp8_base, for {', '.join(FP8_BASE_MODELS)}; not for {args.model}"
    if args.fp8_scaled and args.model not in FP8_SCALED_MODELS:
        return f"--fp8-scaled is sd-scripts' --fp8_scaled, for {', '.join(FP8_SCALED_MODELS)}; not for {args.model}"
    if args.blocks_to_swap is None:
        return None
    if args.model not in BLOCK_SWAP_MODELS:
        return f"--blocks-to-swap is sd-scripts' block swap, in {', '.join(BLOCK_SWAP_MODELS)}; not in {args.model}"
    moving = [s.name for s in specs if s.offload is not None or s.ddp > 1 or s.split > 1]
    if moving:
        return f"--blocks-to-swap moves the blocks itself; {moving[0]} moves them too (+offload, +ddp, +split)"
    recording = [s for s in specs if s.config.compile_mode in CUDA_GRAPH_MODES]
    if recording:
        return f"{recording[0].name}: {cuda_graph_refusal(recording[0].config, '--blocks-to-swap')}"
    return None


def _vram_cap_refusal(args: argparse.Namespace, device: str) -> str | None:
    """Why --vram-cap-gib cannot run here, or None."""
    import torch

    if args.vram_cap_gib is None:
        return None
    if device == "cpu":
        return "--vram-cap-gib caps GPU memory, and this run is on the CPU"
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if args.vram_cap_gib > total:
        return f"--vram-cap-gib {args.vram_cap_gib:g} is more than this GPU's {total:.1f} GiB"
    return None


def _plot(ran: dict, path: Path) -> str:
    """Plot the modes that ran; how the "wrote ..." line ends."""
    from . import plot

    if not ran["results"]:
        return " (no plot: every mode ran out of memory)"
    return f" and {path}" if plot.plot(ran, path) else " (no plot: matplotlib is not installed)"


def bench(args: argparse.Namespace) -> int:
    import torch

    from . import gpu_like, runner
    from .modes import DEFAULT_MODES, parse_mode
    from .report import markdown_table, measured
    from compile_accel.base_compute import base_compute_refusal
    from compile_accel.compile_workers import wait_refusal
    from compile_accel.config import CUDA_GRAPH_MODES

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    modes = args.modes.split(",") if args.modes else DEFAULT_MODES
    # Refusals come before the first mode runs, so a bad flag costs no compile.
    try:
        specs = [parse_mode(mode) for mode in modes]
    except ValueError as error:
        return _refuse(str(error))
    if device == "cuda" and not torch.cuda.is_available():
        return _refuse("--device cuda, but this torch sees no CUDA device")
    auto = [s.name for s in specs if s.config.activation_memory_budget == "auto"]
    if auto and device == "cpu" and args.vram_limit_gib is None:
        return _refuse(f"{auto[0]} on the CPU needs --vram-limit-gib (the limit for the bytes saved for backward)")
    if args.compile_workers_wait:
        refusal = wait_refusal(
            args.compile_workers, auto[0] if auto else None, "--compile-workers-wait", "--compile-workers"
        )
        if refusal:
            return _refuse(refusal)
    refusal = _sd_scripts_option_refusal(args, specs) or _vram_cap_refusal(args, device)
    if not refusal and (args.gpu_like or args.gpu_sms):
        flag = "--gpu-like" if args.gpu_like else "--gpu-sms"
        refusal = gpu_like.refusal(flag, device, specs, args.vram_cap_gib, args.gpu_sms)
    if refusal:
        return _refuse(refusal)
    for spec in specs:
        refusal = base_compute_refusal(spec.config.base_compute, {torch.device(device)})
        if refusal:
            return _refuse(f"{spec.name}: {refusal}")
    recording = [s.name for s in specs if s.config.compile_mode in CUDA_GRAPH_MODES]
    if recording and device == "cpu":
        return _refuse(f"{recording[0]} records CUDA graphs, and this run is on the CPU")
    calibration = None
    if args.gpu_like:
        print(f"measuring this GPU's matmul rate at SM counts until it reaches {args.gpu_like}'s ...", file=sys.stderr)
        try:
            calibration = gpu_like.calibrate(args.gpu_like)
        except ValueError as error:
            return _refuse(f"--gpu-like {args.gpu_like}: {error}")
        print(gpu_like.note(calibration), file=sys.stderr)
        refusal = gpu_like.cuda_graph_refusal(calibration)
        if recording and refusal:
            return _refuse(f"{recording[0]}: {refusal}")
        args.gpu_sms, args.vram_cap_gib = calibration["sms"], calibration["card_spec"]["memory_gib"]
    settings = runner.BenchSettings.from_args(args, device)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    def write(report: dict) -> None:
        if calibration is not None:
            report["gpu_like"] = calibration
        if out is not None:
            (out / "bench.json").write_text(json.dumps(report, indent=2))
            (out / "bench.md").write_text(markdown_table(report) + "\n")

    report = runner.run_ab(
        modes,
        settings,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        warm=args.warm or args.compile_profile,
        log_dir=out,
        on_report=write,
    )
    write(report)
    env, ran = report["environment"], measured(report)
    description = ran["results"][0]["description"] if ran["results"] else f"{args.model} (every mode ran out of memory)"
    print(
        f"\n{description}; {device} ({env['device_name']}), torch {env['torch']}; "
        f"median of {args.steps} steps after the first step and {args.warmup} warm-up steps\n"
    )
    print(markdown_table(report))
    if out is not None:
        print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}{_plot(ran, out / 'bench.png')}")
    return 0
