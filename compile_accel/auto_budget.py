"""activation_memory_budget="auto": the fastest budget whose measured peak memory fits a limit.

On the model's first training forward, each candidate budget is compiled and run on that
same batch: a forward and a backward of a stand-in loss (the mean square of the outputs),
once to compile and once timed, with its peak allocated memory read. A candidate that runs
out of memory does not fit, and the larger ones (which save more) are not tried. The fastest
candidate that fits the limit is kept; if none fits, the one with the lowest peak, with a
warning. The table and the choice are logged, returned in `stats()["auto_budget"]`, and
cached in a JSON file keyed by model (class, parameter counts, config), what is compiled and
how, input shapes, device, torch version and limit, so the next run of the same training
skips calibration.

What it costs, once: a compile per candidate (cold, about what one budget's first step takes;
seconds with a warm inductor cache) and two forward+backward passes per candidate. Gradients,
RNG state and everything else the calibration touches are put back before the real step.
On a CPU, "peak" is the bytes autograd saves for backward (there is no allocator peak).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .memory import SavedActivationMeter
from .stats import Stats, warn

logger = logging.getLogger("compile_accel")

CANDIDATES = (0.0, 0.1, 0.3, 0.5, 0.7, 1.0)
GIB = 2**30


@dataclass(frozen=True)
class Measurement:
    budget: float
    seconds: float
    peak_bytes: int
    out_of_memory: bool = False  # the run raised torch.OutOfMemoryError (seconds and peak: 0)


def choose(measurements: Iterable[Measurement], limit_bytes: int) -> tuple[Measurement, bool]:
    """The fastest measurement within the limit (and True), else the lowest peak (and False).
    Runs that went out of memory never count; RuntimeError when every run did."""
    measurements = [m for m in measurements if not m.out_of_memory]
    if not measurements:
        raise RuntimeError("activation_memory_budget='auto': every candidate budget ran out of memory on this batch")
    fitting = [m for m in measurements if m.peak_bytes <= limit_bytes]
    if fitting:
        return min(fitting, key=lambda m: (m.seconds, m.peak_bytes)), True
    return min(measurements, key=lambda m: (m.peak_bytes, m.seconds)), False


def default_limit_bytes(device: torch.device) -> int:
    """What this process may use: the GPU's free memory plus what torch already reserved,
    less a margin (1 GiB or 5% of the card, the larger) for fragmentation and the optimizer."""
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - max(GIB, total // 20)


def cache_path() -> Path:
    root = os.environ.get("COMPILE_ACCEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "compile_accel"
    )
    return Path(root) / "auto_budget.json"


def _cache_key(model: nn.Module, compiled: str, inputs: list[torch.Tensor], device: torch.device, limit: int) -> str:
    parts = [
        type(model).__qualname__,
        sum(p.numel() for p in model.parameters()),
        sum(p.numel() for p in model.parameters() if p.requires_grad),
        repr(getattr(model, "config", None)),  # e.g. a diffusers model's layers, heads, ...
        compiled,
        [(tuple(t.shape), str(t.dtype)) for t in inputs],
        torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        torch.__version__,
        limit,
        CANDIDATES,
        torch.is_autocast_enabled(device.type),
    ]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _read_cache() -> dict[str, Any]:
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        cache = error
    if not isinstance(cache, dict):
        warn(f"the auto budget cache {path} is not a JSON object ({str(cache)[:80]}); it will be rewritten")
        return {}
    return cache


def _valid_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get("budget") in CANDIDATES and isinstance(entry.get("fits"), bool)


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache = _read_cache()
        cache[key] = entry
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(cache, indent=1))
        os.replace(partial, path)  # another run reading it never sees half a file
    except OSError as error:
        warn(f"could not write the auto budget cache {path}: {error}")


def _measure(run: Callable[[], None], device: torch.device, parameters: list[torch.Tensor]) -> tuple[float, int]:
    """Seconds and peak bytes of one `run` after a first (compiling) one."""
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start, torch.cuda.max_memory_allocated(device)
    with SavedActivationMeter(parameters) as meter:
        start = time.perf_counter()
        run()
    return time.perf_counter() - start, meter.bytes


def _accumulating_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose .grad a backward from `loss` would accumulate into."""
    seen, stack, leaves = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


Measure = Callable[[Callable[[], None], torch.device, list[torch.Tensor]], tuple[float, int]]


class AutoBudget:
    """Forward pre-hook on the model root that calibrates once, on the first training call.

    `set_budget(budget, stats)` switches every compiled region of the Acceleration to a
    budget, counting into `stats`; `measure` and `candidates` (the budgets timed, in order) are
    replaceable for tests.
    """

    def __init__(
        self,
        model: nn.Module,
        set_budget: Callable[[float, Stats], None],
        stats: Stats,
        limit_gib: float | None,
        compiled: str = "",
        measure: Measure = _measure,
    ) -> None:
        self.model = model
        self.compiled = compiled  # what is compiled and how (regions, config): part of the cache key
        self.set_budget = set_budget
        self.stats = stats
        self.limit_gib = limit_gib
        self.measure = measure
        self.candidates = CANDIDATES
        self.result: dict[str, Any] | None = None
        self._running = False
        self._warned_eval = False
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._running or not torch.is_grad_enabled():
            return None
        if not module.training:
            if not self._warned_eval:
                self._warned_eval = True
                warn(
                    f"{type(module).__name__} runs with gradients in eval mode: activation_memory_budget='auto' "
                    "calibrates on the first forward in training mode (model.train()), and until then the blocks "
                    "run at PyTorch's default budget without checkpointing"
                )
            return None
        self.handle.remove()
        self._running = True
        try:
            self.calibrate(args, kwargs)
        finally:
            self._running = False
        return None

    def calibrate(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = next((t.device for t in inputs if t.is_floating_point()), torch.device("cpu"))
        if self.limit_gib is not None:
            limit = int(self.limit_gib * GIB)
        elif device.type == "cuda":
            limit = default_limit_bytes(device)
        else:
            raise ValueError("activation_memory_budget='auto' on a CPU needs CompileConfig.vram_limit_gib")
        key = _cache_key(self.model, self.compiled, inputs, device, limit)
        cached = _read_cache().get(key)
        if cached is not None and not _valid_entry(cached):
            warn(f"ignoring a malformed entry of the auto budget cache {cache_path()}: {str(cached)[:80]}")
        elif cached is not None:
            self.set_budget(cached["budget"], self.stats)
            self.result = {**cached, "cached": True}
            logger.info("auto activation memory budget %.2f (cached in %s)", cached["budget"], cache_path())
            if not cached["fits"]:
                self._warn_nothing_fits(limit, cached["budget"], cached.get("table", []))
            return self.result

        measurements, per_budget_stats = [], {}

        def run() -> None:
            out = self.model(*args, **kwargs)
            outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            loss = sum(t.float().square().mean() for t in outputs)
            # Every tensor backward accumulates into, found from the graph: kohya-style LoRA
            # weights are not parameters of the model.
            leaves = _accumulating_leaves(loss)
            saved = [None if t.grad is None else t.grad.clone() for t in leaves]
            try:
                loss.backward()
            finally:  # also when backward runs out of memory half way
                for t, grad in zip(leaves, saved):
                    t.grad = grad

        start = time.perf_counter()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for budget in self.candidates:
                per_budget_stats[budget] = Stats(regions=self.stats.regions)
                self.set_budget(budget, per_budget_stats[budget])
                try:
                    seconds, peak = self.measure(run, device, [*self.model.parameters()])
                except torch.OutOfMemoryError:
                    measurements.append(Measurement(budget, 0.0, 0, out_of_memory=True))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    break  # larger budgets save more
                measurements.append(Measurement(budget, seconds, peak))
        try:
            best, fits = choose(measurements, limit)
        except RuntimeError:
            self.set_budget(self.candidates[0], self.stats)
            raise
        self.set_budget(best.budget, self.stats)
        self.stats.absorb(per_budget_stats[best.budget])
        entry = {
            "budget": best.budget,
            "fits": fits,
            "limit_gib": round(limit / GIB, 3),
            "table": [asdict(m) for m in measurements],
        }
        _write_cache(key, entry)
        self.result = {**entry, "cached": False, "calibration_seconds": round(time.perf_counter() - start, 2)}
        table = "\n".join(
            f"  budget {m.budget:.1f}: out of memory"
            if m.out_of_memory
            else f"  budget {m.budget:.1f}: {m.seconds * 1e3:8.1f} ms, peak {m.peak_bytes / GIB:6.2f} GiB"
            f"{'  <- chosen' if m is best else ''}{'' if m.peak_bytes <= limit else '  (over the limit)'}"
            for m in measurements
        )
        logger.info("auto activation memory budget over %.2f GiB:\n%s", limit / GIB, table)
        if not fits:
            self._warn_nothing_fits(limit, best.budget, entry["table"])
        return self.result

    @staticmethod
    def _warn_nothing_fits(limit: int, budget: float, table: list[dict[str, Any]]) -> None:
        peak = next((m["peak_bytes"] for m in table if m["budget"] == budget), 0)
        warn(
            f"no activation memory budget fits {limit / GIB:.2f} GiB on this batch; using {budget} "
            f"(lowest peak, {peak / GIB:.2f} GiB). Lower the batch size or resolution, or offload blocks"
        )
