"""How auto names its candidates and logs its calibration table."""

from __future__ import annotations

from ..memory import GIB
from .cache import CacheEntry
from .search import OffloadLadder


def table_lines(entry: CacheEntry, ladder: OffloadLadder | None, limit: int, chosen: str) -> list[str]:
    """The log's calibration table: per setting its predicted peak, and its time and peak where
    it was run (settings whose prediction ran out of memory: measured only)."""
    measured = {}
    for m in entry.table:
        where = setting(m.budget, m.offload, ladder)
        if m.out_of_memory:
            measured[where] = "out of memory"
        else:
            mark = "  <- chosen" if where == chosen else ""
            over = "  (over the limit)" if m.peak_bytes > limit else ""
            measured[where] = f"{m.seconds * 1e3:8.1f} ms, peak {m.peak_bytes / GIB:6.2f} GiB{mark}{over}"
    lines = []
    for row in entry.predicted:
        where = setting(row.budget, row.offload, ladder)
        run = measured.pop(where, "not run")
        lines.append(f"  {where}: predicted {row.peak_bytes / GIB:6.2f} GiB; {run}")
    return lines + [f"  {where}: {run}" for where, run in measured.items()]


def level_text(level: float) -> str:
    """A rung of the ladder as the log writes it (12, not 12.0)."""
    return f"{level:g}"


def setting(budget: float, level: float | None, ladder: OffloadLadder | None) -> str:
    """How the log names a candidate: "budget 0.1" or "blocks_to_swap 12, budget 0.1"."""
    return f"budget {budget:.1f}" if ladder is None else f"{ladder.name} {level_text(level)}, budget {budget:.1f}"
