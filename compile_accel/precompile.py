"""Warm starts without dynamo's trace: region graphs saved as torch's precompiled functions.

With inductor's and AOTAutograd's caches warm, a first step still traces each region graph with
dynamo and loads AOTAutograd's entries before the step runs: seconds of a warm first step, which
a precompiled graph skips (docs/compile-workers.md; benchmarks/results/h200_precompile/README.md).
torch's `aot_compile` (experimental, torch >= 2.10) turns one call of a function into an object
holding the compiled graph (its kernels bundled) and dynamo's guards, which saves to bytes and
loads in another process without a trace.

Each CompiledFunction (compile_accel.regions) has a `Precompiled`:
- `note(owner, args, kwargs, budget)`: a call that compiled a graph, kept as its layout (the
  instance the function was called on, each tensor's shape, strides, dtype, device and
  requires_grad, the other arguments as they are), with its grad mode and autocast.
  Calls of auto's traced step are noted at `TRACED` and `relabel`ed to the budget auto picks,
  whose graphs they become (compile_accel.backend.RegionBackend.adopt).
- `capture(compile_for, budget)`: each call noted at `budget` traced again by `aot_compile` on
  stand-in tensors of its layout. The graph goes to the compile workers
  (compile_accel.compile_workers.precompile_in_workers), which compile it as aot_compile does:
  its bundled form bypasses inductor's graph cache, so it is a second compile of the graph, kept
  off the steps (docs/compile-workers.md).
- `load(entries)`, then `find(owner, args, kwargs, budget)`: a loaded graph compiled at this
  budget for this class, grad mode and autocast whose guards pass for the call, or None (the
  call then compiles as usual).

`save_precompiled` traces after the first step and returns a PrecompileSave, whose thread writes
one file for all of a run's functions once the workers are done (with the loaded graphs that
ran; a function of which the file on disk holds more graphs keeps those); `load_precompiled`
reads it. compile_accel.compile_cache keeps that file beside the run's
cache artifacts, under the same key. A call that cannot be precompiled (a graph break, symbolic
shapes, an input whose guard torch cannot save) is left out with a log line, and compiles as
usual at the next start.

What a saved graph's guards do not check, and how it is covered: torch leaves out guards on
module globals and on object identities (functions, closures, hooks added to a module), and
`saved_guards` the identity of a method's code read as a constant (an attention processor's
`__call__`); the graph is only loaded when every source it was traced from is as it was (hashed
per inlined function, as torch's own precompile cache does) and the file was made by the same
torch and compile_accel code. A hook added to a block after the first start, a global it reads
changed, or a method replaced on a class whose code the graph inlined (an attention processor's
`__call__` patched to another kernel) is not seen: such a start needs the file removed (or
`--no_compile_cache`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from .backend import flagged
from .cache_files import write_atomically
from .offload.conductor import weights_on_device
from .stats import warn

logger = logging.getLogger("compile_accel")

try:
    from torch._dynamo.aot_compile import AOTCompiledFunction
except ImportError:  # torch < 2.10
    AOTCompiledFunction = None
SUPPORTED = AOTCompiledFunction is not None and hasattr(torch._dynamo.config, "enable_aot_compile")

_FORMAT = 1  # of the file; another is read as no file
TRACED = "traced"  # the budget a call of auto's traced step is noted at


@functools.cache
def _made_by() -> tuple[str, str]:
    """torch's version and a hash of compile_accel's own code (its graph rewrites and settings
    are in every graph, and no guard checks them): a file another made is not loaded."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.read_bytes())
    return torch.__version__, digest.hexdigest()


@dataclass(frozen=True)
class _TensorLayout:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def stand_in(self) -> torch.Tensor:
        tensor = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        return tensor.requires_grad_(self.requires_grad)


def _layout(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorLayout(tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    return value


def _stand_in(value: Any) -> Any:
    return value.stand_in() if isinstance(value, _TensorLayout) else value


def _call_context() -> tuple:
    """Grad mode and autocast (its dtype per device type, None where off): what a graph was
    compiled under; a loaded graph is only tried under the same (a quick test before its guards,
    which check them too)."""
    return (
        torch.is_grad_enabled(),
        *(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in ("cuda", "cpu")),
    )


def _entered(context: tuple) -> ExitStack:
    stack = ExitStack()
    grad, *autocast = context
    stack.enter_context(torch.set_grad_enabled(grad))
    for device_type, dtype in zip(("cuda", "cpu"), autocast):
        if dtype is not None:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        elif torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _kind(owner: Any) -> str:
    return "" if owner is None else f"{type(owner).__module__}.{type(owner).__qualname__}"


@dataclass
class _Call:
    owner: weakref.ref | None  # the instance the function was called on
    kind: str
    args: tuple  # layouts of the call's arguments after the instance
    kwargs: dict
    context: tuple
    budget: float | str | None  # (TRACED)


@dataclass
class _Loaded:
    entry: tuple  # (kind, context, budget, bytes) as read: written again if it ran
    function: Any  # AOTCompiledFunction
    run: Callable  # its compiled call, flagged as one (compile_accel.backend.compiled_call_running)
    used: bool = False


class Precompiled:
    """The precompiled graphs of one shared function (module docstring); `owner` is the
    instance a call passes first (a method shared by a class), None for a plain function.
    Calls are noted only while `noting` (a run cache that precompiles sets it): a note keeps
    the call's non-tensor arguments."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        self.noting = False
        self._noted: list[_Call] = []
        self.loaded: list[_Loaded] = []

    @property
    def used(self) -> int:
        """Loaded graphs that ran."""
        return sum(loaded.used for loaded in self.loaded)

    def note(self, owner: Any, args: tuple, kwargs: dict, budget: float | str | None) -> None:
        """A call that compiled a graph (each is another graph: dynamo compiled it because no
        graph's guards passed, which may be the owner's weights' shapes)."""
        if self.noting:
            owner_ref = None if owner is None else weakref.ref(owner)
            layouts = pytree.tree_map(_layout, args), pytree.tree_map(_layout, kwargs)
            self._noted.append(_Call(owner_ref, _kind(owner), *layouts, _call_context(), budget))

    def relabel(self, budget: float | str | None, to: float | None) -> None:
        """The calls noted at `budget` are noted at `to` from now on."""
        for call in self._noted:
            if call.budget == budget:
                call.budget = to

    def capture(self, compile_for: Callable[[float | None], Callable], budget: float | None) -> list[tuple]:
        """Each call noted at `budget` traced by `aot_compile` on stand-ins of its layout, its
        graph handed to the compile workers: (kind, context, budget, torch's compiled
        function), which serializes once the worker is done. A call torch cannot precompile is
        logged and left out."""
        captured = []
        for call in (c for c in self._noted if c.budget == budget):
            owner = None if call.owner is None else call.owner()
            if call.owner is not None and owner is None:
                continue  # the module is gone
            args = pytree.tree_map(_stand_in, call.args)
            kwargs = pytree.tree_map(_stand_in, call.kwargs)
            try:
                if owner is not None:  # (a streamed block's weights point at their host copy between calls)
                    weights_on_device(owner)
                with _entered(call.context), torch._dynamo.config.patch(enable_aot_compile=True):
                    compiled = compile_for(budget).aot_compile((args if owner is None else (owner, *args), kwargs))
            # torch's own refusals (a graph break, a guard it cannot save), or a streamed block that
            # could not be loaded: that graph is left out, the training goes on
            except Exception as error:
                _left_out(self.name, call.kind, error)
                continue
            captured.append((call.kind, call.context, budget, compiled))
        return captured

    def load(self, entries: Sequence[tuple]) -> int:
        """Load the entries whose traced sources are as they are now; returns how many. An
        entry torch cannot load (another Python or Triton) or whose sources changed since (a
        newer sd-scripts or LoRA network: it would run the old code) is left out with a log line."""
        for entry in entries:
            kind, _, _, data = entry
            try:
                function = AOTCompiledFunction.deserialize(data, getattr(self.fn, "__globals__", None))
                changed = _changed_source(function)
            except Exception as error:  # torch's compatibility checks, an entry it cannot read
                _left_out(self.name, kind, error, "not loaded")
                continue
            if changed:
                logger.info("precompile: %s (%s) not loaded: %s changed since it was saved", self.name, kind, changed)
                continue
            self.loaded.append(_Loaded(entry, function, flagged(function.fn)))
        return len(self.loaded)

    def find(self, owner: Any, args: tuple, kwargs: dict, budget: float | None) -> Callable | None:
        """The loaded graph for this call at `budget` (module docstring), or None. It is called
        as the function is: the instance first, if any."""
        if not self.loaded:
            return None
        kind, context = _kind(owner), _call_context()
        call = args if owner is None else (owner, *args)
        for loaded in self.loaded:
            if loaded.entry[:3] == (kind, context, budget) and _guards_pass(loaded.function, call, kwargs):
                loaded.used = True
                return loaded.run
        return None


def saved_guards(entries: Sequence[Any]) -> list[bool]:
    """Which of a traced graph's guards its precompiled function keeps (torch.compile's
    `guard_filter_fn`, given to the torch.compile that aot_compile traces with; it replaces
    aot_compile's own filter, whose rule it repeats: none on module globals, none of a kind torch
    cannot save). Also left out: a constant match that derives an identity check, which torch's
    filter (2.11 to 2.14) keeps, and whose save then fails. diffusers' Attention reads its
    processor's signature, and dynamo checks the identity of that `__call__`'s code so: with
    torch's filter every diffusers Lumina 2 block would be left out ("ID_MATCH guard cannot be
    serialized"). Other guards deriving a check torch cannot save (a tensor matched by identity)
    still fail the save: such a graph is left out."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [
        not (
            entry.is_global
            or entry.guard_type in unsaved
            or (entry.guard_type == "CONSTANT_MATCH" and "ID_MATCH" in entry.derived_guard_types)
        )
        for entry in entries
    ]


def _guards_pass(function: Any, call: tuple, kwargs: dict) -> bool:
    try:
        return bool(function.guard_check(*call, **kwargs))
    except Exception:  # arguments its saved signature does not take: not this graph
        return False


def _changed_source(function: Any) -> str | None:
    """The first source the function's graph was traced from that differs now, or None. (As
    torch's own precompile cache checks: the lines of each inlined function, hashed.)"""
    for source in function.source_info().inlined_sources:
        try:
            lines = module_lines(source.module)
        except (ImportError, OSError, TypeError):
            return f"{source.module} (not found)"
        now = "".join(lines[source.firstlineno - 1 : source.lastlineno - 1])
        if hashlib.sha256(now.encode()).hexdigest() != source.checksum:
            return f"{source.module}, lines {source.firstlineno}-{source.lastlineno}"
    return None


def module_lines(name: str) -> list[str]:
    """The source lines of module `name` as it is now."""
    return inspect.getsourcelines(importlib.import_module(name))[0]


def _left_out(name: str, kind: str, error: Exception, what: str = "left out") -> None:
    logger.info("precompile: %s (%s) %s: %s: %s", name, kind, what, type(error).__name__, str(error)[:200])


class PrecompileSave:
    """Graphs being precompiled for the next start: traced here, compiled in the compile workers,
    written to `path` by a thread of its own once all are back (with the graphs loaded from
    it). `written`: the graphs in the file (None until the thread is done; 0: none, or the write
    failed)."""

    def __init__(self, captured: dict[Precompiled, list[tuple]], path: Path) -> None:
        self.graphs = sum(map(len, captured.values()))
        self.written: int | None = None
        self._start = time.perf_counter()
        self._thread = threading.Thread(
            target=self._write, args=(captured, path), name="compile_accel-precompile", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        return self.written

    def _write(self, captured: dict[Precompiled, list[tuple]], path: Path) -> None:
        saved = {}
        for precompiled, graphs in captured.items():
            entries = [loaded.entry for loaded in precompiled.loaded if loaded.used]
            for kind, context, budget, compiled in graphs:
                try:
                    entries.append((kind, context, budget, type(compiled).serialize(compiled).serialized_data))
                except Exception as error:  # the worker's compile error
                    _left_out(precompiled.name, kind, error)
            if entries:
                saved[precompiled.name] = entries
        # The file may hold more graphs of a function than this run has: another run on this cache
        # directory wrote it since this one started, or this run's precompiles were cut short (a
        # training that ends right after save(): the exit closes the workers, failing each pending
        # one). Those functions keep the file's graphs: a file is never replaced by fewer.
        held = _graphs_held(path)
        kept = [name for name, entries in held.items() if len(entries) > len(saved.get(name, ()))]
        saved.update((name, held[name]) for name in kept)
        count = sum(map(len, saved.values()))
        if kept:
            logger.info("precompile: %s holds more graphs of %s than this run precompiled; kept", path, ", ".join(kept))
        if saved == held:
            logger.info("precompile: %s left as it is (%d graphs): this run adds none", path, count)
            self.written = count
            return
        try:
            write_atomically(path, pickle.dumps({"format": _FORMAT, "made_by": _made_by(), "functions": saved}))
        except OSError as error:
            warn(f"precompile: could not write {path}: {error}")
            self.written = 0
            return
        self.written = count
        logger.info(
            "precompile: %d graphs precompiled for the next start, %.1f s after the first step (%s)",
            count,
            time.perf_counter() - self._start,
            path,
        )


def _read(path: Path) -> tuple[tuple, dict[str, list[tuple]]]:
    """Who made the file at `path` (format, torch and compile_accel) and its entries per function
    name. Raises whatever reading a missing or damaged file raises."""
    saved = pickle.loads(path.read_bytes())
    return (saved["format"], saved["made_by"]), {name: list(entries) for name, entries in saved["functions"].items()}


def _graphs_held(path: Path) -> dict[str, list[tuple]]:
    """The entries per function name that the file at `path` holds and a start here would load:
    none without a file, from a damaged one, or from one another torch or compile_accel made."""
    try:
        header, saved = _read(path)
    except Exception:  # no file, or a damaged one: nothing to keep
        return {}
    return saved if header == (_FORMAT, _made_by()) else {}


def save_precompiled(
    functions: Sequence[tuple[Precompiled, Callable[[float | None], Callable], float | None]], path: Path
) -> PrecompileSave | None:
    """Trace each function's calls noted at its budget (compile_for(budget) gives the
    torch.compile to precompile with) and hand their graphs to the compile workers; the
    PrecompileSave writes `path` once they are back. None when no graph was precompiled (the
    file stays as it is)."""
    captured = {precompiled: precompiled.capture(compile_for, budget) for precompiled, compile_for, budget in functions}
    if not any(captured.values()):
        return None
    return PrecompileSave(captured, path)


def load_precompiled(functions: Sequence[Precompiled], path: Path) -> int:
    """Load the graphs `path` holds for `functions`; returns how many (0 without a file). A file
    torch cannot read warns, and everything compiles as usual."""
    if not path.is_file():
        return 0
    start = time.perf_counter()
    try:
        header, saved = _read(path)
    except Exception as error:  # a damaged file: whatever unpickling raises
        warn(f"precompile: could not load {path} ({type(error).__name__}: {str(error)[:120]}); compiling as usual")
        return 0
    if header != (_FORMAT, _made_by()):
        logger.info("precompile: %s was made by another torch or compile_accel; compiling as usual", path)
        return 0
    count = sum(precompiled.load(saved.get(precompiled.name, [])) for precompiled in functions)
    logger.info("precompile: loaded %d graphs from %s in %.1f s", count, path, time.perf_counter() - start)
    return count
