"""Which modules become compiled regions, and which of their methods is compiled.

mode "blocks": every block's forward.

mode "selective": what runs inside each block's gradient checkpoint, in the largest pieces
that hold no checkpoint call themselves (torch's own checkpoint traced in where it can be):
- a block whose forward checkpoints a method of its own (kohya sd-scripts:
  `checkpoint(self._forward, ...)`, `checkpoint(create_custom_forward(self.forward_body), ...)`,
  Anima's `torch_checkpoint(...)` and `unsloth_checkpoint(...)`: any callee named `checkpoint` or
  `..._checkpoint`; the method may be bound to a local name first, `forward_fn = self._forward`)
  gets that method compiled: the block's whole body is one graph. Where torch's non-reentrant
  checkpoint calls it, that checkpoint is traced into the graph (compile_accel.checkpointing).
  A block that checkpoints only reentrantly (sd-scripts' U-Nets: `use_reentrant=USE_REENTRANT`,
  True) gets its forward compiled instead, checkpoint and all, as per-block compile does: a
  reentrant checkpoint runs its body without grad inside an autograd Function and again in the
  backward, so the backward recomputes the whole body, where a traced checkpoint lets the
  partitioner recompute what the backward needs. Traced, it gives the block's parameters their
  gradients even where no input requires grad, as a non-reentrant checkpoint does (eager's
  reentrant one gives none there; sd-scripts marks the U-Net's inputs as requiring grad under
  checkpointing). With CUDA graphs (`reduce-overhead`) the body stays the region: its forward
  without grad is the graph that replays.
- any other block gets its compute children compiled, found by the same rules: containers are
  looked into, and so is a child that the block never calls but uses through its children
  (sd-scripts' Flux double block calls `self.img_attn.qkv(...)`, never `self.img_attn(...)`).
  Lone built-in layers (a Linear, a norm, an activation with torch's own forward) stay eager:
  their graph would be the one kernel eager runs, plus a dispatch on every call.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .blocks import BlockList

# Children with no compute worth a graph.
_TRIVIAL = (nn.Identity, nn.Dropout)


@dataclass(frozen=True)
class RegionSpec:
    """A module whose `method` (forward, or the body its checkpoint runs) becomes a region."""

    name: str  # the module's name in model.named_modules()
    module: nn.Module
    method: str = "forward"

    @property
    def label(self) -> str:
        """How stats and warnings name the region."""
        return self.name if self.method == "forward" else f"{self.name}.{self.method}"


def is_excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def _is_lone_builtin_layer(module: nn.Module) -> bool:
    """A torch.nn layer without children, running torch's own forward (not one a LoRA patched)."""
    return (
        type(module).__module__.startswith("torch.nn.")
        and next(module.children(), None) is None
        and "forward" not in vars(module)
    )


def _class_functions(cls: type) -> list:
    """The functions a module class defines itself or inherits from classes below nn.Module."""
    functions = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        functions.extend(f for f in vars(klass).values() if inspect.isfunction(f))
    return functions


def _parsed(function: object) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def _self_attribute(node: ast.AST) -> str | None:
    """'x' for the expression `self.x`."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _is_checkpoint_call(node: ast.AST) -> bool:
    """A call of something named `checkpoint` or `..._checkpoint` with at least one argument."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    return callee == "checkpoint" or str(callee).endswith("_checkpoint")


def _named_value(node: ast.AST, namespace: dict) -> object:
    """What a constant, a name or a dotted name (`torch.utils.checkpoint.checkpoint`) is in a
    function's globals; None for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return namespace.get(node.id, getattr(builtins, node.id, None))
    if isinstance(node, ast.Attribute):
        return getattr(_named_value(node.value, namespace), node.attr, None)
    return None


@functools.cache
def checkpoints_reentrantly(cls: type) -> bool:
    """Whether every checkpoint call in `cls.forward` is torch.utils.checkpoint.checkpoint with
    `use_reentrant` true (a constant, or a global of the module that is: sd-scripts' U-Nets)."""
    tree = _parsed(cls.forward)
    namespace = getattr(cls.forward, "__globals__", {})
    calls = [node for node in ast.walk(tree) if _is_checkpoint_call(node)] if tree is not None else []
    return bool(calls) and all(
        inspect.unwrap(_named_value(call.func, namespace)) is inspect.unwrap(checkpoint)
        and any(k.arg == "use_reentrant" and _named_value(k.value, namespace) is True for k in call.keywords)
        for call in calls
    )


@functools.cache
def checkpoint_body(cls: type) -> str | None:
    """The method of `cls` that its forward hands to a `checkpoint(...)` (or `..._checkpoint(...)`)
    call, directly or through a wrapper call (`checkpoint(create_custom_forward(self.forward_body), ...)`)."""
    tree = _parsed(cls.forward)
    if tree is None:
        return None
    # Local names bound to a method first (HunyuanImage: `forward_fn = self._forward`, then
    # `checkpoint(forward_fn, ...)`).
    bound = {
        target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and _self_attribute(node.value) is not None
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if not _is_checkpoint_call(node):
            continue
        first = node.args[0]
        candidates = [first, *first.args] if isinstance(first, ast.Call) else [first]
        for candidate in candidates:
            name = _self_attribute(bound.get(getattr(candidate, "id", None), candidate))
            if name is not None and inspect.isfunction(getattr(cls, name, None)):
                return name
    return None


@functools.cache
def _attribute_uses(cls: type) -> dict[str, bool]:
    """For each `self.x` in the class's code: whether it is ever used other than by reaching
    into it (`self.x(...)`, `self.x` passed on), rather than only as `self.x.y`. None of it
    when the source cannot be read."""
    uses: dict[str, bool] = {}
    for function in _class_functions(cls):
        tree = _parsed(function)
        if tree is None:
            return {}
        reached_into = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            name = _self_attribute(node)
            if name is not None and isinstance(node.ctx, ast.Load):  # not `self.x = ...` in __init__
                uses[name] = uses.get(name, False) or id(node) not in reached_into
    return uses


def _only_reached_into(parent: nn.Module, child_name: str) -> bool:
    """The parent's code uses `child` only through the child's own attributes, so the child's
    forward never runs: its children are what to compile."""
    return _attribute_uses(type(parent)).get(child_name) is False


def compute_regions(name: str, block: nn.Module, cuda_graphs: bool = False) -> list[RegionSpec]:
    """The regions of one block in selective mode (see the module docstring)."""
    body = checkpoint_body(type(block))
    if body is not None:
        if checkpoints_reentrantly(type(block)) and not cuda_graphs:
            return [RegionSpec(name, block)]
        return [RegionSpec(name, block, body)]
    regions = []
    for child_name, child in block.named_children():
        qualified = f"{name}.{child_name}"
        if (
            isinstance(child, (nn.ModuleList, nn.ModuleDict))
            or type(child).forward is nn.Module.forward
            or _only_reached_into(block, child_name)
            or checkpoint_body(type(child)) is not None
        ):
            regions.extend(compute_regions(qualified, child, cuda_graphs))
        elif not isinstance(child, _TRIVIAL) and not _is_lone_builtin_layer(child):
            regions.append(RegionSpec(qualified, child))
    return regions


def region_specs(
    mode: str, block_lists: list[BlockList], exclude: list[str], cuda_graphs: bool = False
) -> list[RegionSpec]:
    """Every region for `mode` (`cuda_graphs`: compiled graphs replay as CUDA graphs), minus the
    excluded modules."""
    blocks = [nb for bl in block_lists for nb in bl.named_blocks()]
    if mode == "blocks":
        regions = [RegionSpec(name, block) for name, block in blocks]
    elif mode == "selective":
        regions = [region for name, block in blocks for region in compute_regions(name, block, cuda_graphs)]
    else:
        regions = []
    return [region for region in regions if not is_excluded(region.name, exclude)]
