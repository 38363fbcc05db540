"""The launcher's command-line flags: added to an sd-scripts parser after the script's own, and
turned into the CompileConfig they ask for, or a LaunchError for combinations that cannot work.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from compile_accel import CompileConfig, compile_workers
from compile_accel.base_compute import base_compute_refusal
from compile_accel.config import cuda_graph_refusal
from compile_accel.dynamo_settings import HAS_BUDGET_KNOB, dynamic_shapes_refusal
from compile_accel.memory import gib_argument

SELECTIVE_ENV = "SDSCRIPTS_SELECTIVE_TORCH_COMPILE"
BUDGET_ENV = "SDSCRIPTS_TORCH_COMPILE_ACTIVATION_MEMORY_BUDGET"


class LaunchError(Exception):
    """The launcher cannot run this script as asked; the message says why."""


def say(message: str) -> None:
    """One line of the launcher's on standard error."""
    print(f"compile_accel: {message}", file=sys.stderr, flush=True)



def _budget(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] or auto, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


_DYNAMIC = {"auto": None, "true": True, "false": False}


# sd-scripts' own per-block compile (Anima's, library/compile_utils.py after the sd3 branch):
# --compile turns it on; the others configure it. --compile_dynamic is also ours, with the same
# values and meaning: where the script defines it, both compilers read the script's flag.
SD_SCRIPTS_COMPILE = "--compile"
SD_SCRIPTS_COMPILE_SETTINGS = (
    "--compile_backend",
    "--compile_mode",
    "--compile_fullgraph",
    "--compile_cache_size_limit",
)
SHARED_DYNAMIC = "--compile_dynamic"


def add_arguments(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Add the compile_accel flags to an sd-scripts parser, after the script's own; returns the
    flags of sd-scripts' own compile that the parser has, with their defaults (`config_from_args`
    takes them)."""
    defined = parser._option_string_actions  # argparse's table of option strings
    theirs = {
        flag: defined[flag].default
        for flag in (SD_SCRIPTS_COMPILE, *SD_SCRIPTS_COMPILE_SETTINGS, SHARED_DYNAMIC)
        if flag in defined
    }
    group = parser.add_argument_group("compile_accel (per-block torch.compile)")
    try:
        group.add_argument(
            "--selective_torch_compile",
            action="store_true",
            default=os.environ.get(SELECTIVE_ENV, "0") == "1",
            help=f"compile the compute modules inside each DiT/U-Net block and keep --gradient_checkpointing "
            f"(also on with {SELECTIVE_ENV}=1)",
        )
        group.add_argument(
            "--activation_memory_budget",
            type=_budget,
            default=os.environ.get(BUDGET_ENV),  # a string default goes through type=, as typed
            help="compile each whole block and keep this fraction (0..1) of its activations for backward, "
            "recomputing the rest; replaces --gradient_checkpointing for those blocks (0: least memory). "
            "auto: the fastest budget whose peak fits --vram_limit_gib, timed on the first step; with block "
            "swap (Flux, SD3, Lumina 2, Anima, HunyuanImage) it swaps more blocks than --blocks_to_swap when "
            "none fits "
            f"(also set by {BUDGET_ENV}, the name of the original sd-scripts pull request)",
        )
        group.add_argument(
            "--vram_limit_gib",
            type=gib_argument,
            default=None,
            help="the peak memory --activation_memory_budget auto must fit (default: the GPU's free memory "
            "less a margin)",
        )
        group.add_argument(
            "--no_compile_cache",
            action="store_true",
            help="do not keep the compiled graphs of this run in the compile_accel cache directory "
            "($COMPILE_ACCEL_CACHE_DIR, default ~/.cache/compile_accel/compiled), from which the next run of the same "
            "training loads them instead of compiling",
        )
        if SHARED_DYNAMIC not in theirs:
            group.add_argument(
                SHARED_DYNAMIC,
                choices=sorted(_DYNAMIC),
                default="auto",
                help="true: one graph for all aspect-ratio buckets (symbolic shapes); false: one graph per shape; "
                "auto: static first, dynamic on the first new shape (default)",
            )
        group.add_argument(
            "--compile_recompile_limit",
            type=_positive_int,
            default=CompileConfig.recompile_limit,
            help=f"graphs per block function before dynamo runs new inputs eager "
            f"(default {CompileConfig.recompile_limit}; raise it for many buckets)",
        )
        group.add_argument(
            "--compile_workers",
            type=_positive_int,
            default=None,
            metavar="N",
            help="compile the graphs in N worker processes while the first steps run them uncompiled: the first "
            "step takes seconds instead of minutes; each worker holds ~0.5 GiB of GPU memory until every graph is "
            "back (on Windows the training script's start must be under if __name__ == '__main__', as sd-scripts' are)",
        )
        group.add_argument(
            "--compile_workers_wait",
            action="store_true",
            help="with --compile_workers: the first step waits until every graph is back from the workers, which "
            "compile them at the same time, so that every step after it runs compiled",
        )
        group.add_argument(
            "--compile_fast",
            action="store_true",
            help="compile without inductor's pattern matcher, pointwise autotuning and second config for "
            "register-heavy reductions: seconds less per compile and up to a second less per restart, ~1-2%% "
            "slower steps on a 4090's compute",
        )
        group.add_argument(
            "--base_compute",
            choices=["int8", "fp8"],
            default=None,
            help="run the frozen base model's matmuls inside the compiled blocks in 8 bits, forward and input "
            "gradient each where it gains (on CUDA, outputs 2048 wide or more), the LoRA in its own dtype "
            "(int8: CUDA GPUs of compute capability 8.0 or newer; fp8: 8.9 or "
            "newer, --fp8_base weights multiplied as they are)",
        )
        group.add_argument(
            "--compile_cuda_graphs",
            action="store_true",
            help="with --activation_memory_budget B or auto: replay each compiled block as a CUDA graph (inductor's "
            "reduce-overhead mode), one launch instead of hundreds, for steps bound by kernel launches (SDXL with "
            "LoRA); with --selective_torch_compile: the forward of each block under a reentrant checkpoint (SDXL), "
            "the recompute and backward without; not with --blocks_to_swap (moved weights are recorded again at "
            "every move)",
        )
    except argparse.ArgumentError as error:
        raise LaunchError(
            f"this sd-scripts already defines {error.argument_name}: it has compile flags of its own that the "
            "compile_accel launcher would shadow; run the script without the launcher"
        ) from None
    return theirs


def config_from_args(args: argparse.Namespace, theirs: dict[str, Any] | None = None) -> CompileConfig | None:
    """The CompileConfig the flags ask for, None for none; LaunchError for combinations that cannot
    work. `theirs`: the flags of sd-scripts' own compile the script defines, with their defaults
    (`add_arguments`)."""
    theirs = theirs or {}
    budget, selective = args.activation_memory_budget, args.selective_torch_compile
    dynamic = "auto" if args.compile_dynamic is None else args.compile_dynamic  # (None: sd-scripts' default)
    if dynamic not in _DYNAMIC:
        raise LaunchError(f"--compile_dynamic {dynamic}: compile_accel takes {', '.join(sorted(_DYNAMIC))}")
    if args.vram_limit_gib is not None and budget != "auto":
        raise LaunchError("--vram_limit_gib is the limit of --activation_memory_budget auto; give that too")
    if budget is None and not selective:
        if (
            (dynamic != "auto" and SHARED_DYNAMIC not in theirs)
            or args.compile_recompile_limit != CompileConfig.recompile_limit
            or args.no_compile_cache
            or args.compile_workers
            or args.compile_workers_wait
            or args.compile_cuda_graphs
            or args.compile_fast
            or args.base_compute
        ):
            raise LaunchError(
                "--compile_dynamic, --compile_recompile_limit, --no_compile_cache, --compile_workers(_wait), "
                "--compile_cuda_graphs, --compile_fast and --base_compute need --selective_torch_compile or "
                "--activation_memory_budget"
            )
        return None
    asked = "--activation_memory_budget" if budget is not None else f"--selective_torch_compile ({SELECTIVE_ENV})"
    if budget is not None and selective:
        raise LaunchError(
            "--selective_torch_compile and --activation_memory_budget are two ways to compile the blocks; "
            f"choose one (is {SELECTIVE_ENV}=1 set?)"
        )
    if getattr(args, "torch_compile", False):
        raise LaunchError(
            f"--torch_compile compiles the whole model through accelerate; {asked} compiles its blocks instead. "
            "Drop --torch_compile"
        )
    if getattr(args, "deepspeed", False):
        raise LaunchError(f"{asked} does not support --deepspeed (its model wrapper hides the blocks)")
    for flag in SD_SCRIPTS_COMPILE_SETTINGS:
        dest = flag.removeprefix("--")
        if flag in theirs and getattr(args, dest) != theirs[flag]:
            raise LaunchError(
                f"{flag} configures sd-scripts' own --compile, which {asked} replaces on the blocks it compiles; "
                f"drop {flag}"
            )
    if args.compile_workers_wait:
        auto = "--activation_memory_budget auto" if budget == "auto" else None
        flags = ("--compile_workers_wait", "--compile_workers")
        refusal = compile_workers.wait_refusal(args.compile_workers, auto, *flags)
        if refusal:
            raise LaunchError(refusal)
    if args.compile_workers and not compile_workers.SUPPORTED:
        raise LaunchError(
            f"--compile_workers {compile_workers.UNSUPPORTED_WHY} (this is torch {torch.__version__} on "
            f"{sys.platform}); drop the flag"
        )
    if budget is not None and not HAS_BUDGET_KNOB:
        raise LaunchError(f"--activation_memory_budget needs torch >= 2.4 (this is {torch.__version__})")
    refusal = dynamic_shapes_refusal() if dynamic != "false" else None
    if refusal and dynamic == "true":
        raise LaunchError(f"--compile_dynamic true: {refusal}; or give --compile_dynamic false (a graph per size)")
    if refusal:  # auto: a graph per size, which compiles without MSVC
        say(f"compiling a graph per input size (--compile_dynamic false): {refusal}")
        dynamic = "false"
    config = CompileConfig(
        mode="blocks" if budget is not None else "selective",
        activation_memory_budget=budget,
        vram_limit_gib=args.vram_limit_gib,
        dynamic=_DYNAMIC[dynamic],
        recompile_limit=args.compile_recompile_limit,
        compile_workers=args.compile_workers or 0,
        fast_compile=args.compile_fast,
    )
    if args.base_compute:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where sd-scripts trains
        refusal = base_compute_refusal(args.base_compute, {device})
        if refusal:
            raise LaunchError(f"--base_compute {args.base_compute}: {refusal}")
        config.base_compute = args.base_compute
    if args.compile_cuda_graphs:
        refusal = cuda_graph_refusal(config, "--blocks_to_swap" if getattr(args, "blocks_to_swap", None) else None)
        if refusal:
            raise LaunchError(f"--compile_cuda_graphs: {refusal}")
        config.compile_mode = "reduce-overhead"
    return config
