"""The search's arithmetic: the candidate budgets, a measured run, the offload ladder, the choice
among measurements, the bisections over budgets and over the ladder's rungs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

# 0.8: between 0.7 and 1.0 a model can fit where 1.0 does not and run faster than at 0.7
# (sd-scripts' SDXL b4 as a 4090: 0.8343 against 0.8758 s/step, 21.32 GiB of 24).
CANDIDATES = (0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 1.0)


@dataclass(frozen=True)
class Measurement:
    budget: float
    seconds: float
    peak_bytes: int
    out_of_memory: bool = False  # the run raised torch.OutOfMemoryError (seconds and peak: 0)
    offload: float | None = None  # the offload ladder's rung it ran at; None without a ladder


@dataclass(frozen=True)
class Waiting:
    """What a search step returns where it waits for the compile workers (a candidate's graphs,
    or the partitions of the traced step's): the search goes on at a later step. `what`: what
    for, in words, for the log."""

    what: str


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


def next_rung(fastest: Mapping[int, Measurement | None], rungs: int) -> int | None:
    """The next rung the climb needs measured, given each measured rung's fastest fitting run
    (None: nothing fits there); None when the climb is over. The climb: the first rung; if
    nothing fits there, the last, then bisection for the lowest that fits, then upward while
    faster. Measuring what it returns and asking again walks the climb; a search that pauses
    asks again later with what it has."""
    if 0 not in fastest:
        return 0
    if fastest[0] is not None or rungs == 1:
        return None
    if rungs - 1 not in fastest:
        return rungs - 1
    if fastest[rungs - 1] is None:
        return None
    low, high = 1, rungs - 1  # `high` fits
    while low < high:
        middle = (low + high) // 2
        if middle not in fastest:
            return middle
        if fastest[middle] is not None:
            high = middle
        else:
            low = middle + 1
    while high + 1 < rungs:  # (`high` is measured, and fits)
        if high + 1 not in fastest:
            return high + 1
        above = fastest[high + 1]
        if above is None or above.seconds >= fastest[high].seconds:
            return None
        high += 1
    return None
