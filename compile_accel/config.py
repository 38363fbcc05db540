"""CompileConfig: what to compile and how. Validated once, before anything touches the model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MODES = ("off", "selective", "blocks")
BASE_COMPUTES = (None, "int8", "fp8")
INDUCTOR_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # inductor's modes that turn its CUDA graphs on
WITHOUT_CUDA_GRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}
# The largest vram_limit_gib: 1 PiB, thousands of times any one GPU's memory, so a larger limit
# is a typo; in bytes it stays an exact int64, which torch's memory counters are (1e300 GiB
# would overflow auto's byte count at the first step).
MAX_VRAM_LIMIT_GIB = 2**20


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class CompileConfig:
    """How `compile_accel.apply` accelerates a model.

    mode: "off" leaves the model eager; "selective" compiles the compute children of each
        repeated block while the block's own forward (and its checkpoint wrapper) stays eager;
        "blocks" compiles each whole block.
    activation_memory_budget: 0.0..1.0, "blocks" mode only. The min-cut partitioner keeps
        this fraction of the block's activations for backward and recomputes the rest
        (0.0 ~ full checkpointing, 1.0 ~ no recompute). A budget replaces the model's own
        checkpointing of the compiled blocks. None keeps PyTorch's default and the model's
        checkpointing as it is. "auto" predicts each budget's peak memory on the first training
        batch and keeps the largest whose measured peak fits `vram_limit_gib` (see
        compile_accel.auto_budget).
    vram_limit_gib: the memory "auto" must fit, in GiB of peak allocated memory, at most
        MAX_VRAM_LIMIT_GIB (1 PiB); None: what the GPU has free (plus what this process already
        holds) minus a margin.
    dynamic: None lets dynamo decide (one static graph, a dynamic one on the first new shape;
        with compile_workers, static graphs only); True compiles with symbolic shapes from the
        start, so the token counts of aspect-ratio buckets share one graph (parameter shapes
        stay static); False compiles one static graph per shape.
    backend: a torch.compile backend name.
    compile_mode: inductor mode ("default", "reduce-overhead", "max-autotune",
        "max-autotune-no-cudagraphs"); inductor only. "reduce-overhead" replays each compiled
        graph as a CUDA graph: one launch instead of hundreds, for steps bound by kernel launches
        (sd-scripts' SDXL with LoRA: ~14,000 a step). A CUDA graph records its inputs' addresses:
        blocks whose weights move (offloading, block swap) record again at every move. Use it
        with a budget (with "auto", calibration reads reserved memory, which holds the graphs'
        pools, and never offloads). In selective mode only the graphs run without grad are
        recorded, their outputs copied out: the first forward of a block under a reentrant
        checkpoint (sd-scripts' SDXL); its recompute and backward run compiled without. Graphs
        recorded with grad under the model's own checkpoint fail in its recompute, which reads
        outputs a later replay overwrote (torch 2.11; docs/modes.md).
    fullgraph: refuse graph breaks inside a region (they become compile errors, and the
        region falls back to eager with a warning).
    recompile_limit: graphs dynamo may compile per region function and call signature before
        it gives up; hitting it is warned about and counted.
    exclude: glob patterns of submodule names (as in `model.named_modules()`) that are never
        compiled; inside a compiled region they run eager behind a graph break.
    fast_compile: compile the regions without inductor's pattern-matcher passes, without
        autotuning pointwise kernels and without its second config for register-heavy
        reductions (compile_accel.backend.FAST_COMPILE_SETTINGS): seconds less per cold compile
        of a block class and up to a second less per warm start, but slower steps on a 4090's
        compute (sd-scripts' SD3 1.6%, Anima 0.9%; docs/modes.md). False (the default) compiles
        with inductor's defaults: a training run pays those seconds back within a few hundred steps.
    compile_workers: 0 compiles each graph in this process, the step waiting for it. N > 0 hands
        each graph's compile (AOTAutograd and inductor) to N worker processes (inductor only; on
        Windows spawned ones, see compile_accel.compile_workers): the step runs each graph uncompiled until it is back, and the graphs of every
        block class and shape compile at the same time (compile_accel.compile_workers). A graph
        with symbolic shapes (dynamic=True) compiles in this process. More than the CPU cores
        start one per core, with a warning.
    base_compute: None computes everything in the model's dtypes. "int8" runs the matmuls of the
        frozen nn.Linear layers inside the compiled regions (a LoRA's base Linear included) as
        int8 x int8 products with per-token and per-channel scales, forward and input gradient;
        the LoRA path stays in its dtype (compile_accel.base_compute). On CPUs and CUDA GPUs of
        compute capability 8.0 or newer. "fp8": the same in float8_e4m3fn products with row-wise
        scales (torch._scaled_mm), a weight stored in float8_e4m3fn used as it is; on CPUs and
        CUDA GPUs of compute capability 8.9 or newer.
    """

    mode: str = "selective"
    activation_memory_budget: float | str | None = None
    dynamic: bool | None = None
    backend: str = "inductor"
    compile_mode: str | None = None
    fullgraph: bool = False
    recompile_limit: int = 64
    exclude: list[str] = field(default_factory=list)
    vram_limit_gib: float | None = None
    fast_compile: bool = False
    compile_workers: int = 0
    base_compute: str | None = None

    @property
    def compile_dynamic(self) -> bool | None:
        """`dynamic` as the regions compile with it. With compile workers None is False: workers
        take graphs of static shapes, and a graph per new shape compiles beside the others
        instead of one with symbolic shapes in this process."""
        return False if self.dynamic is None and self.compile_workers else self.dynamic

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it allows."""
        if self.mode not in MODES:
            raise ValueError(f"CompileConfig.mode must be one of {MODES}, got {self.mode!r}")
        budget = self.activation_memory_budget
        if budget == "auto":
            if self.mode != "blocks":
                raise ValueError(
                    f"CompileConfig.activation_memory_budget='auto' applies to mode='blocks' only (got mode={self.mode!r})"
                )
        elif budget is not None:
            if not _is_number(budget) or math.isnan(budget):
                raise ValueError(
                    f"CompileConfig.activation_memory_budget must be a number in [0.0, 1.0], 'auto' or None, got {budget!r}"
                )
            if not 0.0 <= budget <= 1.0:
                raise ValueError(f"CompileConfig.activation_memory_budget must be in [0.0, 1.0], got {budget!r}")
            if self.mode != "blocks":
                raise ValueError(
                    "CompileConfig.activation_memory_budget applies to mode='blocks' only "
                    f"(got mode={self.mode!r}); selective regions sit inside an eager checkpoint "
                    "that discards what the partitioner would save"
                )
        limit = self.vram_limit_gib
        if limit is not None and not (_is_number(limit) and 0 < limit <= MAX_VRAM_LIMIT_GIB):
            raise ValueError(
                f"CompileConfig.vram_limit_gib must be a positive number of GiB, at most {MAX_VRAM_LIMIT_GIB} "
                f"(1 PiB), or None, got {limit!r}"
            )
        if limit is not None and budget != "auto":
            raise ValueError("CompileConfig.vram_limit_gib applies to activation_memory_budget='auto' only")
        # Flags are bools, not ints: 1 == True would pass a membership test and reach torch.compile.
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise ValueError(f"CompileConfig.dynamic must be None, True or False, got {self.dynamic!r}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"CompileConfig.backend must be a backend name, got {self.backend!r}")
        if self.compile_mode is not None:
            if self.backend != "inductor":
                raise ValueError(
                    f"CompileConfig.compile_mode applies to backend='inductor' only, got backend={self.backend!r}"
                )
            if self.compile_mode not in INDUCTOR_MODES:
                raise ValueError(
                    f"CompileConfig.compile_mode must be one of {INDUCTOR_MODES}, got {self.compile_mode!r}"
                )
        for flag in ("fullgraph", "fast_compile"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"CompileConfig.{flag} must be True or False, got {getattr(self, flag)!r}")
        if (
            isinstance(self.recompile_limit, bool)
            or not isinstance(self.recompile_limit, int)
            or self.recompile_limit < 1
        ):
            raise ValueError(f"CompileConfig.recompile_limit must be an int >= 1, got {self.recompile_limit!r}")
        workers = self.compile_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"CompileConfig.compile_workers must be an int >= 0, got {workers!r}")
        if workers and self.backend != "inductor":
            raise ValueError(
                f"CompileConfig.compile_workers compiles with inductor in workers; backend={self.backend!r} "
                "is not inductor"
            )
        if self.base_compute not in BASE_COMPUTES:
            raise ValueError(f"CompileConfig.base_compute must be one of {BASE_COMPUTES}, got {self.base_compute!r}")
        if self.base_compute is not None and self.mode == "off":
            raise ValueError(
                f"CompileConfig.base_compute={self.base_compute!r} applies inside compiled regions; "
                "mode='off' compiles none"
            )
        if not isinstance(self.exclude, (list, tuple)) or not all(isinstance(p, str) for p in self.exclude):
            raise ValueError(f"CompileConfig.exclude must be a list of glob patterns, got {self.exclude!r}")


def cuda_graph_refusal(config: CompileConfig, moved_by: str | None) -> str | None:
    """Why CUDA graphs (a compile_mode in CUDA_GRAPH_MODES) cannot serve `config`, or None; the
    bench and the sd-scripts launcher refuse with it. moved_by: what moves the blocks' weights
    between steps (offloading, block swap, other GPUs), if anything."""
    if config.mode == "off" or (config.mode == "blocks" and config.activation_memory_budget is None):
        # Whole blocks under the model's own checkpointing: the recompute reads outputs a later
        # replay overwrote (torch 2.11; benchmarks/results/h200_selective_cuda_graphs/README.md).
        # Selective mode records only graphs run without grad (compile_accel.backend).
        return (
            "CUDA graphs need whole blocks under an activation memory budget (a number or auto), or selective "
            "mode: whole blocks under the model's own gradient checkpointing fail"
        )
    if moved_by:
        return f"a CUDA graph records the blocks' weights where they are, and {moved_by} moves them every step"
    return None
