"""CompileConfig.base_compute="int8" | "fp8": the matmuls of frozen base weights inside compiled
regions in 8 bits.

A LoRA step needs two products of a frozen Linear's weight W (out x in): the forward Y = X·Wᵀ and
the input gradient dX = dY·W; the weight's own gradient is never computed. Both run as 8-bit
products with symmetric scales that factor out of the sum:

- forward: X per row (token); W per output channel (its rows);
- backward: dY per row; W per input channel (the rows of Wᵀ).

On CUDA each of the two products runs in 8 bits only where it gains (`why_not_8_bits`): the
other stays in the weight's dtype, in the same call.

int8: int8 x int8 with int32 accumulation (compile_accel.int8_matmul). fp8: float8_e4m3fn x
float8_e4m3fn with fp32 accumulation in `torch._scaled_mm`, row-wise scales; a weight stored as
float8_e4m3fn (sd-scripts' `--fp8_base`) is multiplied as it is, with unit scales, never
dequantized to bf16 and quantized back.

A bf16 weight is quantized at each call, in the same graph: a kept copy per orientation would add
one byte per base weight element twice over (5 GiB for Lumina 2, which then no longer fits 24 GiB
at budget 0.5), and quantizing reads the weight once, little beside the product's work. A graph is
shared by every block of its class, so it reads whichever weights it is given (a swapped block's
too).

An int8 weight that the offload conductor streams (an Int8Weight, compile_accel.int8_weight) is
multiplied as it is: its per-row values and scales are what the forward would quantize it to, and
the backward folds its row scales into dY before quantizing dY per row.

Where: compile_accel.base_compute_rewrite turns the regions' base Linear calls into `int8_linear`
or `fp8_linear` in dynamo's graph. In them the activations (forward), the output gradients
(backward) and the weight are quantized with torch ops the compiler fuses into the kernels around
them; the int8 products run in `compile_accel::scaled_int8_mm`, one kernel with the scales applied
(compile_accel.int8_matmul), the fp8 ones in `torch._scaled_mm`. A call whose layer cannot run in
8 bits stays as it was, and the reason is recorded (`BaseLinears.summary`, in
`stats()["base_compute"]`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from . import int8, int8_matmul, int8_weight
from .int8 import quantize_int8
from .int8_matmul import scaled_int8_mm
from .int8_weight import Int8Weight
from .selective import RegionSpec, is_excluded

IN_8_BITS = "in 8 bits"  # the outcome of a layer whose matmuls run in 8 bits
NOT_TRACED = "not in a compiled graph yet (no compiled call has reached it)"
# 8-bit matmuls on CUDA need the weight's sizes multiples of these: int8 (torch._int_mm; the
# Triton kernel's 16-byte loads) 8, fp8 (torch._scaled_mm) 16.
CUDA_SIZE_MULTIPLE = {"int8": 8, "fp8": 16}
# On CUDA a call with fewer input rows (tokens x batch) stays in its dtype. A bf16 weight is quantized
# twice per step (about 10 bytes moved per element), while int8 saves per weight element the time
# of 4 x rows multiply-adds at the bf16 rate less the int8 rate: at 24 SMs of an H200 (163 TFLOP/s
# bf16, twice that in int8, 1.2-1.7 TB/s) that pays from ~700 rows. A DiT's modulation Linears
# (rows = batch, a third of SD3's base weights) and the text projections of cross-attention stay.
# The same holds for a weight stored as float8_e4m3fn (`--fp8_base`), which fp8 compute need not
# quantize: with no threshold for them, or one of 256 rows, Flux-dev's step at 24 SMs was 2-3% slower.
CUDA_MIN_ROWS = 1024
# On CUDA a product whose output is narrower stays in its dtype (the forward's output is
# out_features wide, the input gradient's in_features). Its operand (activations, output
# gradients) is quantized once, in the kernel that makes it, and each quantized element saves
# `width` multiply-adds at bf16's rate less 8 bits'. At 24 SMs of an H200, fp8 (sd-scripts' models as
# a 4090): SDXL b4's step with every product in 8 bits was 0.947x bf16's, its 1280-wide products'
# operands quantized in GEGLU's kernels; with this bar 1.011x. Lumina 2's 2304-wide ones gain as
# much as they cost (a bar of 2560: 1.045x, this one 1.044x); Flux-dev's, 3072 and wider, gain.
# int8 takes the same bar, measured for fp8 alone.
CUDA_MIN_WIDTH = 2048
PRODUCTS = ("forward", "input gradient")  # a frozen Linear's two matmuls in a LoRA step


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
    return None


# Compute capabilities whose GPUs multiply int8 at fp8's rate, not faster, so that int8's costlier
# quantization (rounding and clamping in fp32) makes it the slower of the two: Hopper. On an H200,
# capped at 24 GiB: fp8 1.125x and 1.055x bf16 on Flux-dev and Lumina 2, int8 0.996x and 0.929x
# (benchmarks/results/h200_full_8bit). Ada and Ampere cards multiply int8 at 2-4x fp8's or bf16's.
INT8_AT_FP8_RATE = {(9, 0)}


def base_compute_advice(compute: str | None, devices: set[torch.device]) -> str | None:
    """What to use instead of `compute` on the base weights' `devices` where another 8-bit format
    was measured faster, or None; apply() warns with it."""
    if compute != "int8":
        return None
    for device in devices:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) in INT8_AT_FP8_RATE:
            return (
                f"base_compute='int8' on {torch.cuda.get_device_name(device)}: this GPU multiplies int8 at fp8's "
                "rate and int8 quantizes at more cost; use base_compute='fp8' (on an H200 fp8 made Flux-dev's "
                "step 1.125x bf16's, int8 0.996x)"
            )
    return None


def _int8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` as rows of their last dimension, quantized per row to int8."""
    return quantize_int8(values.reshape(-1, values.shape[-1]))


FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8).max


def _fp8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` as rows of their last dimension in float8_e4m3fn, each scaled to the format's
    range: (values, fp32 scale per row as a column)."""
    rows = values.reshape(-1, values.shape[-1]).float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / _FP8_MAX
    return (rows / scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8), scale


def _fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight`'s rows in float8_e4m3fn with their scales as a row (1 x rows): a weight stored in
    that format as it is, with unit scales."""
    if weight.dtype == FP8:
        return weight, torch.ones((1, weight.shape[0]), dtype=torch.float32, device=weight.device)
    values, scale = _fp8_rows(weight)
    return values, scale.t()


def _scaled_fp8_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(a · bᵀ) * a_scale * b_scale (+ bias) in out_dtype: a (m x k) and b (n x k) row-major
    float8_e4m3fn, a_scale (m x 1), b_scale (1 x n). Computed in bf16, the one output type of
    torch._scaled_mm's row-wise scaling."""
    bias = None if bias is None else bias.to(torch.bfloat16)
    out = torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale, bias=bias, out_dtype=torch.bfloat16)
    return out.to(out_dtype)


@dataclass(frozen=True)
class _Format:
    """How one 8-bit format quantizes and multiplies: rows (activations, output gradients) and a
    weight's rows to (values, scales), and the product (a, a_scale, b, b_scale, bias, out_dtype)."""

    rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    weight: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    product: Callable[..., torch.Tensor]


FORMATS = {
    "int8": _Format(_int8_rows, quantize_int8, scaled_int8_mm),  # int32 sums, scales applied in the kernel
    "fp8": _Format(_fp8_rows, _fp8_weight, _scaled_fp8_mm),  # e4m3, the output gradient too
}


def _linear_function(compute: str) -> type[torch.autograd.Function]:
    """F.linear(x, weight, bias) of a frozen weight, its forward and its input gradient each as an
    8-bit matmul in the format `compute` or, where the call says not, in `out_dtype` as F.linear
    under autocast computes it; the gradient goes to x alone (rewrite_base_linears rewrites no call
    whose weight or bias trains). Everything but the products is torch ops, which the compiler fuses
    into the kernels around."""
    form = FORMATS[compute]

    class Linear8Bit(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any,
            x: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None,
            out_dtype: torch.dtype,
            forward_in_8_bits: bool,
            input_gradient_in_8_bits: bool,
        ) -> torch.Tensor:
            # An int8 weight streamed by the offload conductor (compile_accel/int8_weight.py) holds
            # what quantize_int8 makes of the weight: its values are multiplied as they are.
            held = compute == "int8" and isinstance(weight, Int8Weight)
            ctx.save_for_backward(*((weight.q, weight.scale) if held else (weight,)))
            ctx.in_dtype, ctx.in_8_bits = x.dtype, input_gradient_in_8_bits
            if not forward_in_8_bits:
                bias = None if bias is None else bias.to(out_dtype)
                return F.linear(x.to(out_dtype), weight.to(out_dtype), bias)
            quantized = (weight.q, weight.scale) if held else form.weight(weight)
            out = form.product(*form.rows(x), *quantized, bias, out_dtype)
            return out.reshape(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            saved, none = ctx.saved_tensors, (None,) * 5
            if len(saved) == 2:  # an Int8Weight's values and row scales
                q, scale = saved
                if not ctx.in_8_bits:
                    # dY·diag(scale)·Q, not the forward's dequantized matrix (which the compiler
                    # would otherwise keep from the forward: a dense copy per layer until backward)
                    folded = (grad.float() * scale).to(grad.dtype)
                    return torch.matmul(folded, q.to(grad.dtype)).to(ctx.in_dtype), *none
                # dX = dY·W = (dY · diag(scale))·Q: the row scales fold into dY before it is quantized.
                ones = torch.ones(q.shape[1], dtype=torch.float32, device=q.device)
                grad_x = form.product(*form.rows(grad * scale), q.t().contiguous(), ones, None, ctx.in_dtype)
                return grad_x.reshape(*grad.shape[:-1], q.shape[1]), *none
            (weight,) = saved
            if not ctx.in_8_bits:
                return torch.matmul(grad, weight.to(grad.dtype)).to(ctx.in_dtype), *none
            # dX = dY·W: W quantized per input channel, so that its scales factor out of the sum.
            grad_x = form.product(*form.rows(grad), *form.weight(weight.t().contiguous()), None, ctx.in_dtype)
            return grad_x.reshape(*grad.shape[:-1], weight.shape[1]), *none

    Linear8Bit.__name__ = Linear8Bit.__qualname__ = f"{compute.capitalize()}Linear"
    return Linear8Bit


def _implementation_hash() -> str:
    """A hash of the code int8_linear runs (or of compile_accel's version, where no source is
    installed)."""
    try:
        modules = (sys.modules[__name__], int8, int8_matmul, int8_weight)
        source = "".join(inspect.getsource(module) for module in modules)
    except (OSError, TypeError):
        source = importlib.metadata.version("compile_accel")
    return hashlib.sha256(source.encode()).hexdigest()[:16]


# int8_linear and fp8_linear are operators (a graph's call target must pickle for compile workers)
# made of the ops of their autograd functions: composite, so the compiler traces through them and
# autograd takes the function's backward. AOTAutograd's cache keys on dynamo's graph, where an
# operator is only a name: its overload is named after the code, so that no entry compiled from
# other code is taken.
_OVERLOAD = f"v{_implementation_hash()}"
_library = torch.library.Library("compile_accel", "FRAGMENT")


def _define_linear(name: str, function: type[torch.autograd.Function]) -> Any:
    """The operator `compile_accel::name` running `function`: F.linear(x, weight, bias) in
    `out_dtype` (what the call gave under autocast), its forward and input gradient each in 8 bits
    where the two flags say."""
    _library.define(
        f"{name}.{_OVERLOAD}(Tensor x, Tensor weight, Tensor? bias, ScalarType out_dtype, bool forward_in_8_bits, "
        "bool input_gradient_in_8_bits) -> Tensor"
    )
    _library.impl(f"{name}.{_OVERLOAD}", function.apply, "CompositeImplicitAutograd")
    return getattr(getattr(torch.ops.compile_accel, name), _OVERLOAD)


# The calls rewrite_base_linears puts in place of base Linears', by CompileConfig.base_compute.
LINEARS = {compute: _define_linear(f"{compute}_linear", _linear_function(compute)) for compute in FORMATS}
int8_linear, fp8_linear = LINEARS["int8"], LINEARS["fp8"]


@dataclass(eq=False)  # (by identity: kept in a WeakSet)
class BaseLinears:
    """The frozen nn.Linear layers of the compiled regions, and for each whether its matmuls run in
    8 bits or why not. A graph is traced for one region and run by every region of its class with
    the same shapes, dtypes and requires_grad, so outcomes are kept per layer key (`_layer_key`):
    the region's class, the layer's path in it, and what of the layer decides the outcome. One key
    can have several: the graphs of one class for inputs of other sizes (Lumina 2's text refiner
    blocks, of the main blocks' class, take 512 rows where the main blocks take 8192)."""

    compute: str
    layers: dict[str, tuple[type, str, nn.Linear]] = field(default_factory=dict)  # name -> (class, path, layer)
    roles: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # weight -> (class, path)
    # layer key -> (product, IN_8_BITS or the reason it stays) for each of PRODUCTS in each graph
    outcomes: dict[tuple, set[tuple[str, str]]] = field(default_factory=dict)
    # region class name -> the worst of compile_accel.base_compute_probe.compare_compute's results
    # (one per input shapes), with "checks": how many
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

    def record(self, weight: torch.Tensor, bias: torch.Tensor | None, outcomes: tuple[str, str]) -> None:
        """The outcomes of one call of a layer: of its forward and of its input gradient."""
        key = _layer_key(*self.roles[weight], weight, bias)
        self.outcomes.setdefault(key, set()).update(zip(PRODUCTS, outcomes))

    def add_accuracy(self, name: str, result: dict[str, Any]) -> None:
        """Fold one accuracy check of region class `name` into its figures: the largest output
        error, the lowest gradient cosine (NaN the worst of both), the gradients compared and the
        checks run in all; a skipped check is kept only where no check ran."""
        kept = self.accuracy.get(name)
        if kept is None or "skipped" in kept:
            self.accuracy[name] = result if "skipped" in result else {**result, "checks": 1}
            return
        if "skipped" in result:
            return
        cosines = [c for c in (kept["min_gradient_cosine"], result["min_gradient_cosine"]) if c is not None]
        self.accuracy[name] = {
            "output_error": _worst([kept["output_error"], result["output_error"]], larger_is_worse=True),
            "min_gradient_cosine": _worst(cosines, larger_is_worse=False),
            "gradients": kept["gradients"] + result["gradients"],
            "checks": kept["checks"] + 1,
        }

    def summary(self) -> dict[str, Any]:
        """`compute`, `base_linears` (how many), `in_8_bits` (how many a compiled graph runs in 8
        bits, one of their two products at least), `matmuls_in_8_bits` (of their 2 x base_linears
        products: forwards and input gradients), `stayed` (layer name -> why it runs in its own
        dtype; where the two products' reasons differ, "forward: why | input gradient: why") and
        `accuracy` (region class -> its first training calls' comparison with its own dtype, one per
        input shapes, the worst figures kept). A layer
        whose class has graphs of both kinds counts in `in_8_bits` and is in `stayed` as well."""
        stayed, in_8_bits, matmuls_in_8_bits = {}, 0, 0
        untraced = set(zip(PRODUCTS, (NOT_TRACED, NOT_TRACED)))
        for name, (kind, path, layer) in self.layers.items():
            outcomes = self.outcomes.get(_layer_key(kind, path, layer.weight, layer.bias), untraced)
            products_in_8_bits = sum((product, IN_8_BITS) in outcomes for product in PRODUCTS)
            in_8_bits += products_in_8_bits > 0
            matmuls_in_8_bits += products_in_8_bits
            why = {product: _why_it_stays(product, outcomes) for product in PRODUCTS}
            if len(set(why.values())) == 1:
                reasons = why[PRODUCTS[0]]
            else:
                reasons = " | ".join(f"{product}: {text}" for product, text in why.items() if text)
            if reasons:
                stayed[name] = reasons
        return {
            "compute": self.compute,
            "base_linears": len(self.layers),
            "in_8_bits": in_8_bits,
            "matmuls_in_8_bits": matmuls_in_8_bits,
            "stayed": stayed,
            "accuracy": dict(self.accuracy),
        }


# The BaseLinears of the accelerations applied now (`register`; Acceleration.remove() takes its
# own out): the offload conductor asks which streamed weights int8 compute multiplies.
_APPLIED: weakref.WeakSet[BaseLinears] = weakref.WeakSet()


def register(base_linears: BaseLinears, applied: bool) -> None:
    """Count `base_linears` among the applied accelerations' (applied=False: no longer)."""
    if applied:
        _APPLIED.add(base_linears)
    else:
        _APPLIED.discard(base_linears)


def multiplied_in_int8(weight: torch.Tensor) -> bool:
    """Whether `weight` is a base Linear's weight in an acceleration applied with base_compute="int8"
    (the offload conductor then streams it as an Int8Weight)."""
    return any(found.compute == "int8" and weight in found.roles for found in _APPLIED)


def adopt_weight(original: torch.Tensor, replacement: torch.Tensor) -> None:
    """`replacement` now stands in its layer for the base weight `original` (the offload conductor's
    Int8Weight; and back at its remove())."""
    for found in _APPLIED:
        if original in found.roles:
            found.roles[replacement] = found.roles[original]


def _why_it_stays(product: str, outcomes: set[tuple[str, str]]) -> str:
    """Why `product` of a layer stays in its dtype in the graphs that do so ("" in none), noting
    graphs that run it in 8 bits."""
    reasons = "; ".join(sorted(outcome for p, outcome in outcomes if p == product and outcome != IN_8_BITS))
    if reasons and (product, IN_8_BITS) in outcomes:
        return f"{reasons} (in 8 bits in other graphs of its class)"
    return reasons


def _worst(values: list[float], larger_is_worse: bool) -> float | None:
    """The worst of `values`, NaN the worst of all; None for none."""
    if any(math.isnan(value) for value in values):
        return math.nan
    return (max if larger_is_worse else min)(values, default=None)


def _layer_key(kind: type, path: str, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """What an outcome is kept under: the layer's role and what `why_not_8_bits` reads of it, but
    its device: a block swapped out (sd-scripts' block swap) has its weights in host memory when
    `summary` reads them, and ran on the GPU."""
    bias_trains = bias is not None and bias.requires_grad
    return kind, path, tuple(weight.shape), weight.dtype, bias_trains


def why_not_8_bits(
    compute: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[str | None, str | None]:
    """Why the call's forward and its input gradient (PRODUCTS) each stay in their dtype, None for
    a product that runs in 8 bits."""
    why = _why_not_the_layer(compute, x, weight, bias)
    if why is not None or weight.device.type != "cuda":
        return why, why
    out_features, in_features = weight.shape
    return tuple(
        None
        if width >= CUDA_MIN_WIDTH
        else f"output {width} wide: on CUDA 8 bits gain from {CUDA_MIN_WIDTH} (quantizing its operand costs more)"
        for width in (out_features, in_features)
    )


def _why_not_the_layer(compute: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why neither product of the call runs in 8 bits, or None."""
    if bias is not None and bias.requires_grad:
        return "its bias is trainable"
    if not (x.is_floating_point() and weight.is_floating_point()):
        return f"input {x.dtype}, weight {weight.dtype}: {compute} quantizes floating-point values"
    if weight.device.type != "cuda":
        return None
    multiple = CUDA_SIZE_MULTIPLE[compute]
    if any(size % multiple for size in weight.shape):
        return f"weight {tuple(weight.shape)}: {compute} on CUDA needs both sizes multiples of {multiple}"
    rows = _size_hint(x.numel()) // _size_hint(x.shape[-1]) if x.shape[-1] else 0
    if rows < CUDA_MIN_ROWS:
        return (
            f"input rows {rows}: on CUDA 8 bits gain from {CUDA_MIN_ROWS} rows (the weight's quantization costs more)"
        )
    return None


def _size_hint(size: int | torch.SymInt) -> int:
    """A size as a number: a symbolic one (dynamic shapes) by the value it was traced with, which
    decides without a guard (rows differ by orders of magnitude between the two kinds of call)."""
    return size.node.hint if isinstance(size, torch.SymInt) else size
