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
3. Where the one that fits peaked below its prediction and the next larger candidate's
   prediction, less that overshoot, fits, that one is compiled and measured too (and so on up
   while each is the fastest and predicted): the fastest measured that fits is taken. Not with
   CUDA graphs: measuring a candidate frees the graphs recorded for the one before.

The largest budget that fits is taken as the fastest: it saves more and recomputes less (in the
bench's medians the step time fell as the budget rose, or stayed within 1%:
benchmarks/results/h100_24gib_auto/), so a calibration compiles one budget when the prediction
is right. The chosen budget's graphs are the ones training then runs. With compile workers
(CompileConfig.compile_workers), the first step waits for the traced step alone, which runs the
graphs uncompiled under a checkpoint while the workers trace and partition them
(compile_accel.saved_bytes). The training steps go on running them so (saving no more than the
lowest budget) until the partitions are back; the first step after predicts, and hands the
candidate's graphs to the workers, compiled from the traced step's own graphs as dynamo traced
them: the step is not traced again (RegionBackend.adopt). The steps run the candidate
uncompiled, under a checkpoint, until its graphs are back; it is measured at the first step
after.
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

The package: `search` (candidates, measurements, the ladder, the bisections), `cache` (the
calibration cache and its entries), `measure` (a step's seconds and peak), `report` (the log's
table), `calibration` (AutoBudget).
"""

from __future__ import annotations

from ..memory import GIB
from .cache import CacheEntry, PredictedPeak, cache_path
from .calibration import AutoBudget
from .measure import default_limit_bytes
from .search import CANDIDATES, Measurement, OffloadLadder, Waiting, choose, predict_largest_fitting, spaced_levels

__all__ = [
    "CANDIDATES",
    "GIB",
    "AutoBudget",
    "CacheEntry",
    "Measurement",
    "OffloadLadder",
    "PredictedPeak",
    "Waiting",
    "cache_path",
    "choose",
    "default_limit_bytes",
    "predict_largest_fitting",
    "spaced_levels",
]
