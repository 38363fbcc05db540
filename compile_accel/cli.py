"""`compile-accel doctor`, `compile-accel bench` (compile_accel.benchmarks.command) and
`compile-accel sd-scripts`."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import time

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


def run_sd_scripts(args: argparse.Namespace) -> int:
    from .integrations import sd_scripts

    return sd_scripts.launch(args, "compile-accel sd-scripts")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="compile-accel", description="torch.compile for diffusion-transformer LoRA training"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check this setup: torch, triton, compiler, GPU, supported features")
    from .benchmarks import command as bench_command

    bench_command.add_parser(sub)
    from .integrations import sd_scripts

    s = sub.add_parser(
        "sd-scripts",
        help="run a kohya sd-scripts training script with compile_accel",
        description=sd_scripts.DESCRIPTION,
    )
    sd_scripts.add_launcher_arguments(s)
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return {"doctor": doctor, "bench": bench_command.bench, "sd-scripts": run_sd_scripts}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
