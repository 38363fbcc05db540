"""`apply(model, config)`: compile a model's repeated blocks in place, and undo it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from . import checkpointing
from .adapters import ModelAdapter, ModelOffloadLadder
from .auto_budget import AutoBudget, OffloadLadder
from .saved_bytes import SavedBytesEstimate
from .blocks import BlockList, resolve_block_lists
from . import compile_workers
from .backend import start_compile_workers
from . import base_compute
from .base_compute import BaseLinears, base_compute_advice, base_compute_refusal
from .compile_profile import CompileClock, CompileTimes
from .config import CUDA_GRAPH_MODES, CompileConfig
from .offload import offload_fraction_ladder
from .preload import wait_for_preload
from .regions import CompiledFunction, Region, restore_forward
from .selective import is_excluded, region_specs
from .stats import Stats, warn

_MARK = "_compile_accel"
logger = logging.getLogger("compile_accel")


@dataclasses.dataclass
class _EagerPatch:
    """An excluded submodule inside a region: its forward runs eager behind a graph break."""

    module: nn.Module
    forward: Callable

    def install(self) -> None:
        self.module.forward = torch._dynamo.disable(self.forward, recursive=True)

    def uninstall(self) -> None:
        restore_forward(self.module, self.forward)


class Acceleration:
    """What `apply` did to a model: its regions, their counters, and how to undo it."""

    def __init__(
        self,
        model: nn.Module,
        config: CompileConfig,
        block_lists: list[BlockList],
        regions: list[Region],
        eager_patches: list[_EagerPatch],
        switches: list[checkpointing.CheckpointSwitch],
        stats: Stats,
        base_linears: BaseLinears | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_lists = block_lists
        self.regions = regions
        self._eager_patches = eager_patches
        self._switches = switches
        self._stats = stats
        self.base_linears = base_linears
        self._removed = False
        self._on_remove: list[Callable[[], None]] = []
        self.auto_budget: AutoBudget | None = None
        self._compile_clock = CompileClock()

    def on_remove(self, callback: Callable[[], None]) -> None:
        """Run `callback` in remove() (after the regions are gone; last added, first run).
        Integrations use it to undo what they changed around `apply`."""
        self._on_remove.append(callback)

    def stats(self) -> dict[str, Any]:
        """Counters since apply(): regions, compiled_regions, unique_graphs, recompiles,
        graph_breaks, compile_seconds, fallbacks, eager_nonresident_calls, and more; under
        "compile_times", where this process's compile time since apply() went (phase seconds and
        cache hits, compile_accel.compile_profile); with activation_memory_budget="auto", the
        calibration under "auto_budget" (None until it is done: the first training step, or with
        compile workers the first after the candidate's graphs are back); with base_compute, under
        "base_compute" how many of the regions' frozen Linears run in 8 bits and why the others
        stay (compile_accel.base_compute.BaseLinears.summary; None without base_compute)."""
        counted = self._stats if self.auto_budget is None else self.auto_budget.counted()
        stats = {"mode": self.config.mode, **counted.as_dict(), "compile_times": self.compile_times().as_dict()}
        if self.auto_budget is not None:
            stats["auto_budget"] = self.auto_budget.result
        stats["base_compute"] = self.base_linears.summary() if self.base_linears is not None else None
        return stats

    @property
    def functions(self) -> list[CompiledFunction]:
        """The compiled functions the regions share (one per block class and method; a body's
        with its checkpoint traced too)."""
        functions = [f for r in self.regions for f in (r.shared, r.under_checkpoint) if f is not None]
        return list(dict.fromkeys(functions))

    @property
    def signature(self) -> str:
        """What is compiled and how (region names, config less auto's limit): part of the keys
        of auto's calibration cache and of the compiled-graph cache."""
        return repr(([r.name for r in self.regions], dataclasses.replace(self.config, vram_limit_gib=None)))

    def compile_times(self) -> CompileTimes:
        """Where this process's compile time since apply() went: phases and cache hits."""
        return self._compile_clock.since()

    def remove(self) -> None:
        """Put the model back to plain eager execution (and its checkpointing as it was)."""
        if self._removed:
            return
        for region in self.regions:
            region.uninstall()
        for patch in self._eager_patches:
            patch.uninstall()
        for switch in self._switches:
            switch.restore()
        for callback in reversed(self._on_remove):
            callback()
        if self.base_linears is not None:
            base_compute.register(self.base_linears, applied=False)
        self.model.__dict__.pop(_MARK, None)
        self._removed = True

    def __repr__(self) -> str:
        return f"Acceleration(mode={self.config.mode!r}, regions={len(self.regions)}, blocks={[b.path for b in self.block_lists]})"


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply() takes an nn.Module, got {type(model).__name__}")
    if _MARK in model.__dict__:
        raise RuntimeError(
            f"compile_accel.apply() was already called on this {type(model).__name__}; "
            "call .remove() on the Acceleration it returned before applying again"
        )
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device ({meta[0]}, ...); "
            "load or materialise the weights (e.g. model.to_empty(device=...)) before apply()"
        )


def _check_backend(config: CompileConfig) -> None:
    if config.compile_workers and not compile_workers.SUPPORTED:
        raise ValueError(f"CompileConfig.compile_workers {compile_workers.UNSUPPORTED_WHY}; use compile_workers=0")
    try:
        torch._dynamo.lookup_backend(config.backend)
    except Exception:
        raise ValueError(
            f"CompileConfig.backend {config.backend!r} is not a torch.compile backend; "
            f"known: {torch._dynamo.list_backends(exclude_tags=())}"
        ) from None


def _checked_config(config: CompileConfig | None) -> CompileConfig:
    """The config (the default one for None), validated; bad input raises before anything changes."""
    config = config or CompileConfig()
    if not isinstance(config, CompileConfig):
        raise TypeError(f"apply() takes a CompileConfig, got {type(config).__name__}")
    config.validate()
    return config


def apply(
    model: nn.Module,
    config: CompileConfig | None = None,
    blocks: Sequence[str | nn.ModuleList] | None = None,
) -> Acceleration:
    """Compile `model`'s repeated blocks in place and return the Acceleration.

    Call it after LoRA/adapters are applied and before the first training step. It changes
    no parameter and no state-dict key. A second call on the same model raises; call
    `remove()` first. Bad input raises before anything is changed. A model a shipped
    integration knows (a diffusers transformer of `integrations.diffusers.ADAPTERS`, an
    sd-scripts model of `integrations.sd_scripts.FAMILIES`) gets that integration's adapter,
    as its own `apply` gives it, and the log says so; `blocks` given, or any other model,
    compiles as asked.
    """
    integration = _integration_for(model) if blocks is None else None
    if integration is None:
        return apply_adapter(model, config, None, blocks)
    name, adapter = integration
    logger.info("apply: %s is known to the %s integration; applying its adapter", type(model).__name__, name)
    return apply_adapter(model, config, adapter)


def _integration_for(model: Any) -> tuple[str, ModelAdapter] | None:
    """(name, adapter) of the shipped integration that knows this model's class, or None. Both
    look classes up by name, so the module tells which one to ask (each has a UNet2DConditionModel)."""
    module = type(model).__module__
    if module.startswith("diffusers."):
        from .integrations.diffusers import ADAPTERS as known

        name = "diffusers"
    elif module.startswith("library."):
        from .integrations.sd_scripts import FAMILIES as known

        name = "sd-scripts"
    else:
        return None
    adapter = known.get(type(model).__name__)
    return None if adapter is None else (name, adapter)


def apply_adapter(
    model: nn.Module,
    config: CompileConfig | None,
    adapter: ModelAdapter | None,
    blocks: Sequence[str | nn.ModuleList] | None = None,
) -> Acceleration:
    """`apply`'s one path, and the integrations' `apply`: the adapter's block lists, rewrite and
    offload ladder; without an adapter, the `blocks` given (None: the repeated blocks found).

    Everything is checked, once, before the rewrite runs. `restore()` runs the rewrite's undo,
    or it runs at once if applying raises. Mode "off" leaves the model as it is, rewrite
    included (the eager baseline of a benchmark)."""
    wait_for_preload()  # before anything here imports inductor (compile_accel.preload)
    config = _checked_config(config)
    if adapter and adapter.static_shapes and config.dynamic is None:
        config = dataclasses.replace(config, dynamic=False)
    _check_model(model)
    if config.mode != "off":
        _check_backend(config)
    if config.activation_memory_budget == "auto" and config.vram_limit_gib is None and not torch.cuda.is_available():
        raise ValueError(
            "activation_memory_budget='auto' without a GPU needs CompileConfig.vram_limit_gib "
            "(on a CPU the limit applies to the bytes saved for backward)"
        )
    block_lists = resolve_block_lists(model, adapter.block_paths(model) if adapter else blocks)
    devices = {p.device for block_list in block_lists for p in block_list.blocks.parameters()}
    refusal = base_compute_refusal(config.base_compute, devices)
    if refusal:
        raise ValueError(f"CompileConfig.{refusal}")
    advice = base_compute_advice(config.base_compute, devices)
    if advice:
        warn(advice)

    # Everything above only looked; from here on the model changes, the adapter's rewrite first:
    # the regions are found in the rewritten model.
    undo = adapter.prepare(model) if adapter and adapter.prepare and config.mode != "off" else None
    try:
        acceleration = _compile_blocks(model, config, block_lists, adapter.offload_ladder if adapter else None)
    except Exception:
        if undo:
            undo()
        raise
    if undo:
        acceleration.on_remove(undo)
    return acceleration


def _compile_blocks(
    model: nn.Module,
    config: CompileConfig,
    block_lists: list[BlockList],
    offload_ladder: ModelOffloadLadder | None,
) -> Acceleration:
    """apply_adapter's second half, on input it has checked: find the regions, then install them."""
    stats = Stats()
    shared: dict[Callable, CompiledFunction] = {}
    regions = []
    specs = region_specs(config.mode, block_lists, config.exclude, config.compile_mode in CUDA_GRAPH_MODES)
    base_linears = BaseLinears.find(config.base_compute, specs, config.exclude) if config.base_compute else None
    if base_linears is not None and not base_linears.layers:
        warn(
            f"base_compute={config.base_compute!r} found no frozen nn.Linear in the compiled regions: "
            "every matmul runs in the model's dtypes"
        )
    under_checkpoint: dict[Callable, CompiledFunction] = {}  # a body's, with its checkpoint traced
    for spec in specs:
        method = getattr(spec.module, spec.method)
        fn = getattr(method, "__func__", method)
        if fn not in shared:
            shared[fn] = CompiledFunction(fn, config, stats, base_linears)
        if spec.method != "forward" and fn not in under_checkpoint:  # the body a block checkpoints
            under_checkpoint[fn] = CompiledFunction(fn, config, stats, base_linears, traces_checkpoint=True)
            under_checkpoint[fn].shared_inputs = shared[fn].shared_inputs  # the same calls: one decision per class
        regions.append(Region(spec, shared[fn], config, under_checkpoint.get(fn)))
    if config.mode != "off" and not regions:
        warn(
            f"mode={config.mode!r} found nothing to compile in {[bl.path for bl in block_lists]}: their compute is "
            "excluded or lone built-in layers (a Linear, a norm), which a graph would not make faster; the model runs eager"
        )
    eager_patches = [
        _EagerPatch(sub, sub.forward)
        for region in regions
        for sub_name, sub in region.module.named_modules(prefix=region.spec.name)
        if sub is not region.module and is_excluded(sub_name, config.exclude)
    ]
    switches, uncheckpointed = (
        checkpointing.find_checkpoint_switches(model, block_lists, {r.spec.name for r in regions})
        if config.mode == "blocks" and config.activation_memory_budget is not None
        else ([], [])
    )

    # Everything above only looked; from here on the regions change the model. Anything that
    # raises on the way (a worker pool that cannot start: file descriptors exhausted) is raised
    # with every change undone, so that the model is as it was and apply() may be called again.
    acceleration = Acceleration(model, config, block_lists, regions, eager_patches, switches, stats, base_linears)
    try:
        _install(acceleration, shared, offload_ladder, uncheckpointed)
    except BaseException:
        acceleration.remove()
        raise
    model.__dict__[_MARK] = acceleration
    if base_linears is not None:
        base_compute.register(base_linears, applied=True)
    return acceleration


def _install(
    acceleration: Acceleration,
    shared: dict[Callable, CompiledFunction],
    offload_ladder: ModelOffloadLadder | None,
    uncheckpointed: list[str],
) -> None:
    """_compile_blocks' changes to the model, each undone by `acceleration.remove()`."""
    model, config, stats = acceleration.model, acceleration.config, acceleration._stats
    regions, switches = acceleration.regions, acceleration._switches
    checkpointing.turn_off(switches)
    if uncheckpointed:
        warn(
            f"the activation memory budget turned off checkpointing switches ({', '.join(s.name for s in switches)}) "
            f"that also checkpoint blocks left eager by CompileConfig.exclude ({', '.join(uncheckpointed[:3])}"
            f"{', ...' if len(uncheckpointed) > 3 else ''}): those now keep all their activations. Compile them "
            "too, or checkpoint them yourself"
        )
    stats.regions = len(regions)
    stats.checkpointing_switched_off = [s.name for s in switches]
    for patch in acceleration._eager_patches:
        patch.install()
    for region in regions:
        region.install()
    if regions and config.backend == "inductor":
        start_compile_workers()
        if config.compile_workers:
            compile_workers.start(config.compile_workers)
    if regions and config.compile_workers:
        # Graphs back from the workers switch to compiled at a step's start (compile_workers).
        hook = model.register_forward_pre_hook(lambda *_: compile_workers.step_started())
        acceleration.on_remove(hook.remove)
    if config.activation_memory_budget == "auto":

        def set_budget(
            budget: float, counts: Stats, estimate: SavedBytesEstimate | None = None, adopt: bool = False
        ) -> None:
            for fn in shared.values():
                fn.use_budget(budget, counts, estimate, adopt)

        blocks = [block for block_list in acceleration.block_lists for block in block_list.blocks]

        def find_ladder(device: torch.device) -> OffloadLadder | None:
            if offload_ladder is not None:
                return offload_ladder(model, device, acceleration.on_remove)
            return offload_fraction_ladder(blocks)

        acceleration.auto_budget = AutoBudget(
            model,
            set_budget,
            stats,
            config.vram_limit_gib,
            acceleration.signature,
            find_ladder,
            cuda_graphs=config.compile_mode in CUDA_GRAPH_MODES,
        )
        acceleration.on_remove(acceleration.auto_budget.remove)
    acceleration.on_remove(_watch_uncalled_regions(model, regions, stats).remove)
    if config.mode == "selective" and config.compile_mode in CUDA_GRAPH_MODES:
        for handle in _watch_selective_cuda_graphs(model, config, stats):
            acceleration.on_remove(handle.remove)


def _watch_uncalled_regions(model: nn.Module, regions: list[Region], stats: Stats) -> RemovableHandle:
    """After the model's first forward, regions never called (the model reaches those modules
    other than through their forward, so they compile nothing) are listed and warned about once."""

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        handle.remove()
        uncalled = [r.name for r in regions if r.calls == 0]
        if uncalled:
            stats.uncalled_regions = uncalled
            warn(
                f"{len(uncalled)} of {len(regions)} regions were not called in the model's first forward "
                f"({', '.join(uncalled[:3])}{', ...' if len(uncalled) > 3 else ''}): the model uses them other "
                "than through forward, so nothing of theirs is compiled. mode='blocks' compiles whole blocks"
            )

    handle = model.register_forward_hook(hook)
    return handle


def _watch_selective_cuda_graphs(model: nn.Module, config: CompileConfig, stats: Stats) -> list[RemovableHandle]:
    """Selective mode with CUDA graphs records only graphs run without grad (compile_accel.backend):
    after the first training forward (training mode, with grad) that compiled graphs, a warning
    if none of those was one (a checkpoint that runs its forward with grad). Forwards without
    grad before it (sampling) are not judged: their graphs record, training's may not."""
    before: list[int] = []

    def start(module: nn.Module, args: tuple) -> None:
        before[:] = [stats.graphs, stats.cuda_graph_graphs]

    def end(module: nn.Module, args: tuple, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()) or stats.graphs == before[0]:
            return
        for handle in handles:
            handle.remove()
        if stats.cuda_graph_graphs == before[1]:
            warn(
                f"compile_mode={config.compile_mode!r} in selective mode records only graphs run without grad "
                "(the forward of a block under a reentrant checkpoint), and the first training forward compiled "
                "every graph with grad: nothing of training replays as a CUDA graph. For CUDA graphs here use "
                "mode='blocks' with an activation memory budget"
            )

    handles = [model.register_forward_pre_hook(start), model.register_forward_hook(end)]
    return handles
