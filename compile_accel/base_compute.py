"""CompileConfig.base_compute="int8": the matmuls of frozen base weights inside compiled regions in int8.

A LoRA step needs two products of a frozen Linear's weight W (out x in): the forward Y = X·Wᵀ and
the input gradient dX = dY·W; the weight's own gradient is never computed. Both run as int8 x int8
products with int32 accumulation and symmetric scales that factor out of the sum:

- forward: X per row (token); W per output channel (its rows);
- backward: dY per row; W per input channel (the rows of Wᵀ).

The weight is quantized at each call, in the same graph: a kept copy per orientation would add
one byte per base weight element twice over (5 GiB for Lumina 2, which then no longer fits 24 GiB
at budget 0.5), and quantizing reads the weight once, little beside the product's work. A graph is
shared by every block of its class, so it reads whichever weights it is given (a swapped block's
too).

Where: RegionBackend rewrites each `linear` call in dynamo's graph of a region whose weight is a
frozen nn.Linear of that region (`rewrite_base_linears`): a plain Linear, the base a kohya-style
LoRA calls through its saved `org_forward`, peft's `base_layer`, all of which reach F.linear with
that weight. The call becomes `int8_linear` before AOTAutograd, so every compile path (in this
process, compile workers, precompile, auto's traced step) gets the same graph, and the LoRA path,
trainable, stays in its dtype. In it the activations (forward), the output gradients (backward)
and the weight are quantized with torch ops the compiler fuses into the kernels around them; the
products run in `compile_accel::scaled_int8_mm`, one kernel with the scales applied
(compile_accel.int8_matmul). A call whose layer cannot run in int8 stays as it was, and the
reason is recorded (`BaseLinears.summary`, in `stats()["base_compute"]`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from . import int8, int8_matmul
from .int8 import quantize_int8
from .int8_matmul import scaled_int8_mm
from .selective import RegionSpec, is_excluded

INT8 = "int8"
NOT_TRACED = "not in a compiled graph yet (no compiled call has reached it)"
# int8 matmuls on CUDA (torch._int_mm; the Triton kernel's 16-byte loads): sizes multiples of 8.
CUDA_INT_MM_MULTIPLE = 8
# On CUDA a call with fewer input rows (tokens x batch) stays in its dtype. The weight is quantized
# twice per step (about 10 bytes moved per element), while int8 saves per weight element the time
# of 4 x rows multiply-adds at the bf16 rate less the int8 rate: at 24 SMs of an H200 (163 TFLOP/s
# bf16, twice that in int8, 1.2-1.7 TB/s) that pays from ~700 rows. A DiT's modulation Linears
# (rows = batch, a third of SD3's base weights) and the text projections of cross-attention stay.
CUDA_MIN_ROWS = 1024


# The oldest GPUs with the tensor-core matmuls: int8 from Ampere (sm80), fp8 from Ada (sm89).
MIN_CUDA_CAPABILITY = {"int8": (8, 0), "fp8": (8, 9)}


def base_compute_refusal(compute: str | None, devices: set[torch.device]) -> str | None:
    """Why `compute` cannot run on the base weights' `devices` ("base_compute=... needs ..."), or
    None; apply() refuses with it before changing anything."""
    if compute is None:
        return None
    minimum = MIN_CUDA_CAPABILITY[compute]
    needs = f"base_compute={compute!r} needs a CUDA GPU of compute capability {minimum[0]}.{minimum[1]} or newer"
    for device in devices:
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < minimum:
                return f"{needs}; {device} is {capability[0]}.{capability[1]}"
        elif device.type != "cpu":
            return f"base_compute={compute!r} runs on CPUs and CUDA GPUs, not on {device}"
        elif compute == "fp8":
            return f"{needs}; on the CPU use 'int8'"
    if compute == "fp8":
        return "base_compute='fp8' is not implemented yet; use 'int8'"
    return None


def _quantized_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` as rows of their last dimension, quantized per row."""
    return quantize_int8(values.reshape(-1, values.shape[-1]))


class _Int8Linear(torch.autograd.Function):
    """F.linear(x, weight, bias) of a frozen weight, with both of its matmuls in int8; the
    gradient goes to x alone (rewrite_base_linears rewrites no call whose weight or bias trains).
    Everything but the products is torch ops, which the compiler fuses into the kernels around."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype):
        ctx.save_for_backward(weight)
        ctx.in_dtype = x.dtype
        out = scaled_int8_mm(*_quantized_rows(x), *quantize_int8(weight), bias, out_dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        # dX = dY·W: W quantized per input channel, so that its scales factor out of the sum.
        weight_by_input = quantize_int8(weight.t().contiguous())
        grad_x = scaled_int8_mm(*_quantized_rows(grad), *weight_by_input, None, ctx.in_dtype)
        return grad_x.reshape(*grad.shape[:-1], weight.shape[1]), None, None, None


def _implementation_hash() -> str:
    """A hash of the code int8_linear runs (or of compile_accel's version, where no source is
    installed)."""
    try:
        source = "".join(inspect.getsource(module) for module in (sys.modules[__name__], int8, int8_matmul))
    except (OSError, TypeError):
        source = importlib.metadata.version("compile_accel")
    return hashlib.sha256(source.encode()).hexdigest()[:16]


# int8_linear is an operator (a graph's call target must pickle for compile workers) made of the
# ops _Int8Linear runs: composite, so the compiler traces through it and autograd takes
# _Int8Linear's backward. AOTAutograd's cache keys on dynamo's graph, where the operator is only a
# name: its overload is named after the code, so that no entry compiled from other code is taken.
_OVERLOAD = f"v{_implementation_hash()}"
_library = torch.library.Library("compile_accel", "FRAGMENT")
_library.define(f"int8_linear.{_OVERLOAD}(Tensor x, Tensor weight, Tensor? bias, ScalarType out_dtype) -> Tensor")


def _int8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    return _Int8Linear.apply(x, weight, bias, out_dtype)


_library.impl(f"int8_linear.{_OVERLOAD}", _int8_linear, "CompositeImplicitAutograd")
# F.linear(x, weight, bias) in int8, in `out_dtype` (what the call gave under autocast): the call
# rewrite_base_linears puts in place of a base Linear's.
int8_linear = getattr(torch.ops.compile_accel.int8_linear, _OVERLOAD)


@dataclass
class BaseLinears:
    """The frozen nn.Linear layers of the compiled regions, and for each whether its matmuls run in
    8 bits or why not. A graph is traced for one region and run by every region of its class with
    the same shapes, dtypes and requires_grad, so an outcome is kept per layer key (`_layer_key`):
    the region's class, the layer's path in it, and what of the layer decides the outcome."""

    compute: str
    layers: dict[str, tuple[type, str, nn.Linear]] = field(default_factory=dict)  # name -> (class, path, layer)
    roles: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # weight -> (class, path)
    outcomes: dict[tuple, str] = field(default_factory=dict)  # layer key -> INT8 or why not
    # region class name -> compile_accel.base_compute_probe.compare_compute's result
    accuracy: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def find(cls, compute: str, specs: list[RegionSpec], exclude: list[str]) -> BaseLinears:
        """The frozen Linears inside the regions `specs`, less the excluded submodules (eager)."""
        found = cls(compute)
        for spec in specs:
            for path, module in spec.module.named_modules():
                name = f"{spec.name}.{path}" if path else spec.name
                if isinstance(module, nn.Linear) and not module.weight.requires_grad and not is_excluded(name, exclude):
                    found.layers[name] = (type(spec.module), path, module)
                    found.roles[module.weight] = (type(spec.module), path)
        return found

    def record(self, weight: torch.Tensor, bias: torch.Tensor | None, outcome: str) -> None:
        key = _layer_key(*self.roles[weight], weight, bias)
        if self.outcomes.get(key, INT8) == INT8:  # a reason it stayed, in any graph, is kept
            self.outcomes[key] = outcome

    def summary(self) -> dict[str, Any]:
        """`compute`, `base_linears` (how many), `in_8_bits` (how many run in 8 bits in every compiled
        graph that reached them), `stayed` (layer name -> why it runs in its own dtype) and
        `accuracy` (region class -> its first training call's comparison with its own dtype)."""
        stayed = {}
        for name, (kind, path, layer) in self.layers.items():
            outcome = self.outcomes.get(_layer_key(kind, path, layer.weight, layer.bias), NOT_TRACED)
            if outcome != INT8:
                stayed[name] = outcome
        return {
            "compute": self.compute,
            "base_linears": len(self.layers),
            "in_8_bits": len(self.layers) - len(stayed),
            "stayed": stayed,
            "accuracy": dict(self.accuracy),
        }


def _layer_key(kind: type, path: str, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What an outcome is kept under: the layer's role and what `_why_not_int8` reads of it."""
    bias_trains = bias is not None and bias.requires_grad
    return kind, path, tuple(weight.shape), weight.dtype, weight.device, bias_trains


def _why_not_int8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    if bias is not None and bias.requires_grad:
        return "its bias is trainable"
    if not (x.is_floating_point() and weight.is_floating_point()):
        return f"input {x.dtype}, weight {weight.dtype}: int8 quantizes floating-point values"
    if weight.device.type != "cuda":
        return None
    if any(size % CUDA_INT_MM_MULTIPLE for size in weight.shape):
        return (
            f"weight {tuple(weight.shape)}: torch._int_mm on CUDA needs both sizes multiples of {CUDA_INT_MM_MULTIPLE}"
        )
    rows = _size_hint(x.numel()) // _size_hint(x.shape[-1]) if x.shape[-1] else 0
    if rows < CUDA_MIN_ROWS:
        return f"input rows {rows}: on CUDA int8 gains from {CUDA_MIN_ROWS} rows (the weight's quantization costs more)"
    return None


def _size_hint(size: int | torch.SymInt) -> int:
    """A size as a number: a symbolic one (dynamic shapes) by the value it was traced with, which
    decides without a guard (rows differ by orders of magnitude between the two kinds of call)."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def _linear_arguments(node: torch.fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of an F.linear call, given by position or keyword."""
    args = (*node.args, *(node.kwargs[k] for k in ("input", "weight", "bias")[len(node.args) :] if k in node.kwargs))
    return args[0], args[1], args[2] if len(args) > 2 else None


def rewrite_base_linears(gm: torch.fx.GraphModule, example_inputs: list[Any], base_linears: BaseLinears) -> None:
    """Turn each F.linear call of dynamo's graph `gm` (and of the graphs nested in it, a checkpoint's
    body) whose weight is one of `base_linears` into int8_linear, or record why it stays.
    `example_inputs` are the real tensors dynamo calls `gm` with."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    _rewrite(gm, dict(zip(placeholders, example_inputs)), base_linears)


def _rewrite(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], base_linears: BaseLinears) -> None:
    """rewrite_base_linears on one graph; `values`: the real tensor of each placeholder known."""
    rewritten = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch._C._nn.linear:
            rewritten |= _rewrite_linear(gm, node, values, base_linears)
            continue
        # A higher-order op (a checkpoint) calls a nested graph on the operands after it.
        for index, arg in enumerate(node.args):
            body = getattr(gm, arg.target, None) if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" else None
            if isinstance(body, torch.fx.GraphModule):
                inner = [n for n in body.graph.nodes if n.op == "placeholder"]
                known = {p: values[o] for p, o in zip(inner, node.args[index + 1 :]) if o in values}
                _rewrite(body, known, base_linears)
    if rewritten:
        gm.recompile()


def _value(arg: Any, values: dict[torch.fx.Node, Any]) -> Any:
    """A call's argument as a tensor: the real one of a known placeholder, else the traced (fake) value."""
    if not isinstance(arg, torch.fx.Node):
        return arg
    return values[arg] if arg in values else arg.meta.get("example_value")


def _rewrite_linear(
    gm: torch.fx.GraphModule, node: torch.fx.Node, values: dict[torch.fx.Node, Any], base_linears: BaseLinears
) -> bool:
    """Replace one F.linear call by int8_linear if its weight is a base weight that can run in int8;
    whether it did. A base weight that cannot is recorded with the reason."""
    x, weight, bias = (_value(arg, values) for arg in _linear_arguments(node))
    if (
        not isinstance(weight, nn.Parameter)
        or weight not in base_linears.roles
        or weight.requires_grad
        or not isinstance(x, torch.Tensor)  # (an input without a traced value: left as it is)
    ):
        return False
    why = _why_not_int8(x, weight, bias)
    base_linears.record(weight, bias, why or INT8)
    if why is not None:
        return False
    x_node, weight_node, bias_node = _linear_arguments(node)
    with gm.graph.inserting_before(node):
        replacement = gm.graph.call_function(
            int8_linear,
            (x_node, weight_node, bias_node, node.meta["example_value"].dtype),
        )
    replacement.meta = dict(node.meta)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    return True
