"""The mode grammar of `compile-accel bench`: MODES_HELP is its one description, shown by the
CLI's `--modes` help and by an unknown mode's error, and quoted word for word in docs/bench.md
(a test keeps the two alike), which also says what each mode measures."""

from __future__ import annotations

from dataclasses import dataclass

from compile_accel import CompileConfig
from compile_accel.config import cuda_graph_refusal

CUDA_GRAPHS = "+cudagraphs"  # compile_mode="reduce-overhead": each compiled graph replayed as a CUDA graph

MODES_HELP = (
    "eager, eager+ckpt, whole+ckpt, perblock+ckpt, selective+ckpt, blocks+ckpt, blocks+budget=B, blocks+auto; each "
    "optionally followed by +offload=F[+act][+int8], +ddp=N or +split=N; blocks+budget=B, blocks+auto or "
    "selective+ckpt alone optionally followed by +cudagraphs; a selective or blocks mode optionally ending in "
    "+compute=int8 or +compute=fp8"
)

# With no --modes: the library's main job (docs/bench.md), eager+ckpt first as the baseline of the "vs" column.
DEFAULT_MODES = ["eager+ckpt", "selective+ckpt", "blocks+budget=0.5", "blocks+budget=1.0"]


@dataclass
class OffloadSpec:
    fraction: float
    activation_offload: bool = False
    int8: bool = False


@dataclass
class ModeSpec:
    name: str
    config: CompileConfig
    checkpointing: bool
    # torch.compile applied by the bench itself, as other trainers do, not by compile_accel:
    # "model" (sd-scripts' --torch_compile) or "blocks" (each block, the peers' per-block compile).
    torch_compile: str | None = None
    offload: OffloadSpec | None = None
    ddp: int = 1  # data-parallel processes
    split: int = 1  # GPUs the blocks are split across


def _parse_offload(spec: str, suffix: str) -> OffloadSpec:
    value, *flags = suffix.split("+")
    try:
        fraction = float(value)
    except ValueError:
        raise ValueError(f"mode {spec!r}: offload fraction must be a number in [0, 1]") from None
    if not 0.0 <= fraction <= 1.0 or not set(flags) <= {"act", "int8"} or len(set(flags)) != len(flags):
        raise ValueError(f"mode {spec!r}: expected +offload=F with F in [0, 1], then optionally +act and +int8")
    return OffloadSpec(fraction, "act" in flags, "int8" in flags)


def _parse_count(spec: str, value: str) -> int:
    if not value.isdecimal() or int(value) < 2:
        raise ValueError(f"mode {spec!r}: +ddp=N and +split=N need a whole number N >= 2")
    return int(value)


def parse_mode(spec: str) -> ModeSpec:
    """'blocks+budget=0.5' -> blocks mode, budget 0.5, no checkpointing; ValueError if unknown."""
    rest, with_compute, compute = spec.partition("+compute=")
    counts: dict[str, int] = {}
    for key in ("ddp", "split"):
        rest, found, value = rest.partition(f"+{key}=")
        if found:
            counts[key] = _parse_count(spec, value)
    base, _, offload = rest.partition("+offload=")
    cuda_graphs = base.endswith(CUDA_GRAPHS)
    mode = _parse_compile_mode(base.removesuffix(CUDA_GRAPHS))
    mode.name = spec
    if cuda_graphs:
        moved_by = "+offload" if offload else next((f"+{key}" for key in counts), None)
        refusal = cuda_graph_refusal(mode.config, moved_by)
        if refusal:
            raise ValueError(
                f"mode {spec!r}: {CUDA_GRAPHS} goes after blocks+budget=B, blocks+auto or selective+ckpt alone: "
                f"{refusal}"
            )
        mode.config.compile_mode = "reduce-overhead"
    if offload:
        mode.offload = _parse_offload(spec, offload)
    if len(counts) > 1 or (counts and mode.offload is not None):
        raise ValueError(f"mode {spec!r}: +ddp, +split and +offload are separate ways to use GPUs; give one")
    mode.ddp, mode.split = counts.get("ddp", 1), counts.get("split", 1)
    if with_compute:
        if mode.config.mode == "off":
            raise ValueError(
                f"mode {spec!r}: +compute= runs base matmuls in 8 bits inside compiled regions; this mode compiles "
                "none with compile_accel"
            )
        mode.config.base_compute = compute
        try:
            mode.config.validate()
        except ValueError as error:
            raise ValueError(f"mode {spec!r}: {error}") from None
    return mode


def _parse_compile_mode(spec: str) -> ModeSpec:
    head, _, rest = spec.partition("+")
    if head == "eager" and rest in ("", "ckpt"):
        return ModeSpec(spec, CompileConfig(mode="off"), rest == "ckpt")
    if head == "whole" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="off"), True, torch_compile="model")
    if head == "perblock" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="off"), True, torch_compile="blocks")
    if head == "selective" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="selective"), True)
    if head == "blocks" and rest == "ckpt":
        return ModeSpec(spec, CompileConfig(mode="blocks"), True)
    if head == "blocks" and rest == "auto":
        return ModeSpec(spec, CompileConfig(mode="blocks", activation_memory_budget="auto"), False)
    if head == "blocks" and rest.startswith("budget="):
        try:
            budget = float(rest.removeprefix("budget="))
        except ValueError:
            raise ValueError(f"mode {spec!r}: budget must be a number in [0, 1]") from None
        config = CompileConfig(mode="blocks", activation_memory_budget=budget)
        config.validate()
        return ModeSpec(spec, config, False)
    raise ValueError(f"unknown mode {spec!r}; modes: {MODES_HELP}")

