"""The launch: a training script run as `__main__` with the launcher's hooks in place (see the
package docstring), and what it says at the first step and at exit.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import runpy
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from compile_accel import Acceleration, CompileConfig, compile_workers
from compile_accel.adapters import UnknownLayout
from compile_accel.compile_cache import RunCompileCache
from compile_accel.config import CUDA_GRAPH_MODES
from compile_accel.dynamo_settings import HAS_CACHE_ARTIFACTS, cpp_compiler
from compile_accel.first_step import end_first_step
from compile_accel.memory import spill_warning
from compile_accel.preload import start_preloading, wait_for_preload
from compile_accel.stats import warn

from . import families
from .flags import SD_SCRIPTS_COMPILE, LaunchError, add_arguments, config_from_args, say

# A first step that compiled this long without --compile_workers gets a hint to use them: with
# workers sd-scripts' first steps take seconds, in process up to minutes
# (benchmarks/results/h200_workers_every_family/README.md, docs/sd-scripts.md).
WORKERS_HINT_SECONDS = 20.0
# At the end of training, how long to wait for graphs still being precompiled in the workers
# (compile_accel.precompile): several times the ~10 s after the first step they take
# (benchmarks/results/h200_precompile/README.md).
PRECOMPILE_WAIT_SECONDS = 60.0


def _missing_compiler(device: torch.device) -> str | None:
    """Why inductor cannot generate code for `device` here, or None."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "triton is not installed (pip install triton; triton-windows on Windows)"
    missing = cpp_compiler()[1]
    return None if missing is None else f"no C++ compiler for inductor's CPU code ({missing})"


class Launch:
    """One run of a training script: the flags it parsed and the model it accelerated."""

    def __init__(self) -> None:
        self.args: argparse.Namespace | None = None
        self.config: CompileConfig | None = None
        self.acceleration: Acceleration | None = None
        self.compile_cache: RunCompileCache | None = None
        self._reported_first_step = False
        self._can_swap_blocks = False  # the trained model has sd-scripts' block swap
        self._warned_of_spill = False
        # Graphs out in the compile workers at the first step: once as many are back and running
        # compiled, the run's cache file is saved again (the first step's save lacks them).
        self._resave_after: int | None = None
        self._watched: weakref.WeakSet[argparse.ArgumentParser] = weakref.WeakSet()

    def watch(self, parser: argparse.ArgumentParser) -> None:
        """Add the compile flags to `parser` at its first parse, when the script has added its own,
        and check them after every parse (the command line, then --config_file's). Once per parser."""
        if parser in self._watched:
            return
        self._watched.add(parser)
        parse_known_args = parser.parse_known_args
        theirs: dict[str, Any] | None = None  # sd-scripts' own compile flags (add_arguments)

        def checked(*args: Any, **kwargs: Any) -> tuple[argparse.Namespace, list[str]]:
            nonlocal theirs
            if theirs is None:
                theirs = add_arguments(parser)
            namespace, rest = parse_known_args(*args, **kwargs)
            try:
                self.config = config_from_args(namespace, theirs)
            except LaunchError as error:
                parser.error(str(error))
            if self.config is not None and getattr(namespace, "compile", False) and SD_SCRIPTS_COMPILE in theirs:
                namespace.compile = False  # never two compilers on one block
                say(f"sd-scripts' own --compile is off: compile_accel compiles the blocks ({self.config.mode} mode)")
            self.args = namespace
            if self.config is not None:
                # The script's own set-up (weights, latents, text encoders) runs beside the
                # preload and the compile workers' start until accelerate(), at Accelerator.prepare.
                start_preloading()
            if self.config is not None and self.config.compile_workers:
                compile_workers.start(self.config.compile_workers)
            else:  # (a --config_file that compiles nothing after a command line that did)
                compile_workers.stop()
            return namespace, rest

        parser.parse_known_args = checked

    def accelerate(self, model: nn.Module, device: torch.device) -> None:
        """Accelerate the run's model, once, if the flags asked for it."""
        self._can_swap_blocks = hasattr(model, "enable_block_swap")
        if self.config is None or self.acceleration is not None:
            return
        wait_for_preload()  # _missing_compiler imports triton and inductor's C++ builder
        if self.config.compile_mode in CUDA_GRAPH_MODES and device.type != "cuda":
            raise LaunchError(f"--compile_cuda_graphs records CUDA graphs, and this run's device is {device}")
        missing = _missing_compiler(device)
        if missing:
            if self.config.activation_memory_budget is not None:
                raise LaunchError(f"--activation_memory_budget needs inductor, which cannot run here: {missing}")
            say(f"{missing}; training continues eager")
            self.config = None
            compile_workers.stop()
            return
        try:
            self.acceleration = families.apply(model, self.config)
        except UnknownLayout as error:  # this checkout's models are not the ones the launcher knows
            raise unknown_layout(str(error)) from None
        if HAS_CACHE_ARTIFACTS and not self.args.no_compile_cache:
            self.compile_cache = RunCompileCache(model, self.acceleration.signature, self.acceleration)
            self.acceleration.on_remove(self.compile_cache.remove)
        switched = self.acceleration.stats()["checkpointing_switched_off"]
        say(
            f"{self.config.mode} compile of {type(model).__name__} "
            f"{[b.path for b in self.acceleration.block_lists]}: {len(self.acceleration.regions)} regions"
        )
        if switched:
            say(
                f"--activation_memory_budget {self.config.activation_memory_budget} replaces gradient "
                f"checkpointing of the compiled blocks: {len(switched)} checkpoint switches (the "
                f"gradient_checkpointing flags of the model and its blocks) turned off: {', '.join(switched[:4])}"
                f"{', ...' if len(switched) > 4 else ''}"
            )
        atexit.register(self.report)

    def step_done(self, device: torch.device) -> None:
        """After every backward: a warning if the step spilled out of the GPU's memory; the first
        step's report, then the run's cache file saved again once the graphs that were in the
        compile workers at the first step run compiled."""
        if device.type == "cuda" and not self._warned_of_spill:
            self._warn_of_spill(device)
        if self.acceleration is None:
            return
        if not self._reported_first_step:
            self.first_step_done()
        elif (
            self._resave_after is not None
            and self._graphs_back() >= self._resave_after
            and self._auto_waiting_for() is None
        ):
            self._resave()

    def _warn_of_spill(self, device: torch.device) -> None:
        """Once a run: the step reserved more than the GPU has (memory.spill_warning), and the flag
        that keeps it within."""
        if self.config is not None and self.config.activation_memory_budget == "auto":
            fix = "a lower --vram_limit_gib than auto's (the first step's report says which) leaves the rest more room"
        else:
            swapping = ", swapping more blocks where no budget fits" if self._can_swap_blocks else ""
            fix = f"--activation_memory_budget auto keeps the steps within the GPU's memory{swapping}"
        message = spill_warning(device, fix)
        if message is not None:
            self._warned_of_spill = True
            warn(message)

    def _auto_waiting_for(self) -> str | None:
        """What auto's calibration waits for from the compile workers, if anything."""
        auto = self.acceleration.auto_budget
        return None if auto is None else auto.waiting_for

    def _graphs_back(self) -> int:
        """Graphs handed to the compile workers that run compiled now (or failed there)."""
        stats = self.acceleration.stats()
        return stats["worker_graphs_compiled"] + len(stats["worker_failures"])

    def _resave(self) -> None:
        self._resave_after = None
        stats = self.acceleration.stats()
        saved = self.compile_cache.save()
        said = [f"compiled graphs saved to {self.compile_cache.path}"] if saved else []
        if stats["worker_graphs_started"]:
            compiled = f"{stats['worker_graphs_compiled']} of {stats['worker_graphs_started']}"
            said.insert(0, f"{compiled} graphs from the compile workers run compiled")
        if said:
            say("; ".join(said))

    def first_step_done(self) -> None:
        """Once, after the first backward: what compiling cost, and what auto chose."""
        if self.acceleration is None or self._reported_first_step:
            return
        self._reported_first_step = True
        # (Before the stats and the cache's save below: they see the workers' graphs compiled.)
        waiting_asked = self.args is not None and self.args.compile_workers_wait
        waited_for = compile_workers.wait_and_load() if waiting_asked else 0
        stats = self.acceleration.stats()
        has_cache = self.compile_cache is not None and self.compile_cache.path is not None
        ended = end_first_step(self.acceleration, self.compile_cache if has_cache else None)
        auto = stats.get("auto_budget")
        auto_waiting = self._auto_waiting_for()
        chose = ""
        if auto:
            offload = f" at {auto['offload_name']} {auto['offload']:g}" if auto["offload_name"] else ""
            chose = f"; auto chose budget {auto['budget']}{offload}{' (cached)' if auto['cached'] else ''}"
        elif auto_waiting is not None:
            chose = f"; auto goes on once {auto_waiting} are back from the compile workers"
        waiting = stats["worker_graphs_started"] - self._graphs_back()
        cache = ""
        if has_cache:
            loaded = "loaded from" if self.compile_cache.loaded else "not yet in"
            saved = ", saved there" if ended.saved_bytes else ""
            if waiting or auto_waiting is not None:  # the file lacks them: saved again once back
                self._resave_after = stats["worker_graphs_started"]
                compiled = "auto has chosen" if auto_waiting else "the compile workers' graphs run compiled"
                saved += f" (again once {compiled})"
            cache = f"; compiled graphs {loaded} {self.compile_cache.path}{saved}"
            precompiled = sum(f.precompiled.used for f in self.acceleration.functions)
            if precompiled:
                cache += f", {precompiled} of them precompiled at an earlier start (run without dynamo's trace)"
        times = self.acceleration.compile_times()
        could_use_workers = not self.acceleration.config.compile_workers and compile_workers.SUPPORTED
        if waited_for:
            workers = f"; waited for the {waited_for} graphs compiling in the workers (--compile_workers_wait)"
        elif waiting:
            workers = (
                f"; {waiting} graphs from the compile workers not running compiled yet (run uncompiled until then; "
                "the compile_accel log says when each does)"
            )
        elif could_use_workers and times.total_s >= WORKERS_HINT_SECONDS:
            workers = (
                f"; --compile_workers {max(1, min(8, (os.cpu_count() or 2) // 2))} would compile the graphs in worker "
                "processes while the first steps run them uncompiled"
            )
        else:
            workers = ""
        say(
            f"first step done: {times.summary()}; {stats['unique_graphs']} "
            f"graphs, {stats['recompiles']} recompiles, {len(stats['fallbacks'])} fallbacks{chose}{cache}{workers}"
        )
        if ended.frozen is not None:
            say(
                f"{ended.frozen} Python objects frozen out of the garbage collector's passes (a full pass over what "
                "compiling leaves takes a step's time; gc.unfreeze() undoes it)"
            )

    def report(self) -> None:
        if self._auto_waiting_for() is not None:
            say(
                f"auto did not finish: training ended while it waited for {self._auto_waiting_for()} from the "
                "compile workers; nothing was cached, and the next run calibrates again"
            )
        if self._resave_after is not None:  # training ended before the workers' graphs ran compiled
            self._resave()
        precompiling = None if self.compile_cache is None else self.compile_cache.precompiling
        if precompiling is not None and precompiling.join(PRECOMPILE_WAIT_SECONDS) is None:
            say(
                f"the graphs precompiled for the next start were not back from the compile workers after "
                f"{PRECOMPILE_WAIT_SECONDS} s more; the next start compiles as usual"
            )
        stats = self.acceleration.stats()
        keys = ("compiled_regions", "unique_graphs", "recompiles", "graph_breaks", "compile_seconds", "fallbacks")
        say(", ".join(f"{k}={stats[k]:.1f}" if k == "compile_seconds" else f"{k}={stats[k]}" for k in keys))


# The sd-scripts the launcher is tested against (.ci/e2e pins the first; SD_SCRIPTS_COMMIT picks the second).
KNOWN_TO_WORK = "sd3 branch at 3265f2ed (2026-02-16) and main at c162e903 (2026-06-18)"


def unknown_layout(what: str) -> LaunchError:
    """The error that stops a launch, before training, at a checkout whose hook points differ."""
    return LaunchError(
        f"unknown sd-scripts layout: {what}. Nothing was trained; the launcher is known to work with sd-scripts' "
        f"{KNOWN_TO_WORK}"
    )


def _argument_modules() -> list[Any]:
    """The modules whose add_training_arguments a trainer may call: library.train_util, and
    library.args where it exists (newer sd-scripts define the function there and re-export it
    from train_util; their trainers call either)."""
    try:
        from library import train_util
    except ImportError as error:
        raise unknown_layout(f"cannot import library.train_util ({error})") from None
    modules = [train_util]
    try:
        has_args = importlib.util.find_spec("library.args") is not None
    except ModuleNotFoundError:  # (`library` not a package)
        has_args = False
    if has_args:
        modules.append(importlib.import_module("library.args"))
    modules = [m for m in modules if hasattr(m, "add_training_arguments")]
    if not modules:
        raise unknown_layout("neither library/train_util.py nor library/args.py has add_training_arguments")
    return modules


def _install_hooks(launch: Launch) -> None:
    """Wrap add_training_arguments, Accelerator.prepare and Accelerator.backward (see the module docstring)."""
    modules = _argument_modules()
    from accelerate import Accelerator

    prepare = Accelerator.prepare
    backward = Accelerator.backward

    def with_ours(add_training_arguments: Any) -> Any:
        def add_training_arguments_and_ours(parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
            add_training_arguments(parser, *args, **kwargs)
            launch.watch(parser)

        return add_training_arguments_and_ours

    def prepare_accelerated(accelerator: Accelerator, *args: Any, **kwargs: Any) -> Any:
        model = next((a for a in args if families.is_sd_scripts_model(a)), None)
        if model is not None:
            if launch.args is None:  # never train uncompiled without saying so
                raise unknown_layout(
                    f"{type(model).__name__} reached Accelerator.prepare, but the script parsed its arguments "
                    "without add_training_arguments of library/train_util.py or library/args.py, so the compile "
                    "flags were never read"
                )
            launch.accelerate(model, accelerator.device)
        return prepare(accelerator, *args, **kwargs)

    def backward_reported(accelerator: Accelerator, *args: Any, **kwargs: Any) -> Any:
        result = backward(accelerator, *args, **kwargs)
        launch.step_done(accelerator.device)
        return result

    for module in modules:
        module.add_training_arguments = with_ours(module.add_training_arguments)
    Accelerator.prepare = prepare_accelerated
    Accelerator.backward = backward_reported


def _resolve(script: str, sd_scripts: str | None) -> tuple[Path, Path]:
    """(script path, checkout directory); LaunchError naming what was looked for."""
    path = Path(script)
    if sd_scripts is not None and not path.is_file():
        path = Path(sd_scripts) / script
    if not path.is_file():
        raise LaunchError(f"no training script at {path}")
    root = Path(sd_scripts) if sd_scripts is not None else path.resolve().parent
    if not (root / "library" / "train_util.py").is_file():
        raise LaunchError(
            f"{root} is not an sd-scripts checkout (looked for library/train_util.py); pass --sd-scripts DIR"
        )
    return path.resolve(), root.resolve()


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's own arguments: everything after the script goes to the script."""
    parser.add_argument("--sd-scripts", metavar="DIR", help="the sd-scripts checkout (default: the script's directory)")
    parser.add_argument("script", help="an sd-scripts training script, e.g. lumina_train_network.py")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="the script's arguments; its --help lists the compile flags"
    )


def run(script: str, args: list[str], sd_scripts: str | None = None) -> None:
    """Run `script` with `args` as `__main__`, with the compile flags added to its parser."""
    path, root = _resolve(script, sd_scripts)
    sys.path.insert(0, str(root))
    _install_hooks(Launch())
    sys.argv = [str(path), *args]
    runpy.run_path(str(path), run_name="__main__")


def launch(options: argparse.Namespace, prog: str) -> int:
    """Run the parsed launcher arguments; exit status 2 with one line for a LaunchError."""
    try:
        run(options.script, options.args, options.sd_scripts)
    except LaunchError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    return 0


DESCRIPTION = "run a kohya sd-scripts training script with per-block torch.compile, the checkout unchanged"


def main(argv: list[str] | None = None) -> int:
    prog = "python -m compile_accel.integrations.sd_scripts"
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_launcher_arguments(parser)
    return launch(parser.parse_args(argv), prog)
