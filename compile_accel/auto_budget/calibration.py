"""AutoBudget: the calibration itself (see the package docstring), a forward pre-hook on the model
that runs once, from the first training call, and with compile workers goes on at later steps."""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .. import compile_workers
from ..autograd_graph import accumulating_leaves, differentiable_outputs
from ..cache_files import run_inputs, run_key
from ..memory import GIB
from ..saved_bytes import SavedBytesEstimate
from ..stats import Stats, warn
from .cache import CacheEntry, PredictedPeak, cache_path, cached_entry, write_entry
from .measure import Measure, Predict, default_limit_bytes, measure, run_once
from .report import level_text, setting, table_lines
from .search import CANDIDATES, Measurement, OffloadLadder, Waiting, choose, next_rung, predict_largest_fitting

logger = logging.getLogger("compile_accel")


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
    # Per rung measured to the end, its fastest fitting run (None: none fits there).
    fastest: dict[int, Measurement | None] = field(default_factory=dict)
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
        measure: Measure = measure,
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
            return f"the graphs of {setting(search.in_workers[1], search.in_workers[0], search.ladder)}"
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

        try:
            with torch.random.fork_rng(devices=[search.device] if search.device.type == "cuda" else []):
                waiting = self._climb(search, counts)
            if waiting is not None:
                search.waited_seconds += time.perf_counter() - resumed
                if search.in_workers_stats is not None:
                    compile_workers.hold_switches(search.in_workers_stats, True)
                logger.info("auto: %s", waiting.what)
                return None
            measurements = [m for rung in sorted(search.tables) for m in search.tables[rung]]
            best, fits = choose(measurements, search.limit)
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
        entry = CacheEntry(
            budget=best.budget,
            fits=fits,
            limit_gib=round(search.limit / GIB, 3),
            table=tuple(measurements),
            offload=best.offload,
            predicted=tuple(
                PredictedPeak(b, level, peak)
                for level, peaks in search.predicted.items()
                for b, peak in sorted(peaks.items())  # (asked for in bisection's order)
            ),
        )
        write_entry(search.key, entry)
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
        cached = cached_entry(key, ladder)
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

    def _climb(self, search: _Search, counts: list[Stats]) -> Waiting | None:
        """Measure the rungs the climb asks for (search.next_rung), each to the end; what it
        waits for, where a rung's measurement does (the next call goes on from there)."""
        while (rung := next_rung(search.fastest, len(search.levels))) is not None:
            waiting = self._measure_rung(search, rung, counts)
            if waiting is not None:
                return waiting
            fitting = [m for m in search.tables[rung] if not m.out_of_memory and m.peak_bytes <= search.limit]
            search.fastest[rung] = min(fitting, key=lambda m: m.seconds, default=None)
        return None

    def _measure_rung(self, search: _Search, rung: int, counts: list[Stats]) -> Waiting | None:
        """At one rung of the ladder: the candidates' peaks predicted, then the largest predicted
        to fit and smaller ones measured until one fits (the lowest candidate when none is
        predicted to), then larger ones where that one peaked under its prediction (module
        docstring). Into `search`; where it waits for the compile workers, what for (called
        again, it goes on where it stopped)."""
        level = search.levels[rung]
        parameters = [*self.model.parameters()]
        if level not in search.predicted:
            self._go(search.ladder, level)
            predicted = self.predict(search.run, search.device, parameters, counts, search.limit)
            if isinstance(predicted, Waiting):
                return predicted
            search.predicted[level] = predicted
        predicted = search.predicted[level]
        fitting = [b for b, peak in predicted.items() if peak <= search.limit]
        order = [b for b in reversed(self.candidates) if fitting and b <= max(fitting)] or [self.candidates[0]]
        table = search.tables.setdefault(rung, [])
        while (budget := self._next_budget(search, level, order, table)) is not None:
            measured = self._measure_budget(search, level, budget, parameters, counts)
            if isinstance(measured, Waiting):
                return measured
            table.append(measured)
        return None

    def _next_budget(
        self, search: _Search, level: float | None, order: list[float], table: list[Measurement]
    ) -> float | None:
        """The next budget to measure at `level`: down `order` until one fits, then up
        (_step_up); None when done."""
        for budget in order:
            measured = next((m for m in table if m.budget == budget), None)
            if measured is None:
                return budget
            if not measured.out_of_memory and measured.peak_bytes <= search.limit:
                break
        return self._step_up(search, level, table)

    def _step_up(self, search: _Search, level: float | None, table: list[Measurement]) -> float | None:
        """The candidate above the largest measured to fit, where that one is the fastest fitting
        so far and measured below its predicted peak, and the next one's prediction, less the same
        overshoot, fits: the predictions come from uncompiled code (sd-scripts' SDXL as a 4090:
        0.7 predicted 21.00 GiB, measured 19.70; 0.8 measured 21.32 and ran 4.7% faster). None
        where there is nothing to try, or it was measured; always with CUDA graphs, whose pools
        the next candidate's measurement frees (the choice may come back to this one)."""
        fitting = [m for m in table if not m.out_of_memory and m.peak_bytes <= search.limit]
        if not fitting or self._cuda_graphs:
            return None
        top = max(fitting, key=lambda m: m.budget)
        if top is not min(fitting, key=lambda m: m.seconds):  # going up stopped paying
            return None
        above = next((b for b in self.candidates if b > top.budget), None)
        if above is None or any(m.budget == above for m in table):
            return None
        predicted = search.predicted[level]
        overshoot = predicted.get(top.budget, 0) - top.peak_bytes
        if overshoot <= 0 or above not in predicted or predicted[above] - overshoot > search.limit:
            return None
        return above

    def _measure_budget(
        self, search: _Search, level: float | None, budget: float, parameters: list[torch.Tensor], counts: list[Stats]
    ) -> Measurement | Waiting:
        """Compile `budget` at `level` and measure it; what it waits for where its graphs went to
        the compile workers (measured when called again, once they are back)."""
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
                    return Waiting(
                        f"{setting(budget, level, search.ladder)} "
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
    ) -> dict[float, int] | Waiting:
        """Candidates' peaks from one step traced at the lowest (compile_accel.saved_bytes): that
        one, then by bisection (`predict_largest_fitting`). Waiting where compile workers are
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
                seconds, peak = run_once(run, device, parameters)
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
                return Waiting(
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

    def _settle(self, entry: CacheEntry, ladder: OffloadLadder | None, limit: int, cached: bool) -> dict[str, Any]:
        """Put the model at the entry's rung and budget; log the choice (and the table)."""
        self._go(ladder, entry.offload)
        self.set_budget(entry.budget, self.stats)
        self.result = {**entry.to_json(), "offload_name": None if ladder is None else ladder.name, "cached": cached}
        chosen = setting(entry.budget, entry.offload, ladder)
        if cached:
            logger.info("auto: %s (cached in %s)", chosen, cache_path())
        else:
            logger.info("auto over %.2f GiB:\n%s", limit / GIB, "\n".join(table_lines(entry, ladder, limit, chosen)))
        if not entry.fits:
            peak = entry.chosen().peak_bytes
            offload = "" if ladder is None else f" even at {ladder.name} {level_text(ladder.levels[-1])}"
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
