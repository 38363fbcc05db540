"""auto's calibration cache: one JSON file of entries keyed by run (cache_files.run_key), so that
the next run of the same training skips calibration. An entry is read back only when every field
has the type and range calibration writes (`CacheEntry.from_json`): a hand-edited or truncated
entry is calibrated again, never half used."""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..cache_files import cache_dir, write_atomically
from ..stats import warn
from .search import CANDIDATES, Measurement, OffloadLadder


@dataclass(frozen=True)
class PredictedPeak:
    budget: float
    offload: float | None  # the ladder's rung; None without a ladder
    peak_bytes: int


@dataclass(frozen=True)
class CacheEntry:
    """A calibration's outcome: the chosen budget (and rung), whether it fits, the limit, what was
    measured and what was predicted."""

    budget: float
    fits: bool
    limit_gib: float
    table: tuple[Measurement, ...]
    offload: float | None
    predicted: tuple[PredictedPeak, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "fits": self.fits,
            "limit_gib": self.limit_gib,
            "table": [asdict(m) for m in self.table],
            "offload": self.offload,
            "predicted": [asdict(p) for p in self.predicted],
        }

    @classmethod
    def from_json(cls, data: Any, levels: tuple[float, ...] | None) -> CacheEntry:
        """The entry `data` holds for a run whose ladder has `levels` (None: no ladder); ValueError
        naming what calibration would not have written."""
        _check(_is_dict_of(data, {f.name for f in fields(cls)}), "its fields")
        _check(_is_candidate(data["budget"]), "budget")
        _check(isinstance(data["fits"], bool), "fits")
        _check(_is_number(data["limit_gib"]), "limit_gib")
        _check(_is_rung(data["offload"], levels), "offload")
        _check(isinstance(data["table"], list) and bool(data["table"]), "table")
        _check(isinstance(data["predicted"], list), "predicted")
        table = tuple(_measurement(row, levels) for row in data["table"])
        predicted = tuple(_prediction(row, levels) for row in data["predicted"])
        entry = cls(data["budget"], data["fits"], data["limit_gib"], table, data["offload"], predicted)
        _check(entry.chosen() is not None, "table: no run of the chosen budget")
        return entry

    def chosen(self) -> Measurement | None:
        """The table's run of the chosen budget and rung (one that did not run out of memory)."""
        return next(
            (m for m in self.table if m.budget == self.budget and m.offload == self.offload and not m.out_of_memory),
            None,
        )


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def _is_dict_of(value: Any, keys: set[str]) -> bool:
    return isinstance(value, dict) and set(value) == keys


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_candidate(value: Any) -> bool:
    return _is_number(value) and value in CANDIDATES  # True == 1.0: bools are refused first


def _is_rung(value: Any, levels: tuple[float, ...] | None) -> bool:
    return value is None if levels is None else (_is_number(value) and value in levels)


def _measurement(row: Any, levels: tuple[float, ...] | None) -> Measurement:
    _check(_is_dict_of(row, {f.name for f in fields(Measurement)}), "table: a row's fields")
    _check(_is_candidate(row["budget"]) and _is_rung(row["offload"], levels), "table: a row's budget or offload")
    _check(_is_number(row["seconds"]) and row["seconds"] >= 0 and _is_count(row["peak_bytes"]), "table: a row's figures")
    _check(isinstance(row["out_of_memory"], bool), "table: a row's out_of_memory")
    return Measurement(**row)


def _prediction(row: Any, levels: tuple[float, ...] | None) -> PredictedPeak:
    _check(_is_dict_of(row, {f.name for f in fields(PredictedPeak)}), "predicted: a row's fields")
    _check(_is_candidate(row["budget"]) and _is_rung(row["offload"], levels), "predicted: a row's budget or offload")
    _check(_is_count(row["peak_bytes"]), "predicted: a row's peak_bytes")
    return PredictedPeak(**row)


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


def cached_entry(key: str, ladder: OffloadLadder | None) -> CacheEntry | None:
    """The cache's entry for `key`, or None; a malformed one warns and is calibrated again."""
    data = _read_cache().get(key)
    if data is None:
        return None
    try:
        return CacheEntry.from_json(data, None if ladder is None else ladder.levels)
    except Exception as error:  # ValueError, or a value no check expects (an int too large for a float)
        warn(f"ignoring a malformed entry of the auto budget cache {cache_path()} ({error}): {reprlib.repr(data)}")
        return None


def write_entry(key: str, entry: CacheEntry) -> None:
    path = cache_path()
    cache = _read_cache()
    cache[key] = entry.to_json()
    try:
        write_atomically(path, json.dumps(cache, indent=1).encode())
    except (OSError, RecursionError) as error:  # (RecursionError: another entry, as read, nested too deep to write)
        warn(f"could not write the auto budget cache {path}: {error}")
