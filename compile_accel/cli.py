"""`compile-accel doctor`, `compile-accel bench` and `compile-accel sd-scripts`."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .benchmarks.modes import ModeSpec


def _check_compile(device: str) -> str | None:
    """Compile and run a small function with inductor; the error text if that fails."""
    import torch

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ x.T).sum(-1)

    try:
        x = torch.randn(16, 16, device=device)
        torch.testing.assert_close(torch.compile(f, backend="inductor")(x), f(x), rtol=1e-3, atol=1e-3)
    except Exception as error:  # noqa: BLE001 - any failure means this setup cannot compile
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return None


def triton_status() -> tuple[str, str | None]:
    """(doctor's triton version text, the problem or None). On Windows the `triton` module comes
    from the triton-windows distribution, whose version (e.g. 3.3.1.post19) the module's own
    `__version__` lacks; the text names that build."""
    import torch

    try:
        import triton
    except ImportError:
        wheel = "triton-windows" if sys.platform == "win32" else "triton"
        problem = f"triton is missing: inductor cannot generate GPU kernels (pip install {wheel})"
        return "not installed", problem if torch.cuda.is_available() else None
    if "triton-windows" in importlib.metadata.packages_distributions().get("triton", []):
        return f"{importlib.metadata.version('triton-windows')} (triton-windows, the Windows build)", None
    return triton.__version__, None


# Modules of torch's compiler that every first compile imports.
COMPILER_MODULES = ("torch._dynamo.convert_frame", "torch._inductor.compile_fx", "torch._inductor.scheduler")


def bytecode_status(modules: tuple[str, ...] = COMPILER_MODULES) -> tuple[str, str | None]:
    """(doctor's bytecode text, a hint or None). A torch installed without bytecode
    (`__pycache__`), where Python writes none (PYTHONDONTWRITEBYTECODE, or a read-only install),
    compiles its compiler's sources again in every process: seconds of each first step."""
    import importlib.util

    sources = [getattr(importlib.util.find_spec(name), "origin", None) for name in modules]
    sources = [source for source in sources if source and source.endswith(".py")]
    missing = [source for source in sources if not os.path.exists(importlib.util.cache_from_source(source))]
    if not missing:
        return "yes", None
    unwritten = sys.dont_write_bytecode or not all(os.access(os.path.dirname(source), os.W_OK) for source in missing)
    if not unwritten:
        return "not yet (the first import writes it)", None
    package = os.path.dirname(importlib.util.find_spec("torch").origin)
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else "the install is read-only"
    return f"no, and none is written ({why})", (
        f"torch's compiler modules have no bytecode and {why}: every process compiles their sources again, "
        f"seconds of each first step. Byte-compile once (as pip does at install): python -m compileall -q {package}"
    )


def missing_compiler_status(missing: str | None) -> tuple[str | None, str | None]:
    """(doctor's problem, its hint) for a C++ compiler found missing (`missing`: why; None: found).
    On Windows with a GPU a hint only: triton-windows builds its launchers with a C compiler of
    its own, so GPU graphs of fixed shapes compile, dynamic shapes need MSVC."""
    import torch

    from . import dynamo_settings as ds

    if missing is None:
        return None, None
    if sys.platform == "win32" and torch.cuda.is_available():
        return None, (
            f"no C++ compiler ({missing}): GPU compiles of fixed shapes run, but {ds.MSVC_FOR_DYNAMIC_SHAPES}; "
            "without it the sd-scripts launcher compiles a graph per input size"
        )
    return (
        f"no C++ compiler: inductor needs one for CPU code and its wrappers (gcc/g++, or MSVC on Windows; "
        f"$CXX picks one): {missing}"
    ), None


def doctor(args: argparse.Namespace) -> int:
    import torch

    from . import dynamo_settings as ds

    problems = []
    print(f"torch            {torch.__version__}")
    triton_version, problem = triton_status()
    print(f"triton           {triton_version}")
    if problem:
        problems.append(problem)
    cxx, missing = ds.cpp_compiler()
    print(f"C++ compiler     {shutil.which(cxx) or cxx if cxx else 'not found'}")
    problem, hint = missing_compiler_status(missing)
    problems += [problem] if problem else []
    hints = [hint] if hint else []
    if torch.cuda.is_available():
        print(f"GPU              {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})")
    else:
        print("GPU              none (CPU only)")
    print(
        f"budget knob      {'yes' if ds.HAS_BUDGET_KNOB else 'no'} (torch._functorch.config.activation_memory_budget)"
    )
    print(
        f"per-thread config {'yes' if ds.PER_THREAD_DYNAMO_CONFIG else 'no'} (dynamo config is per thread since 2.12)"
    )
    print(
        f"recompile_limit= {'yes' if ds.COMPILE_TAKES_RECOMPILE_LIMIT else 'no'} (torch.compile(recompile_limit=...))"
    )
    print(f"cache artifacts  {'yes' if ds.HAS_CACHE_ARTIFACTS else 'no'} (torch.compiler.save_cache_artifacts)")
    print(
        f"eager backward   {'yes' if ds.HAS_EAGER_BACKWARD_KNOB else 'no'} "
        "(backward graphs compile with the forward: a compile error there falls back to eager)"
    )
    bytecode, hint = bytecode_status()
    hints += [hint] if hint else []
    print(f"bytecode         {bytecode} (torch's compiler modules)")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    print(f"cache directory  {cache_dir()}")
    if not ds.HAS_BUDGET_KNOB:
        problems.append("this torch has no activation_memory_budget (needs torch >= 2.4)")
    if cxx or torch.cuda.is_available():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        start = time.perf_counter()
        error = _check_compile(device)
        print(
            f"inductor check   {'ok' if error is None else 'FAILED'} on {device} ({time.perf_counter() - start:.1f} s)"
        )
        if error:
            problems.append(f"inductor could not compile a small function on {device}: {error}")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    for hint in hints:
        print(f"hint: {hint}", file=sys.stderr)
    print("usable" if not problems else "not usable")
    return 1 if problems else 0


def _refuse(message: str) -> int:
    print(f"compile-accel bench: {message}", file=sys.stderr)
    return 2


def _sd_scripts_option_refusal(args: argparse.Namespace, specs: list[ModeSpec]) -> str | None:
    """Why --fp8-base or --blocks-to-swap cannot run with this model and these modes, or None."""
    from .benchmarks.models import BLOCK_SWAP_MODELS, SD_SCRIPTS_MODELS
    from .config import CUDA_GRAPH_MODES, cuda_graph_refusal

    if args.fp8_base and args.model not in SD_SCRIPTS_MODELS:
        return f"--fp8-base is sd-scripts' --fp8_base, for {', '.join(SD_SCRIPTS_MODELS)}; not for {args.model}"
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
    from .benchmarks import plot

    if not ran["results"]:
        return " (no plot: every mode ran out of memory)"
    return f" and {path}" if plot.plot(ran, path) else " (no plot: matplotlib is not installed)"


def bench(args: argparse.Namespace) -> int:
    import torch

    from .benchmarks import gpu_like, runner
    from .benchmarks.modes import DEFAULT_MODES, parse_mode
    from .benchmarks.report import markdown_table, measured
    from .base_compute import base_compute_refusal
    from .compile_workers import wait_refusal
    from .config import CUDA_GRAPH_MODES

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
    report = runner.run_ab(
        modes,
        settings,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        warm=args.warm or args.compile_profile,
        log_dir=out,
    )
    if calibration is not None:
        report["gpu_like"] = calibration
    env, ran = report["environment"], measured(report)
    description = ran["results"][0]["description"] if ran["results"] else f"{args.model} (every mode ran out of memory)"
    print(
        f"\n{description}; {device} ({env['device_name']}), torch {env['torch']}; "
        f"median of {args.steps} steps after the first step and {args.warmup} warm-up steps\n"
    )
    print(markdown_table(report))
    if out is not None:
        (out / "bench.json").write_text(json.dumps(report, indent=2))
        (out / "bench.md").write_text(markdown_table(report) + "\n")
        print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'}{_plot(ran, out / 'bench.png')}")
    return 0


def run_sd_scripts(args: argparse.Namespace) -> int:
    from .integrations import sd_scripts

    return sd_scripts.launch(args, "compile-accel sd-scripts")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="compile-accel", description="torch.compile for diffusion-transformer LoRA training"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check this setup: torch, triton, compiler, GPU, supported features")
    b = sub.add_parser("bench", help="A/B compile settings on an embedded small DiT with LoRA")
    from .benchmarks.modes import DEFAULT_MODES, MODES_HELP

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
    from .benchmarks.gpu_like import CARDS

    b.add_argument(
        "--gpu-like",
        choices=sorted(CARDS),
        metavar="CARD",
        help=f"GPU only: measure as that card ({', '.join(sorted(CARDS))}): each mode runs on the fewest SMs whose "
        "measured bf16 matmul rate reaches the card's, under the card's memory size; the report says what is not "
        "emulated",
    )
    from .benchmarks.runner import add_settings_arguments

    add_settings_arguments(b)
    from .integrations import sd_scripts

    s = sub.add_parser(
        "sd-scripts",
        help="run a kohya sd-scripts training script with compile_accel",
        description=sd_scripts.DESCRIPTION,
    )
    sd_scripts.add_launcher_arguments(s)
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return {"doctor": doctor, "bench": bench, "sd-scripts": run_sd_scripts}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
