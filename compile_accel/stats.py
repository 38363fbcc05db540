"""What happened while compiling: graphs, recompiles, breaks, fallbacks, eager calls.

Graphs and recompiles are counted by each region's backend as they are compiled; graph
breaks come from dynamo's own counters around each compiling call; a recompile-limit
hit is read from the warning dynamo logs when it gives up on a function (it would
otherwise run eager without a word).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def graph_break_total() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


@dataclass
class Stats:
    """Counters shared by the regions of one Acceleration.

    A graph's signature is its frame plus its inputs' names, shapes, dtypes and requires_grad,
    the grad mode and autocast. `unique_graphs` counts signatures; `recompiles` counts graphs
    compiled again for a signature that already had one (a per-block Python constant, a config
    change): compile time spent for nothing. A new shape is a new graph, not a recompile.
    Python argument values and inference mode are not in the signature: graphs for those
    count as recompiles too.
    """

    regions: int = 0
    graphs: int = 0
    recompiles: int = 0
    signatures: set = field(default_factory=set)
    graph_breaks: int = 0
    compile_seconds: float = 0.0
    eager_nonresident_calls: int = 0
    recompile_limit_hits: int = 0
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    checkpointing_switched_off: list[str] = field(default_factory=list)
    still_checkpointed: list[str] = field(default_factory=list)
    uncalled_regions: list[str] = field(default_factory=list)
    # CompileConfig.compile_workers: graphs handed to the workers, those back and switched to,
    # and those whose compile failed there (they run uncompiled); per graph back, where the time
    # went (seconds in the worker's queue, compiling there, loading here; the worker's phases).
    worker_graphs_started: int = 0
    worker_graphs_compiled: int = 0
    worker_failures: list[str] = field(default_factory=list)
    worker_compiles: list[dict[str, Any]] = field(default_factory=list)
    # Graphs compiled with CUDA graphs asked for (CompileConfig.compile_mode); inductor may still
    # run one without (torch._dynamo.utils.counters["inductor"]["cudagraph_skips"], logged).
    cuda_graph_graphs: int = 0

    def record_graph(self, signature: tuple) -> None:
        self.graphs += 1
        if signature in self.signatures:
            self.recompiles += 1
        self.signatures.add(signature)

    def absorb(self, other: Stats) -> None:
        """Add the counts of `other` (one calibration run of auto: every graph it compiled counts)."""
        self.graphs += other.graphs
        self.recompiles += other.recompiles
        self.signatures |= other.signatures
        self.graph_breaks += other.graph_breaks
        self.compile_seconds += other.compile_seconds
        self.eager_nonresident_calls += other.eager_nonresident_calls
        self.recompile_limit_hits += other.recompile_limit_hits
        self.fallbacks += other.fallbacks
        self.still_checkpointed += [r for r in other.still_checkpointed if r not in self.still_checkpointed]
        self.worker_graphs_started += other.worker_graphs_started
        self.worker_graphs_compiled += other.worker_graphs_compiled
        self.worker_failures += other.worker_failures
        self.worker_compiles += other.worker_compiles
        self.cuda_graph_graphs += other.cuda_graph_graphs

    def as_dict(self) -> dict[str, Any]:
        fallen = {name for name, _ in self.fallbacks}
        return {
            "regions": self.regions,
            "compiled_regions": self.regions - len(fallen),
            "unique_graphs": len(self.signatures),
            "recompiles": self.recompiles,
            "graph_breaks": self.graph_breaks,
            "compile_seconds": round(self.compile_seconds, 3),
            "fallbacks": [{"region": name, "reason": reason} for name, reason in self.fallbacks],
            "eager_nonresident_calls": self.eager_nonresident_calls,
            "recompile_limit_hits": self.recompile_limit_hits,
            "checkpointing_switched_off": list(self.checkpointing_switched_off),
            "still_checkpointed": list(self.still_checkpointed),
            "uncalled_regions": list(self.uncalled_regions),
            "worker_graphs_started": self.worker_graphs_started,
            "worker_graphs_compiled": self.worker_graphs_compiled,
            "worker_failures": list(self.worker_failures),
            "worker_compiles": list(self.worker_compiles),
            "cuda_graph_graphs": self.cuda_graph_graphs,
        }


class _RecompileLimitWatcher(logging.Handler):
    """Turns dynamo's 'hit config.recompile_limit' log line into a warning and a count.

    Listeners are `(code, callback)` pairs held weakly through their owner; dynamo names the
    function as "'name' (file:line)", which is matched against each listener's code object.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self._listeners: weakref.WeakKeyDictionary[object, tuple[str, Callable[[str], None]]] = (
            weakref.WeakKeyDictionary()
        )

    def listen(self, owner: object, code: Any, callback: Callable[[str], None]) -> None:
        self._listeners[owner] = (f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})", callback)

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("torch._dynamo hit config.") or len(record.args or ()) < 4:
            return
        function, reason = str(record.args[2]), str(record.args[3])
        for name, callback in list(self._listeners.values()):
            if name == function:
                callback(reason)


RECOMPILE_LIMIT_WATCHER = _RecompileLimitWatcher()
logging.getLogger("torch._dynamo.convert_frame").addHandler(RECOMPILE_LIMIT_WATCHER)


def warn(message: str) -> None:
    warnings.warn(f"compile_accel: {message}", RuntimeWarning, stacklevel=3)
