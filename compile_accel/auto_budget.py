"""activation_memory_budget="auto": the fastest budget whose measured peak memory fits a limit.

On the model's first training forward, calibration runs on that same batch (with compile
workers, it goes on at a later step: below), a forward and a backward of a stand-in loss (the
mean square of the outputs) at a time:

1. One step with the blocks traced at the lowest candidate budget, without inductor
   (compile_accel.saved_bytes): its peak, plus what a candidate's partition saves beyond what
   the step kept, predicts that candidate's peak (with compile workers the step runs the blocks
   uncompiled under checkpoints, which keep nothing of theirs, while the workers trace and
   partition them). Tracing is a fraction of a compile. A larger
   budget saves more, so the largest candidate predicted to fit is found by bisection: two or
   three partitions per graph of five (each a second or more for a full-size block; 16 graphs
   on SDXL's U-Net).
2. The largest budget predicted to fit is compiled and run, once to compile and once timed, with
   its peak read. If it peaks over the limit or runs out of memory, the next smaller one, and
   so on; the lowest candidate is run when nothing is predicted to fit (the predicted
   peaks come from uncompiled code, which may need more than the compiled).

The largest budget that fits is taken as the fastest: it saves more and recomputes less. In
the bench's medians so far (benchmarks/results/h100_24gib_auto/, h100_compile_profile/) the step
time fell as the budget rose, or stayed within 1% (SD3: budget 1.0 0.1900 s, 0.5 0.1888 s), while
one-step calibration timings can be 10% apart at the same speed. So a calibration compiles one
budget when the prediction is right, where timing every candidate compiled up to six. The chosen
budget's graphs are the ones training then runs. With compile workers
(CompileConfig.compile_workers), the first step waits for the traced step alone, which runs the
graphs uncompiled under a checkpoint while the workers trace and partition them
(compile_accel.saved_bytes). The training steps go on running them so (saving no more than the
lowest budget) until the partitions are back; the first step after predicts, and hands the
candidate's graphs to the workers, compiled from the traced step's own graphs as dynamo traced
them: the step is not traced again (RegionBackend.adopt). The steps run the candidate
uncompiled, under a checkpoint, until its graphs are back; it is measured at the first step
after. (Waiting in the first step for the partitions of sd-scripts' SDXL U-Net's largest graph
took 28-31 s of its 44-50 s on an H200's host.)
If none fits, the lowest peak is taken, with a warning. The table (measured and predicted) and
the choice are logged, returned in `stats()["auto_budget"]`, and cached in a JSON file keyed by
model (class, parameter counts per dtype, config), what is compiled and how, input shapes, device, torch
version and limit, so the next run of the same training skips calibration.

Gradients, RNG state and everything else the calibration touches are put back before the real
step. On a CPU, "peak" is the bytes autograd saves for backward (there is no allocator peak).

Joint search with offloading: when an offload ladder is known (sd-scripts' `--blocks_to_swap`
through the sd-scripts integration, or a BlockOffloadConductor attached to the blocks: its
`offload_fraction`) and no budget fits with the blocks as they are, the ladder is climbed: the
fewest blocks offloaded at which some budget fits is found by bisection (memory only falls as
more is offloaded), then one more rung is tried as long as it is faster (a rung more may let a
larger budget fit, which recomputes less). The ladder starts at what the user set up and only
goes up: auto never keeps more blocks on the GPU than asked. Each rung is predicted as above
(one traced step) before a budget is compiled there; a budget's graphs serve every rung.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import reprlib
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from . import compile_workers
from .autograd_graph import accumulating_leaves, differentiable_outputs
from .cache_files import cache_dir, run_inputs, run_key, write_atomically
from .memory import GIB, SavedActivationMeter, dedicated_bytes
from .saved_bytes import SavedBytesEstimate
from .stats import Stats, warn

logger = logging.getLogger("compile_accel")

CANDIDATES = (0.0, 0.1, 0.3, 0.5, 0.7, 1.0)


@dataclass(frozen=True)
class Measurement:
    budget: float
    seconds: float
    peak_bytes: int
    out_of_memory: bool = False  # the run raised torch.OutOfMemoryError (seconds and peak: 0)
    offload: float | None = None  # the offload ladder's rung it ran at; None without a ladder


@dataclass(frozen=True)
class OffloadLadder:
    """A way to keep fewer blocks' weights on the GPU, which auto turns when no budget fits.

    name: what the log, the cache and stats call it ("blocks_to_swap", "offload_fraction").
    levels: the rungs, ascending; levels[0] is the setting in place when calibration starts.
    set_level: puts the model at a rung; called between steps, never inside a forward. May
        raise torch.OutOfMemoryError (the rung then counts as out of memory).
    """

    name: str
    levels: tuple[float, ...]
    set_level: Callable[[float], None]

    def __post_init__(self) -> None:
        if not self.levels or list(self.levels) != sorted(set(self.levels)):
            raise ValueError(f"OffloadLadder {self.name!r}: levels must be ascending and distinct, got {self.levels}")


def spaced_levels(start: float, stop: float, rungs: int = 6, whole: bool = False) -> tuple[float, ...]:
    """`start`, then `rungs` evenly spaced steps up to `stop` (whole numbers if `whole`)."""
    steps = (start + (stop - start) * k / rungs for k in range(rungs + 1))
    return tuple(sorted({round(x) if whole else round(x, 3) for x in steps}))


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
    """What this process may use: the GPU's free memory plus what torch already reserved (at
    most the per-process memory fraction's share of the card, as `--vram-cap-gib` sets it, and
    never more than the card's dedicated memory: memory.dedicated_bytes), less a margin (1 GiB or
    5% of that, the larger) for fragmentation and the optimizer."""
    free, total = torch.cuda.mem_get_info(device)
    # (A process that spilled already has reserved more than the card has.)
    usable = min(free + torch.cuda.memory_reserved(device), dedicated_bytes(device))
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        usable = min(usable, int(fraction(device) * total))
    return usable - max(GIB, usable // 20)


def cache_path() -> Path:
    return cache_dir() / "auto_budget.json"


def _read_cache() -> dict[str, Any]:
    path = cache_path()
    try:
        cache = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except Exception as error:  # whatever a damaged file makes reading raise (RecursionError: nesting too deep)
        why = f"{type(error).__name__}: {str(error)[:80]}"
        warn(f"the auto budget cache {path} could not be read ({why}); it will be rewritten")
        return {}
    if not isinstance(cache, dict):
        warn(f"the auto budget cache {path} is not a JSON object ({reprlib.repr(cache)}); it will be rewritten")
        return {}
    return cache


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_candidate(value: Any) -> bool:
    return _is_number(value) and value in CANDIDATES  # True == 1.0: bools are refused first


def _valid_row(row: Any, levels: tuple[float, ...] | None) -> bool:
    return (
        isinstance(row, dict)
        and set(row) == {f.name for f in fields(Measurement)}
        and _is_candidate(row["budget"])
        and _is_number(row["seconds"])
        and row["seconds"] >= 0
        and isinstance(row["peak_bytes"], int)
        and not isinstance(row["peak_bytes"], bool)
        and row["peak_bytes"] >= 0
        and isinstance(row["out_of_memory"], bool)
        and (row["offload"] is None if levels is None else row["offload"] in levels)
    )


def _valid_prediction(row: Any, levels: tuple[float, ...] | None) -> bool:
    return (
        isinstance(row, dict)
        and set(row) == {"budget", "offload", "peak_bytes"}
        and _is_candidate(row["budget"])
        and isinstance(row["peak_bytes"], int)
        and not isinstance(row["peak_bytes"], bool)
        and (row["offload"] is None if levels is None else row["offload"] in levels)
    )


def _valid_entry(entry: Any, ladder: OffloadLadder | None) -> bool:
    """Every field of a cache entry has the type and range calibration writes: a hand-edited or
    truncated entry is recalibrated, never half used."""
    levels = None if ladder is None else ladder.levels
    return (
        isinstance(entry, dict)
        and set(entry) == {"budget", "fits", "limit_gib", "table", "offload", "predicted"}
        and _is_candidate(entry["budget"])
        and isinstance(entry["fits"], bool)
        and _is_number(entry["limit_gib"])
        and isinstance(entry["table"], list)
        and bool(entry["table"])
        and all(_valid_row(row, levels) for row in entry["table"])
        and isinstance(entry["predicted"], list)
        and all(_valid_prediction(row, levels) for row in entry["predicted"])
        and (entry["offload"] is None if levels is None else entry["offload"] in levels)
        and any(
            row["budget"] == entry["budget"] and row["offload"] == entry["offload"] and not row["out_of_memory"]
            for row in entry["table"]
        )
    )


def _cached_entry(key: str, ladder: OffloadLadder | None) -> dict[str, Any] | None:
    """The cache's entry for `key`, or None; a malformed one (`_valid_entry`) warns and is
    calibrated again."""
    entry = _read_cache().get(key)
    if entry is None:
        return None
    try:
        valid = _valid_entry(entry, ladder)
    except Exception:  # a value no check expects, e.g. an int too large for a float: malformed too
        valid = False
    if not valid:
        warn(f"ignoring a malformed entry of the auto budget cache {cache_path()}: {reprlib.repr(entry)}")
        return None
    return entry


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    path = cache_path()
    cache = _read_cache()
    cache[key] = entry
    try:
        write_atomically(path, json.dumps(cache, indent=1).encode())
    except (OSError, RecursionError) as error:  # (RecursionError: another entry, as read, nested too deep to write)
        warn(f"could not write the auto budget cache {path}: {error}")


def _run_once(
    run: Callable[[], None], device: torch.device, parameters: list[torch.Tensor], reserved: bool = False
) -> tuple[float, int]:
    """Seconds and peak bytes of one `run`: allocated, or (`reserved`) reserved by the allocator
    with its free cache emptied first (CUDA graphs keep their memory in pools of their own,
    reserved while they live, which the allocated peak of a replay does not show)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if reserved:
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device) if reserved else torch.cuda.max_memory_allocated(device)
        return time.perf_counter() - start, peak
    with SavedActivationMeter(parameters) as meter:
        start = time.perf_counter()
        run()
    return time.perf_counter() - start, meter.bytes


def _measure(
    run: Callable[[], None], device: torch.device, parameters: list[torch.Tensor], reserved: bool = False
) -> tuple[float, int]:
    """Seconds and peak bytes (see _run_once) of one `run`, once the candidate's graphs compiled
    (the run before did) or came back from the compile workers and were switched to (one more
    run). With CUDA graphs the measured run is the one that records them (the one before ran
    them once as torch's warm-up), so their pools are in its reserved peak, and its seconds
    include the recording."""
    if compile_workers.pending():
        run()
    return _run_once(run, device, parameters, reserved)


# (run, device, parameters) -> seconds, peak bytes; with CUDA graphs also called with reserved=True.
Measure = Callable[..., tuple[float, int]]
# (run, device, parameters, counts, limit) -> predicted peak bytes of candidates, among them the
# largest predicted to fit `limit` and the next larger one ({}: no prediction; a larger budget
# is taken to need more, a smaller one less).
Predict = Callable[[Callable[[], None], torch.device, list[torch.Tensor], list[Stats], int], dict[float, int]]


class _InWorkers(Exception):
    """Calibration waits for the compile workers (a candidate's graphs, or the partitions of the
    traced step's): the search goes on at a later step. The message says what for, for the log."""


@dataclass
class _Search:
    """A calibration in progress: what it measures on, and what it found so far (kept while it
    waits for the compile workers: the traced step's partitions, or a candidate's graphs)."""

    run: Callable[[], None]  # the stand-in step on the calibration batch
    device: torch.device
    key: str
    limit: int
    ladder: OffloadLadder | None
    levels: tuple[float | None, ...]  # the ladder's rungs ((None,): no ladder)
    started: float  # time.perf_counter() at the first forward
    waited_seconds: float = 0.0  # of the training steps, inside calibration
    predicted: dict[float | None, dict[float, int]] = field(default_factory=dict)  # per rung, in order
    tables: dict[int, list[Measurement]] = field(default_factory=dict)  # per rung index
    complete: set[int] = field(default_factory=set)  # rungs measured to the end
    in_workers: tuple[float | None, float] | None = None  # (rung, budget) whose graphs the workers compile
    in_workers_stats: Stats | None = None  # what that budget compiled (its graphs count in it once back)
    traced_peak: int | None = None  # the traced step's peak, while the workers partition its graphs


class AutoBudget:
    """Forward pre-hook on the model root that calibrates once, from the first training call.

    `set_budget(budget, stats, estimate=None, adopt=False)` switches every compiled region of the
    Acceleration to a budget, counting into `stats` (with `estimate`: traced for it, without
    inductor; with `adopt`: compiled from the traced step's graphs in the compile workers, where
    they were packed for them, RegionBackend.adopt). `find_ladder(device)` returns the offload
    ladder to climb when nothing fits (None: there is none); it is asked at calibration, so an
    offloader set up after apply() counts. `measure`, `predict`, `candidates` (the budgets,
    ascending) and `compiling` (how many graphs counting into a Stats are still in the compile
    workers) are replaceable for tests. `cuda_graphs`: the regions replay CUDA graphs
    (CompileConfig.compile_mode), which record the blocks' weights where they are: no offload
    ladder, `measure` reads reserved peaks (called with reserved=True), and the CUDA graphs of a
    candidate measured before are freed before the next one is.

    With compile workers, the prediction goes on at the first training step after the workers'
    partitions of the traced step are back (until then the steps run the traced graphs
    uncompiled, under checkpoints), and a candidate whose graphs went to them is measured at the
    first training step after they are back, on the same batch; until then the training steps
    run at that budget, uncompiled, under a checkpoint, and none of its graphs switches to
    compiled before calibration ran it (compile_workers.hold_switches). So the first step waits
    for the traced step only, not for the partitions or the compile (`waiting_for` says what
    calibration waits for).

    A calibration that raises (Ctrl-C, an error in a candidate's step) puts the model back at
    the ladder's first rung and the lowest budget, warns, and runs again on the next training
    forward; what it compiled is counted in the stats either way.
    """

    def __init__(
        self,
        model: nn.Module,
        set_budget: Callable[[float, Stats], None],
        stats: Stats,
        limit_gib: float | None,
        compiled: str = "",
        find_ladder: Callable[[torch.device], OffloadLadder | None] = lambda device: None,
        measure: Measure = _measure,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.compiled = compiled  # what is compiled and how (regions, config): part of the cache key
        self.set_budget = set_budget
        self.stats = stats
        self.limit_gib = limit_gib
        # CUDA graphs record the blocks' weights where they are: never offload; read reserved peaks.
        self.find_ladder = (lambda device: None) if cuda_graphs else find_ladder
        self.measure = functools.partial(measure, reserved=True) if cuda_graphs else measure
        self._cuda_graphs = cuda_graphs
        self.predict: Predict = self._predict
        self.compiling: Callable[[Stats], int] = compile_workers.compiling
        self.candidates = CANDIDATES
        self._estimate: SavedBytesEstimate | None = None  # one trace per graph serves every rung
        self.result: dict[str, Any] | None = None
        self._search: _Search | None = None
        self._level = math.nan  # the ladder's rung the model is at (nan: not known)
        self._running = False
        self._warned_eval = False
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    @property
    def checking(self) -> float | None:
        """The budget whose graphs are in the compile workers, to be measured once they are back."""
        return None if self._search is None or self._search.in_workers is None else self._search.in_workers[1]

    @property
    def waiting_for(self) -> str | None:
        """What calibration waits for from the compile workers, in words (None: nothing); it goes
        on at the first training step after they are back."""
        search = self._search
        if search is None:
            return None
        if search.in_workers is not None:
            return f"the graphs of {_setting(search.in_workers[1], search.in_workers[0], search.ladder)}"
        if search.traced_peak is not None:
            return "the partitions of the traced step's graphs"
        return None

    def _workers_busy(self) -> bool:
        """Whether what calibration waits for is still in the compile workers."""
        search = self._search
        if search is None:
            return False
        if search.in_workers_stats is not None:
            return bool(self.compiling(search.in_workers_stats))
        return search.traced_peak is not None and self._estimate.partitions_out()

    @property
    def _in_workers_stats(self) -> Stats | None:
        """What the candidate now in the compile workers compiled (None: none is there)."""
        return None if self._search is None else self._search.in_workers_stats

    def counted(self) -> Stats:
        """The Acceleration's stats, with what a candidate in the compile workers compiled so far
        (counted apart until it is measured: its graphs switch to compiled in that run)."""
        pending = self._in_workers_stats
        if pending is None:
            return self.stats
        counted = copy.deepcopy(self.stats)
        counted.absorb(pending)
        return counted

    def remove(self) -> None:
        """Calibrate never (Acceleration.remove() calls this)."""
        self.handle.remove()
        pending = self._in_workers_stats
        self._search = None
        compile_workers.keep_running(self, False)
        if pending is not None:
            compile_workers.hold_switches(pending, False)
            self.stats.absorb(pending)

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._running or not torch.is_grad_enabled():
            return None
        if not module.training:
            if not self._warned_eval:
                self._warned_eval = True
                warn(
                    f"{type(module).__name__} runs with gradients in eval mode: activation_memory_budget='auto' "
                    "calibrates in training mode (model.train()); until it has, the blocks run at PyTorch's "
                    "default budget without checkpointing, or at the candidate being calibrated"
                )
            return None
        if self._workers_busy():
            return None
        self._running = True
        try:
            done = self.calibrate(args, kwargs) is not None
        finally:
            self._running = False
        if done:
            self.handle.remove()
        return None

    def calibrate(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        """Calibrate on this batch; the result, or None while it waits for the compile workers
        (`waiting_for`: a later call, once they are back, goes on with the first call's batch)."""
        if self._search is None:
            search = self._start(args, kwargs)
            if isinstance(search, dict):
                return search  # the cache answered
            self._search = search
        search = self._search
        resumed = time.perf_counter()
        counts: list[Stats] = []  # one per candidate run; every graph compiled is counted
        if search.in_workers_stats is not None:  # back from the workers: they switch in its measured run
            compile_workers.hold_switches(search.in_workers_stats, False)
            counts.append(search.in_workers_stats)

        def fastest(rung: int) -> Measurement | None:
            if rung not in search.complete:
                self._measure_rung(search, rung, counts)
                search.complete.add(rung)
            fitting = [m for m in search.tables[rung] if not m.out_of_memory and m.peak_bytes <= search.limit]
            return min(fitting, key=lambda m: m.seconds, default=None)

        try:
            with torch.random.fork_rng(devices=[search.device] if search.device.type == "cuda" else []):
                _climb(fastest, len(search.levels))
            measurements = [m for rung in sorted(search.tables) for m in search.tables[rung]]
            best, fits = choose(measurements, search.limit)
        except _InWorkers as waiting:
            search.waited_seconds += time.perf_counter() - resumed
            if search.in_workers_stats is not None:
                compile_workers.hold_switches(search.in_workers_stats, True)
            logger.info("auto: %s", waiting)
            return None
        except BaseException as error:
            self._search = None
            self._recover(search.ladder, error)
            raise
        finally:
            for run_counts in counts:
                self.stats.absorb(run_counts)
            # Between the partitions' return and the next step's hand-over nothing is out in the
            # pool: kept up, or it would stop and the hand-over start a new one (seconds).
            compile_workers.keep_running(self, self._search is not None and self._search.traced_peak is not None)
        self._search = None
        entry = {
            "budget": best.budget,
            "fits": fits,
            "limit_gib": round(search.limit / GIB, 3),
            "table": [asdict(m) for m in measurements],
            "offload": best.offload,
            "predicted": [
                {"budget": b, "offload": level, "peak_bytes": peak}
                for level, peaks in search.predicted.items()
                for b, peak in sorted(peaks.items())  # (asked for in bisection's order)
            ],
        }
        _write_cache(search.key, entry)
        result = self._settle(entry, search.ladder, search.limit, cached=False)
        result["calibration_seconds"] = round(time.perf_counter() - search.started, 2)
        result["waited_seconds"] = round(search.waited_seconds + time.perf_counter() - resumed, 2)
        return result

    def _start(self, args: tuple, kwargs: dict) -> _Search | dict[str, Any]:
        """A new search on this batch, or the cached result (the model set to it)."""
        inputs, device = run_inputs(args, kwargs)
        if self.limit_gib is not None:
            limit = int(self.limit_gib * GIB)
        elif device.type == "cuda":
            limit = default_limit_bytes(device)
        else:
            raise ValueError("activation_memory_budget='auto' on a CPU needs CompileConfig.vram_limit_gib")
        ladder = self.find_ladder(device)
        self._level = math.nan if ladder is None else ladder.levels[0]
        key = run_key(
            self.model,
            self.compiled,
            inputs,
            device,
            limit,
            CANDIDATES,
            None if ladder is None else (ladder.name, ladder.levels),
            "predicted",  # the search (entries of the exhaustive one that timed every budget lack "predicted")
        )
        cached = _cached_entry(key, ladder)
        if cached is not None:
            return self._settle(cached, ladder, limit, cached=True)

        def run() -> None:
            outputs = differentiable_outputs(self.model(*args, **kwargs))
            if not outputs:
                raise RuntimeError("the model's output holds no tensor that requires grad: there is no backward to time")
            loss = sum(t.float().square().mean() for t in outputs)
            # Every tensor backward accumulates into, found from the graph: kohya-style LoRA
            # weights are not parameters of the model.
            leaves = accumulating_leaves(loss)
            saved = [None if t.grad is None else t.grad.clone() for t in leaves]
            try:
                loss.backward()
            finally:  # also when backward runs out of memory half way
                for t, grad in zip(leaves, saved):
                    t.grad = grad

        levels: tuple[float | None, ...] = (None,) if ladder is None else ladder.levels
        return _Search(run, device, key, limit, ladder, levels, time.perf_counter())

    def _measure_rung(self, search: _Search, rung: int, counts: list[Stats]) -> None:
        """At one rung of the ladder: the candidates' peaks predicted, then the largest predicted
        to fit and smaller ones measured until one fits; the lowest candidate when none is
        predicted to (module docstring). Into `search`; a rung cut short by _InWorkers goes on
        where it stopped."""
        level = search.levels[rung]
        parameters = [*self.model.parameters()]
        if level not in search.predicted:
            self._go(search.ladder, level)
            search.predicted[level] = self.predict(search.run, search.device, parameters, counts, search.limit)
        predicted = search.predicted[level]
        fitting = [b for b, peak in predicted.items() if peak <= search.limit]
        order = [b for b in reversed(self.candidates) if fitting and b <= max(fitting)] or [self.candidates[0]]
        table = search.tables.setdefault(rung, [])
        for budget in order:
            measured = next((m for m in table if m.budget == budget), None) or self._measure_budget(
                search, level, budget, parameters, counts
            )
            if measured not in table:
                table.append(measured)
            if not measured.out_of_memory and measured.peak_bytes <= search.limit:
                break

    def _measure_budget(
        self, search: _Search, level: float | None, budget: float, parameters: list[torch.Tensor], counts: list[Stats]
    ) -> Measurement:
        """Compile `budget` at `level` and measure it; _InWorkers when its graphs went to the
        compile workers (measured when called again, once they are back)."""
        back = search.in_workers == (level, budget)  # its Stats is in `counts` already (calibrate)
        if not back:
            counts.append(Stats(regions=self.stats.regions))
        try:
            self._go(search.ladder, level)
            if not back:
                if self._cuda_graphs and any(search.tables.values()):
                    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

                    reset_cudagraph_trees()  # free the pools of the candidate measured before
                # The traced step's graphs, handed to the compile workers where they can go; not
                # with a ladder, whose next rung's prediction runs the traced graphs again.
                self.set_budget(budget, counts[-1], adopt=search.ladder is None)
                if not counts[-1].worker_graphs_started:
                    search.run()  # compiles the budget's graphs, or hands them to the compile workers
                if counts[-1].worker_graphs_started:
                    search.in_workers, search.in_workers_stats = (level, budget), counts.pop()
                    predicted = search.predicted[level].get(budget)  # none where the traced step ran out of memory
                    raise _InWorkers(
                        f"{_setting(budget, level, search.ladder)} "
                        f"({'' if predicted is None else f'predicted {predicted / GIB:.2f} GiB, '}"
                        f"limit {search.limit / GIB:.2f} GiB) is compiling in the workers; the steps run it "
                        "uncompiled until its graphs are back, then it is timed and its peak checked"
                    )
            search.in_workers = search.in_workers_stats = None
            seconds, peak = self.measure(search.run, search.device, parameters)
        except torch.OutOfMemoryError:
            search.in_workers = search.in_workers_stats = None
            self._out_of_memory(search.device)
            return Measurement(budget, 0.0, 0, out_of_memory=True, offload=level)
        return Measurement(budget, seconds, peak, offload=level)

    def _predict(
        self,
        run: Callable[[], None],
        device: torch.device,
        parameters: list[torch.Tensor],
        counts: list[Stats],
        limit: int,
    ) -> dict[float, int]:
        """Candidates' peaks from one step traced at the lowest (compile_accel.saved_bytes): that
        one, then by bisection (`predict_largest_fitting`). _InWorkers where compile workers are
        still partitioning the step's graphs when it ends: the training steps run them
        uncompiled under checkpoints meanwhile, and the call after they are back predicts from
        this step. Called by calibration, with its search."""
        search = self._search
        if self._estimate is None:
            self._estimate = SavedBytesEstimate(self.candidates, self.candidates[0])
        estimate = self._estimate
        predicted: dict[float, int] = {}
        if search.traced_peak is None:
            counts.append(Stats(regions=self.stats.regions))
            self.set_budget(self.candidates[0], counts[-1], estimate=estimate)
            estimate.new_step()
            try:
                seconds, peak = _run_once(run, device, parameters)
            except torch.OutOfMemoryError:  # in the step: no prediction
                self._out_of_memory(device)
                return predicted
            finally:
                estimate.end_step()
            logger.info("auto: traced step in %.1f s (peak %.2f GiB)", seconds, peak / GIB)
            if compile_workers.running():  # kept before the check: a partition back right after must not stop it
                compile_workers.keep_running(self, True)
            if estimate.partitions_out():
                search.traced_peak = peak
                # The steps until then count into the Acceleration's stats (`counts` is absorbed
                # into them at this call's end, before they run).
                self.set_budget(self.candidates[0], self.stats, estimate=estimate)
                raise _InWorkers(
                    "the compile workers partition the traced step's graphs; the steps run them uncompiled "
                    "under checkpoints until they are back, then a budget is picked"
                )
        else:
            peak, search.traced_peak = search.traced_peak, None
        logger.info("auto: predicting the budgets' peaks from the traced step's partitions ...")
        start = time.perf_counter()
        try:
            predict_largest_fitting(
                self.candidates, lambda budget: peak + estimate.added_bytes(budget), limit, predicted
            )
        except Exception as error:  # a graph neither a worker nor this process could partition
            warn(f"auto: no peaks predicted ({type(error).__name__}: {error}); measuring the lowest budget")
            predicted.clear()
        logger.info("auto: peaks predicted in %.1f s", time.perf_counter() - start)
        return predicted

    def _out_of_memory(self, device: torch.device) -> None:
        """After a step that ran out of memory: its blocks may be half moved (the next _go sets
        the rung again) and the allocator holds what the step left."""
        self._level = math.nan
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _go(self, ladder: OffloadLadder | None, level: float | None) -> None:
        """Put the model at `level` of the ladder, if it is not there (moving blocks takes time)."""
        if ladder is None or level == self._level:
            return
        self._level = math.nan  # until set_level returns
        ladder.set_level(level)
        self._level = level

    def _settle(self, entry: dict[str, Any], ladder: OffloadLadder | None, limit: int, cached: bool) -> dict[str, Any]:
        """Put the model at the entry's rung and budget; log the choice (and the table)."""
        self._go(ladder, entry["offload"])
        self.set_budget(entry["budget"], self.stats)
        self.result = {**entry, "offload_name": None if ladder is None else ladder.name, "cached": cached}
        chosen = _setting(entry["budget"], entry["offload"], ladder)
        if cached:
            logger.info("auto: %s (cached in %s)", chosen, cache_path())
        else:
            logger.info("auto over %.2f GiB:\n%s", limit / GIB, "\n".join(_table_lines(entry, ladder, limit, chosen)))
        if not entry["fits"]:
            peak = next(row["peak_bytes"] for row in entry["table"] if _setting(row["budget"], row["offload"], ladder) == chosen)
            offload = "" if ladder is None else f" even at {ladder.name} {_level(ladder.levels[-1])}"
            warn(
                f"no activation memory budget fits {limit / GIB:.2f} GiB on this batch{offload}; using {chosen} "
                f"(lowest peak, {peak / GIB:.2f} GiB). Lower the batch size or resolution, or offload blocks"
            )
        return self.result

    def _recover(self, ladder: OffloadLadder | None, error: BaseException) -> None:
        """After a calibration that raised: the first rung, the lowest budget, and a warning."""
        try:
            self._go(ladder, None if ladder is None else ladder.levels[0])
        finally:
            self.set_budget(self.candidates[0], self.stats)
            warn(
                f"activation_memory_budget='auto' calibration stopped ({type(error).__name__}: {str(error)[:120]}); "
                f"the blocks run at budget {self.candidates[0]} until it runs again, on the next training forward"
            )


def predict_largest_fitting(
    candidates: tuple[float, ...], predict: Callable[[float], int], limit: int, predicted: dict[float, int]
) -> None:
    """Into `predicted`, in the order asked: `predict` of the lowest candidate, then (if it fits
    `limit`) of those a bisection for the largest that fits asks for, a larger budget being taken
    to need more. Among them: the largest predicted to fit and the next larger one, if any."""
    predicted[candidates[0]] = predict(candidates[0])
    if predicted[candidates[0]] > limit:
        return
    low, high = 0, len(candidates) - 1  # candidates[low] fits; those above `high` do not
    while low < high:
        middle = (low + high + 1) // 2
        predicted[candidates[middle]] = predict(candidates[middle])
        if predicted[candidates[middle]] <= limit:
            low = middle
        else:
            high = middle - 1


def _climb(fastest: Callable[[int], Measurement | None], rungs: int) -> None:
    """Measure the rungs the search needs (see the module docstring): the first; if nothing fits
    there, the last, then bisection for the lowest that fits, then upward while faster."""
    if fastest(0) is not None or rungs == 1 or fastest(rungs - 1) is None:
        return
    low, high = 1, rungs - 1  # `high` fits
    while low < high:
        middle = (low + high) // 2
        if fastest(middle) is not None:
            high = middle
        else:
            low = middle + 1
    while high + 1 < rungs:
        here, above = fastest(high), fastest(high + 1)
        if above is None or above.seconds >= here.seconds:
            return
        high += 1


def _table_lines(entry: dict[str, Any], ladder: OffloadLadder | None, limit: int, chosen: str) -> list[str]:
    """The log's calibration table: per setting its predicted peak, and its time and peak where
    it was run (settings whose prediction ran out of memory: measured only)."""
    measured = {}
    for m in (Measurement(**row) for row in entry["table"]):
        where = _setting(m.budget, m.offload, ladder)
        if m.out_of_memory:
            measured[where] = "out of memory"
        else:
            mark = "  <- chosen" if where == chosen else ""
            over = "  (over the limit)" if m.peak_bytes > limit else ""
            measured[where] = f"{m.seconds * 1e3:8.1f} ms, peak {m.peak_bytes / GIB:6.2f} GiB{mark}{over}"
    lines = []
    for row in entry["predicted"]:
        where = _setting(row["budget"], row["offload"], ladder)
        run = measured.pop(where, "not run")
        lines.append(f"  {where}: predicted {row['peak_bytes'] / GIB:6.2f} GiB; {run}")
    return lines + [f"  {where}: {run}" for where, run in measured.items()]


def _level(level: float) -> str:
    return f"{level:g}"


def _setting(budget: float, level: float | None, ladder: OffloadLadder | None) -> str:
    """How the log names a candidate: "budget 0.1" or "blocks_to_swap 12, budget 0.1"."""
    return f"budget {budget:.1f}" if ladder is None else f"{ladder.name} {_level(level)}, budget {budget:.1f}"
