"""Compiled regions: a module whose forward runs through one shared compiled function.

A region replaces `module.forward`, or the body method the module's checkpoint runs
(`_forward`; see compile_accel.selective), with a dispatcher: an instance attribute, so
state-dict keys, parameters and hooks stay as they are. All regions whose method is the same
function (every instance of a block class, every kohya-LoRA-patched Linear) share one
`torch.compile` of that function, called with the instance as `self`: one graph per class
and input shape, not one compile per instance. A function called with more than one call
signature (sd-scripts' NextDiT: its refiners pass the block 3 arguments, its layers 4) has a
compile per signature, over a copy of the function with a code object of its own: dynamo keeps
a code object's graphs together, so a shared one made every graph of the second signature a
recompile of the first's (logged as one, counted against the recompile limit).

The region decides, per call, eager or compiled: eager when its parameters are not on the
device of its inputs (an offload conductor has it in host memory), or when the shared function
could not be compiled for the region's class (its forward or backward graph raised in the
compile, or dynamo compiled no graph). The CompiledFunction runs the compiled call and accounts
for it (inputs in one layout, compile time, graph breaks, fallbacks).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import time
import types
from typing import Any, Callable, NoReturn

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from .backend import RegionBackend, flagged
from .base_compute import BaseLinears
from .base_compute_probe import compare_compute
from .checkpointing import (
    called_by_torch_checkpoint,
    past_the_checkpoint,
    traced_checkpoint,
    under_saved_tensor_checkpoint,
)
from .saved_bytes import SavedBytesEstimate
from .config import CUDA_GRAPH_MODES, CompileConfig
from .dynamo_settings import COMPILE_TAKES_RECOMPILE_LIMIT, ensure_thread_settings
from .fallback_reasons import failure_reason, no_graph_reason
from .int8_weight import Int8Weight
from .precompile import TRACED, Precompiled, saved_guards
from .region_inputs import SharedInputs, canonical_inputs, check_aliased_views
from .selective import RegionSpec
from .stats import RECOMPILE_LIMIT_WATCHER, Stats, graph_break_total, warn

logger = logging.getLogger("compile_accel")

# Input shapes base_compute's accuracy check runs for per region class: the first step's kinds of
# call (Lumina 2 has three in one class) and one more; later buckets mostly run the same graphs
# (dynamic shapes), and each check costs one more forward and backward of a block.
ACCURACY_CHECKS_PER_CLASS = 4

# A call's signature as dynamo guards it: the number of positional arguments and the keywords.
CallSignature = tuple[int, tuple[str, ...]]


def _split_method(forward: Callable) -> tuple[Callable, Any]:
    """(function, self) of a bound method; (callable, None) for anything else."""
    if inspect.ismethod(forward):
        return forward.__func__, forward.__self__
    return forward, None


class CompiledFunction:
    """One torch.compile of one forward function, shared by every region that runs it."""

    def __init__(
        self,
        fn: Callable,
        config: CompileConfig,
        stats: Stats,
        base_linears: BaseLinears | None = None,
        traces_checkpoint: bool = False,
    ) -> None:
        # traces_checkpoint: compile `fn` under torch's checkpoint (compile_accel.checkpointing), for
        # the calls torch's checkpoint makes of a body region.
        self.traces_checkpoint = traces_checkpoint
        self.fn = with_own_code(traced_checkpoint(fn)) if traces_checkpoint else fn
        self.config = config
        self.base_linears = base_linears  # CompileConfig.base_compute's layers, rewritten in every graph
        self.recompile_limit = config.recompile_limit
        self.regions: list[str] = []
        self.region_kinds: dict[str, type] = {}  # region name -> its module's class
        # Classes whose compile raised or made no graph: their regions run eager. A class, not the
        # function: classes that share a forward (a checkpoint mixin's) have graphs of their own.
        self.failed_kinds: dict[type, str] = {}
        # (module class, grad mode) pairs dynamo has compiled a graph for. The first call in a new
        # pair is checked for compiling none; dynamo guards both, so that call must compile one.
        self.compiled_contexts: set[tuple[type, bool]] = set()
        # Per class, the input shapes base_compute's accuracy check has run for: a class's calls of
        # other sizes can run other graphs, with other Linears in 8 bits (Lumina 2's text refiners,
        # of its main blocks' class, have too few rows for any). At most ACCURACY_CHECKS_PER_CLASS.
        self.accuracy_checked: dict[type, set[tuple]] = {}
        self.shared_inputs = SharedInputs()  # each class's conditioning inputs (compile_accel.region_inputs)
        self._warned_checkpoint = False
        self.precompiled = Precompiled(self.fn)
        # The function each call signature compiles: `fn` for the first, a copy for each other.
        self._functions: dict[CallSignature, Callable] = {}
        # Per budget: its backend and its torch.compile of each signature's function.
        self._by_budget: dict[
            tuple[float | None, SavedBytesEstimate | None], tuple[RegionBackend, dict[CallSignature, Callable]]
        ] = {}
        budget = config.activation_memory_budget
        self.use_budget(None if budget == "auto" else budget, stats)
        code = getattr(self.fn, "__code__", None)
        if code is not None:
            RECOMPILE_LIMIT_WATCHER.listen(self, code, self._on_recompile_limit)

    def use_budget(
        self, budget: float | None, stats: Stats, estimate: SavedBytesEstimate | None = None, adopt: bool = False
    ) -> None:
        """Compile with `budget` from now on, counting into `stats` (with `estimate`: traced for it,
        without inductor). Each budget keeps its own backend and torch.compile wrapper: the
        backend is part of dynamo's guards, so going back to a budget reuses the graphs compiled
        for it. `adopt`: a budget set right after auto's traced step (with compile workers) takes
        that step's backend and wrapper over (RegionBackend.adopt): its graphs are not traced again."""
        key = (budget, estimate)
        if adopt and key not in self._by_budget and self.backend.adopt(budget, stats):
            # auto's traced graphs, handed to the compile workers at the budget it picked
            traced = next(k for k, (backend, _) in self._by_budget.items() if backend is self.backend)
            self._by_budget[key] = self._by_budget.pop(traced)
            self.precompiled.relabel(TRACED, budget)
        if key not in self._by_budget:
            self._by_budget[key] = (RegionBackend(self.config, budget, stats, estimate, self.base_linears), {})
        self.backend, self._compiled = self._by_budget[key]
        self.backend.stats = self.stats = stats

    def _compiled_for(self, args: tuple, kwargs: dict) -> Callable:
        """The torch.compile, at the budget in use, of the function for this call's signature."""
        signature = (len(args), tuple(kwargs))
        if signature not in self._compiled:
            if signature not in self._functions:
                self._functions[signature] = with_own_code(self.fn) if self._functions else self.fn
            options: dict[str, Any] = {
                "backend": self.backend,
                "fullgraph": self.config.fullgraph,
                "dynamic": self.config.compile_dynamic,
            }
            if COMPILE_TAKES_RECOMPILE_LIMIT:
                options["recompile_limit"] = self.recompile_limit
            self._compiled[signature] = torch.compile(self._functions[signature], **options)
        return self._compiled[signature]

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def fail(self, reason: str, kind: type) -> None:
        """Every region of this function and class `kind` runs eager from now on (with its
        checkpoint traced: the body compiled alone, under the eager checkpoint); one warning says so."""
        self.failed_kinds[kind] = reason
        if self.traces_checkpoint:
            warn(
                f"{self.name} (class {kind.__name__}) could not be compiled with its checkpoint traced: {reason}. "
                "The body is compiled alone and the checkpoint runs eager (the backward runs the whole body again)"
            )
            return
        regions = [r for r in self.regions if self.region_kinds[r] is kind]
        self.stats.fallbacks.extend((region, reason) for region in regions)
        warn(
            f"{self.name} (regions {', '.join(regions[:3])}{', ...' if len(regions) > 3 else ''}) "
            f"could not be compiled and runs eager: {reason}"
        )

    def note_still_checkpointed(self, regions: list[str], why: str) -> None:
        """A budgeted region still runs under a checkpoint compile_accel could not switch off."""
        new = [r for r in regions if r not in self.stats.still_checkpointed]
        self.stats.still_checkpointed.extend(new)
        if new and not self._warned_checkpoint:
            self._warned_checkpoint = True
            warn(
                f"{', '.join(new[:3])}{', ...' if len(new) > 3 else ''} have an activation memory budget but are "
                f"still checkpointed ({why}) and compile_accel found no switch to turn that off; the checkpoint "
                "overrides the budget there (full list in stats()['still_checkpointed'])"
            )

    def run(self, region: Region, args: tuple, kwargs: dict) -> Any:
        """Call the compiled function for `region` (compiling on a new input signature) and
        account for it: compile time and graph breaks in the stats, a compile error or a call
        that compiled no graph makes the region's class fall back to eager (this call included)."""
        ensure_thread_settings(self.recompile_limit)
        module = region.module
        training = module.training and torch.is_grad_enabled()
        shared = frozenset()
        if training:
            if self.shared_inputs.repeats_eager_call(module):
                return self._run_eager(region, args, kwargs)
            # (by the class at apply(): FSDP2 gives a module a class of its own later)
            kind = self.region_kinds[region.name]
            instances = lambda: sum(other is kind for other in self.region_kinds.values())  # noqa: E731
            shared = self.shared_inputs.slots(module, instances, args, kwargs)
            if shared is None:
                self.backend.count_eager_call()
                return self._run_eager(region, args, kwargs)
        args, kwargs, aliased_views = canonical_inputs(args, kwargs, training, shared)
        budget = self.precompile_budget()
        loaded = None if budget is False else self.precompiled.find(region.owner, args, kwargs, budget)
        if loaded is not None:  # compiled at an earlier start (compile_accel.precompile)
            out = loaded(*args, **kwargs) if region.owner is None else loaded(region.owner, *args, **kwargs)
            check_aliased_views(region.name, aliased_views)
            self.compiled_contexts.add((type(module), torch.is_grad_enabled()))
            return out
        stats = self.stats
        graphs, breaks, start = stats.graphs, graph_break_total(), time.perf_counter()
        context = (type(module), torch.is_grad_enabled())
        new_context = context not in self.compiled_contexts
        break_reasons = dict(torch._dynamo.utils.counters["graph_break"]) if new_context else None
        if new_context:  # the first compile of a block class takes seconds to minutes: say so
            logger.info("compiling %s (%s) ...", context[0].__name__, "training" if context[1] else "no grad")
        compiled = self._compiled_for(args, kwargs)
        try:
            out = compiled(*args, **kwargs) if region.owner is None else compiled(region.owner, *args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # fullgraph=True turns the limit into an error; the watcher has warned and counted.
            return self.eager(region, args, kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            # A call that is wrong in itself (a bad input shape) raises eager too, with the real
            # error, and compiling stays on. The compile includes the backward graph's
            # (compile_accel.backend): this eager call gives the step eager's gradients.
            out = self.eager(region, args, kwargs)
            self.fail(failure_reason(error), type(module))
            return out
        check_aliased_views(region.name, aliased_views)
        new_breaks, elapsed = graph_break_total() - breaks, time.perf_counter() - start
        if stats.graphs != graphs or new_breaks:
            stats.compile_seconds += elapsed
            stats.graph_breaks += new_breaks
        if stats.graphs != graphs:
            # Every graph, not only a class's first: a U-Net compiles a graph per layer shape,
            # minutes of first step that would otherwise pass without a line.
            logger.info(
                "compiled %s (%s%s) in %.1f s (graphs compiled so far: %d)",
                context[0].__name__,
                "training" if context[1] else "no grad",
                "" if new_context else ", new input shapes",
                elapsed,
                stats.graphs,
            )
            self.compiled_contexts.add(context)
            if budget is not False or self.backend.traced is not None:  # (traced: for `adopt`)
                self.precompiled.note(region.owner, args, kwargs, TRACED if budget is False else budget)
            if self.backend.saw_checkpoint:
                self.backend.saw_checkpoint = False
                self.note_still_checkpointed(self.regions, "their forward calls torch.utils.checkpoint")
        elif break_reasons is not None and not torch.compiler.is_compiling():
            # Dynamo ran the whole forward eager: typically a graph break inside a checkpoint,
            # which makes dynamo run the entire checkpointed call eager.
            self.fail(no_graph_reason(break_reasons, advice=not self.traces_checkpoint), type(module))
        return out

    def eager(self, region: Region, args: tuple, kwargs: dict) -> Any:
        """The call uncompiled: the region's method (with its checkpoint, where traced)."""
        if self.traces_checkpoint:
            return checkpoint(region.eager, *args, use_reentrant=False, **kwargs)
        return region.eager(*args, **kwargs)

    def _run_eager(self, region: Region, args: tuple, kwargs: dict) -> Any:
        """The first training call of a class of several blocks, which `shared_inputs` compares
        the next block's call with (and a trainer's checkpoint's recompute of it): eager, under a
        checkpoint where none is around it (a budget replaced the model's), so that it keeps no
        more than a compiled call would."""
        if under_saved_tensor_checkpoint():
            return region.eager(*args, **kwargs)
        # Flagged as the compiled call it stands for: an activation offloader moves what this
        # checkpoint keeps (the inputs), as it moves what that call saves.
        return flagged(checkpoint)(region.eager, *args, use_reentrant=False, **kwargs)

    def check_accuracy(self, region: Region, args: tuple, kwargs: dict) -> None:
        """base_compute's accuracy check (compile_accel.base_compute_probe) at the first training
        call of `region`'s class with inputs of these shapes that runs compiled: after auto's
        traced step, not inside another compile."""
        kind = type(region.module)
        if (
            self.shared_inputs.ran_eager(region.module)  # (this call: not compiled)
            or kind in self.failed_kinds
            or not (region.module.training and torch.is_grad_enabled())
            or self.backend.estimating
            or torch.compiler.is_compiling()
        ):
            return
        checked = self.accuracy_checked.setdefault(kind, set())
        if len(checked) >= ACCURACY_CHECKS_PER_CLASS:
            return
        shapes = tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        if shapes in checked:
            return
        checked.add(shapes)
        compiled = lambda *a, **k: self.run(region, a, k)  # noqa: E731
        result = compare_compute(self.base_linears.compute, kind.__qualname__, compiled, region.eager, args, kwargs)
        self.base_linears.add_accuracy(kind.__qualname__, result)

    def precompile_budget(self) -> float | None | bool:
        """The budget graphs compiled now are precompiled for (compile_accel.precompile); False
        while none are: auto's traced estimate, CUDA graphs (recorded per process)."""
        if self.backend.estimating or self.config.compile_mode in CUDA_GRAPH_MODES:
            return False
        return self.backend.budget

    def precompile_for(self, budget: float | None) -> Callable:
        """torch.compile of the function as `aot_compile` needs it, at `budget`."""
        backend = RegionBackend(self.config, budget, Stats(), base_linears=self.base_linears)
        dynamic = self.config.compile_dynamic
        return torch.compile(
            self.fn,
            backend=backend.for_precompile,
            fullgraph=True,
            dynamic=dynamic,
            options={"guard_filter_fn": saved_guards},
        )

    def _on_recompile_limit(self, reason: str) -> None:
        self.stats.recompile_limit_hits += 1
        warn(
            f"{self.name} hit recompile_limit={self.recompile_limit}; dynamo runs the inputs that missed "
            f"every graph eager (last reason: {reason}). Raise CompileConfig.recompile_limit, or set "
            "dynamic=True if the inputs change shape (aspect-ratio buckets)"
        )


def with_own_code(fn: Callable) -> Callable:
    """A copy of the Python function `fn` whose code object is its own (dynamo's graphs and
    guards are kept per code object); anything else as it is."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    copy.__dict__.update(fn.__dict__)
    return copy


def restore_forward(module: nn.Module, original: Callable, method: str = "forward") -> None:
    """Undo an instance-level replacement of `module.<method>`, keeping any the user had before."""
    if (
        inspect.ismethod(original)
        and original.__self__ is module
        and original.__func__ is getattr(type(module), method, None)
    ):
        module.__dict__.pop(method, None)
    else:
        setattr(module, method, original)


# Block inputs are looked at on the top level only (tensors passed directly or by keyword):
# these helpers run on every call.


def _top_level_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]


def _under_outer_checkpoint() -> bool | None:
    """Whether this call runs inside torch.utils.checkpoint; None when a call cannot tell: a
    forward with grad off is a reentrant checkpoint's first pass or plain validation, so the
    answer waits for a call with grad on (non-reentrant: checkpoint's saved-tensor hooks are
    active; reentrant: its recompute runs the forward inside backward)."""
    if not torch.is_grad_enabled():
        return None
    return under_saved_tensor_checkpoint() or torch._C._current_graph_task_id() != -1


_module_tree_changes = [0]  # registrations of a child, parameter or buffer in any module


def _count_module_tree_change(module: nn.Module, name: str, value: Any) -> None:
    _module_tree_changes[0] += 1


@functools.cache
def _watch_module_trees() -> None:
    """Installed once per process: torch's global registration hooks count tree changes."""
    from torch.nn.modules import module as module_hooks

    module_hooks.register_module_module_registration_hook(_count_module_tree_change)
    module_hooks.register_module_parameter_registration_hook(_count_module_tree_change)
    module_hooks.register_module_buffer_registration_hook(_count_module_tree_change)


class CopiedRegion:
    """What a Region becomes when pickled or deep-copied: calling it says so."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"compile_accel: {self.name} belongs to a copy of an accelerated model, whose compiled regions stay "
            "with the original; call remove() on the Acceleration before copying, then apply() to each model"
        )


class Region:
    """One module whose forward (or checkpointed body method) is dispatched to a shared
    CompiledFunction."""

    def __init__(
        self,
        spec: RegionSpec,
        shared: CompiledFunction,
        config: CompileConfig,
        under_checkpoint: CompiledFunction | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.label
        self.module = spec.module
        self.method = spec.method
        self.shared = shared
        # A body region's method compiled with its checkpoint traced, for the calls torch's
        # checkpoint makes (compile_accel.checkpointing).
        self.under_checkpoint = under_checkpoint
        self.eager = getattr(spec.module, spec.method)
        self.owner = _split_method(self.eager)[1]
        self.check_outer_checkpoint = config.activation_memory_budget is not None
        self.calls = 0
        self.installed = False
        self._tensor_dicts: list[dict[str, torch.Tensor | None]] = []
        self._tensor_dicts_generation = -1
        _watch_module_trees()
        self.__wrapped__ = self.eager  # inspect.signature(module.forward) still shows the real one
        for function in (shared, under_checkpoint):
            if function is not None:
                function.regions.append(self.name)
                function.region_kinds[self.name] = type(self.module)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        # A region is this process's compile state (shared compiled functions, their backends,
        # stats). Dynamo's saved guards of a precompiled graph pickle the module it traced, this
        # attribute included; there, and in any copy of the model, it becomes a stand-in.
        return CopiedRegion, (self.name,)

    def install(self) -> None:
        setattr(self.module, self.method, self)
        self.installed = True

    def uninstall(self) -> None:
        """Put the module's method back; nothing for a region never installed (an apply() that
        raised before it got there)."""
        if not self.installed:
            return
        if self.module.__dict__.get(self.method) is not self:
            warn(f"{self.spec.name}.{self.method} was replaced after apply(); leaving the replacement in place")
            return
        restore_forward(self.module, self.eager, self.method)
        self.installed = False

    def _resident(self, inputs: list[torch.Tensor]) -> bool:
        if not inputs:
            return True
        device = inputs[0].device
        # The tensors are read on every call: FSDP2 and offloaders replace parameters. The dicts
        # that hold them are gathered again only after a module somewhere registered a child,
        # parameter or buffer (LoRA injected after the first call): walking the module tree on
        # every call costs more host time than an offloaded block's GPU time
        # (benchmarks/results/h200_flux_offload/README.md).
        if self._tensor_dicts_generation != _module_tree_changes[0]:
            self._tensor_dicts = [d for m in self.module.modules() for d in (m._parameters, m._buffers)]
            self._tensor_dicts_generation = _module_tree_changes[0]
        # (an Int8Weight's device is fixed: its values are where the conductor has its block)
        return all(
            t is None or (t.device == device and (type(t) is not Int8Weight or t.q.device == device))
            for d in self._tensor_dicts
            for t in d.values()
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        shared = self.shared
        if type(self.module) in shared.failed_kinds:
            return self.eager(*args, **kwargs)
        if not self._resident(_top_level_tensors(args, kwargs)):
            shared.stats.eager_nonresident_calls += 1
            return self.eager(*args, **kwargs)
        if self.check_outer_checkpoint:
            under = _under_outer_checkpoint()
            self.check_outer_checkpoint = under is None
            if under:
                shared.note_still_checkpointed([self.name], "called inside torch.utils.checkpoint")
        traced = self.under_checkpoint
        if (
            traced is not None
            and type(self.module) not in traced.failed_kinds
            and called_by_torch_checkpoint(sys._getframe(1))
        ):
            shared = traced
            with past_the_checkpoint():
                out = traced.run(self, args, kwargs)
        else:
            out = shared.run(self, args, kwargs)
        if shared.base_linears is not None:
            shared.check_accuracy(self, args, kwargs)  # (of the function that ran the call)
        return out
