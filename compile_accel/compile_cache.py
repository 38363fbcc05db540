"""Carry compiled kernels between runs and machines: PyTorch's portable cache artifacts.

Inductor already keeps its compiled graphs in TORCHINDUCTOR_CACHE_DIR, so a second run on the
same machine reaches its first step quickly. The artifacts saved here (inductor, AOTAutograd
and autotuning entries, `torch.compiler.save_cache_artifacts`) are one file that can be copied
to another machine or a fresh container, where `load_compile_cache` fills the caches before
the first compile. The artifacts are only used for graphs compiled again with the same torch,
the same inputs and the same settings; anything else compiles as usual.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .dynamo_settings import HAS_CACHE_ARTIFACTS
from .stats import warn

logger = logging.getLogger("compile_accel")


def _require() -> None:
    if not HAS_CACHE_ARTIFACTS:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.compiler.save_cache_artifacts (torch >= 2.7); "
            "rely on TORCHINDUCTOR_CACHE_DIR instead"
        )


def save_compile_cache(path: str | os.PathLike) -> int:
    """Write the artifacts of everything compiled in this process to `path`; returns the bytes
    written (0, and no file, when nothing was compiled)."""
    _require()
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data, info = saved
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)
    logger.info("compile cache: saved %d bytes to %s (%s)", len(data), path, info)
    return len(data)


def load_compile_cache(path: str | os.PathLike) -> bool:
    """Fill this process's compile caches from `path` (call before the first step); False, with
    a log line, when there is no such file, and with a warning when torch cannot read it."""
    _require()
    if not Path(path).is_file():
        logger.info("compile cache: no %s yet; compiling from scratch", path)
        return False
    info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
    if info is None:
        warn(f"compile cache: torch could not read {path} (corrupt or from another torch); compiling from scratch")
        return False
    logger.info("compile cache: loaded %s (%s)", path, info)
    return True
