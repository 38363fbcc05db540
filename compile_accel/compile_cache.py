"""Carry compiled graphs between runs and machines: PyTorch's portable cache artifacts.

Inductor already keeps its compiled graphs in TORCHINDUCTOR_CACHE_DIR (a temporary directory
by default), so a second run on the same machine finds them while that directory lasts. The
artifacts saved here (inductor, AOTAutograd and autotuning entries,
`torch.compiler.save_cache_artifacts`) are one file that outlives it, can be copied to another
machine or a fresh container, and fills the caches before the first compile there. The
artifacts are only used for graphs compiled again with the same torch, the same inputs and the
same settings; anything else compiles as usual.

`save_compile_cache` / `load_compile_cache` work with a file you name. `RunCompileCache` keeps
one file per run in the user's cache directory (compile_accel.cache_files: model, what is
compiled and how, input shapes, GPU, torch version), loads it on the model's first forward and
saves it after the first step (the sd-scripts launcher and the bench, which use it, save it
again once the graphs then in the compile workers run compiled: a graph is in the artifacts
once this process loaded it). Beside it, under the same key, the regions' precompiled graphs
(compile_accel.precompile), which a warm start runs without dynamo's trace: with compile
workers, traced at the first save while the worker pool is up (and auto has chosen), written
once the workers compiled them.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from . import compile_workers, precompile
from .cache_files import cache_dir, run_inputs, run_key, write_atomically
from .dynamo_settings import HAS_CACHE_ARTIFACTS
from .stats import warn

if TYPE_CHECKING:
    from .api import Acceleration

logger = logging.getLogger("compile_accel")


def _require() -> None:
    if not HAS_CACHE_ARTIFACTS:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.compiler.save_cache_artifacts (torch >= 2.7); "
            "rely on TORCHINDUCTOR_CACHE_DIR instead"
        )


def save_compile_cache(path: str | os.PathLike) -> int:
    """Write the artifacts of everything compiled in this process to `path`; returns the bytes
    written (0, and no file, when nothing was compiled). A reader never sees half a file."""
    _require()
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data, info = saved
    write_atomically(Path(path), data)
    logger.info("compile cache: saved %d bytes to %s (%s)", len(data), path, info)
    return len(data)


def load_compile_cache(path: str | os.PathLike) -> bool:
    """Fill this process's compile caches from `path` (call before the first step); False, with
    a log line, when there is no such file, and with a warning when torch cannot read it
    (corrupt, cut short, or from another torch): everything then compiles as usual."""
    _require()
    if not Path(path).is_file():
        logger.info("compile cache: no %s yet; compiling from scratch", path)
        return False
    start = time.perf_counter()
    try:
        info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
    except Exception as error:  # torch raises whatever its unpickling meets in a damaged file
        info, why = None, f"{type(error).__name__}: {str(error)[:120]}"
    else:
        why = "torch read nothing from it"
    if info is None:
        warn(f"compile cache: could not load {path} ({why}); compiling from scratch")
        return False
    logger.info("compile cache: loaded %s in %.1f s (%s)", path, time.perf_counter() - start, info)
    return True


class RunCompileCache:
    """One cache-artifacts file per run, in the user's cache directory (module docstring).

    A forward pre-hook on `model` (ahead of any other, so before auto's calibration compiles)
    keys the file on the first call's inputs and loads it when there is one; `save()` after the
    first step writes it when something was compiled that the file did not hold. `compiled`
    describes what is compiled and how (regions, config) for the key. `acceleration`: the one
    whose graphs are precompiled (compile_accel.precompile), with compile workers only (compiled
    in this process, a second compile of every graph would hold up the steps).
    """

    def __init__(self, model: nn.Module, compiled: str, acceleration: Acceleration | None = None) -> None:
        _require()
        self.model = model
        self.compiled = compiled
        self.acceleration = acceleration
        supported = precompile.SUPPORTED and compile_workers.SUPPORTED
        use = supported and acceleration is not None and acceleration.config.compile_workers > 0
        self.functions = acceleration.functions if use else []
        for function in self.functions:
            function.precompiled.noting = True
        self.path: Path | None = None  # known at the first forward
        self.loaded = False
        self.precompiled_loaded = 0  # graphs read at the first forward
        self.precompiling: precompile.PrecompileSave | None = None
        self._file_holds: int | None = None  # `_graphs_compiled()` when the file last held them all
        self._precompile_asked = False
        self._handle = model.register_forward_pre_hook(self._first_forward, with_kwargs=True, prepend=True)

    def _first_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return  # the model compiled whole: its own graphs, which this cache does not key
        self._handle.remove()
        inputs, device = run_inputs(args, kwargs)
        self.path = cache_dir() / "compiled" / f"{run_key(self.model, self.compiled, inputs, device)}.bin"
        self.loaded = load_compile_cache(self.path)
        if self.functions:
            functions = [f.precompiled for f in self.functions]
            self.precompiled_loaded = precompile.load_precompiled(functions, self._precompiled_path)
        self._file_holds = _graphs_compiled() if self.loaded else None

    @property
    def _precompiled_path(self) -> Path:
        return self.path.with_suffix(".precompiled")

    def save(self) -> int:
        """Write the file if graphs were compiled since it was loaded or last written (or it was
        not there); returns the bytes written. A failed write warns: the run goes on. The graphs
        compiled in this run are precompiled once (`_precompile_due`)."""
        if self.path is None:
            return 0
        if self._precompile_due():
            self._precompile_asked = True
            self.precompiling = precompile.save_precompiled(
                [
                    (f.precompiled, f.precompile_for, budget)
                    for f in self.functions
                    if (budget := f.precompile_budget()) is not False
                ],
                self._precompiled_path,
            )
        compiled = _graphs_compiled()
        if compiled == self._file_holds:
            return 0
        try:
            saved = save_compile_cache(self.path)
        except OSError as error:
            warn(f"compile cache: could not write {self.path}: {error}")
            return 0
        self._file_holds = compiled
        return saved

    def _precompile_due(self) -> bool:
        """Once per run, at the first save with the worker pool up (started at apply, stopped
        once the first step is done and no graph is out: a new pool would take GPU memory
        from the training) and the budget chosen (auto has calibrated)."""
        if not self.functions or self._precompile_asked:
            return False
        auto = self.acceleration.auto_budget
        if auto is not None and auto.result is None:
            return False
        if not compile_workers.running():
            self._precompile_asked = True
            logger.info("precompile: the compile workers had stopped; nothing precompiled in this run")
            return False
        return True

    def remove(self) -> None:
        """Load nothing (if the first forward has not come yet)."""
        self._handle.remove()


def _graphs_compiled() -> int:
    """Graphs compiled in this process, and those handed to the compile workers that run here now."""
    return torch._dynamo.utils.counters["inductor"]["fxgraph_cache_miss"] + compile_workers.graphs_switched()
