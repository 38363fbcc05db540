"""Where compile_accel keeps what it learns about a training run, under which key, and how it
writes there.

Two caches use this: auto's calibration (compile_accel.auto_budget) and the compiled-graph
artifacts (compile_accel.compile_cache). Both are keyed by the run: the model (class,
parameter counts per dtype, its `config`), what is compiled and how, the input shapes and dtypes,
autocast, the GPU and the torch version, plus what each cache adds. A run that differs in any
of these gets an entry of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree


def cache_dir() -> Path:
    """$COMPILE_ACCEL_CACHE_DIR, else compile_accel/ in the user's cache directory."""
    root = os.environ.get("COMPILE_ACCEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "compile_accel"
    )
    return Path(root)


def run_inputs(args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], torch.device]:
    """The tensors of a model call (nested too) and the device it runs on (its first floating
    tensor's; the CPU without one): what a run key is made of."""
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return inputs, next((t.device for t in inputs if t.is_floating_point()), torch.device("cpu"))


# Entries of a diffusers model's config that say nothing about the model: which arguments took
# their defaults (a list made from a set, in another order in every process, which would give a
# diffusers model a new key at every start: docs/compile-workers.md), and where it was loaded from.
_CONFIG_BOOKKEEPING = ("_use_default_values", "_name_or_path")


def _model_config(model: nn.Module) -> str:
    """The model's `config` (e.g. a diffusers model's layers, heads, ...) as the same text in every process."""
    config = getattr(model, "config", None)
    if isinstance(config, Mapping):
        config = {key: value for key, value in sorted(config.items()) if key not in _CONFIG_BOOKKEEPING}
    return repr(config)


def run_key(model: nn.Module, compiled: str, inputs: list[torch.Tensor], device: torch.device, *extra: Any) -> str:
    """A short hash of everything that decides what a run compiles (module docstring) and `extra`."""
    # Per dtype: parameter elements, and of them trainable (an fp8 and a bf16 copy of a model differ).
    elements: dict[str, list[int]] = {}
    for p in model.parameters():
        counts = elements.setdefault(str(p.dtype), [0, 0])
        counts[0] += p.numel()
        counts[1] += p.numel() if p.requires_grad else 0
    parts = [
        type(model).__qualname__,
        sorted(elements.items()),
        _model_config(model),
        compiled,
        [(tuple(t.shape), str(t.dtype)) for t in inputs],
        torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        torch.__version__,
        torch.is_autocast_enabled(device.type),
        *extra,
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def write_atomically(path: Path, data: bytes, tries: int = 5) -> None:
    """Write `path` so that a reader (another run) never sees half a file: a temporary file,
    then os.replace, retried because Windows refuses it while another process (a run reading
    the file, a virus scanner) has `path` open. Raises OSError; no temporary file is left."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(data)
        for attempt in range(tries):
            try:
                os.replace(partial, path)
                return
            except PermissionError:
                if attempt == tries - 1:
                    raise
                time.sleep(0.05 * 2**attempt)
    finally:
        partial.unlink(missing_ok=True)
