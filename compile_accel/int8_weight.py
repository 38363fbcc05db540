"""Int8Weight: a frozen weight matrix that torch sees in its dtype but that holds per-row int8
values and fp32 row scales (`compile_accel.int8.quantize_int8`'s format), so that base_compute
int8 multiplies those values as they are.

The offload conductor streams frozen matrices in that format (offload_dtype="int8") and, for the
weights of base Linears whose blocks are compiled with base_compute="int8", leaves them in it on
the GPU: the layer's parameter is an Int8Weight whose values and scales are views of the block's
slot. In a compiled graph (a traceable wrapper subclass: its two inner tensors are the graph's
inputs) `compile_accel::int8_linear` multiplies the values with their scales (`base_compute.py`)
instead of the weight being dequantized on every load and quantized again by the product.
Everything else done with it (eager code, a product that stays in its dtype) sees the
dequantized matrix, `dequantize()`, which equals what the conductor's dequantizing kernel writes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map_only

_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class Int8Weight(torch.Tensor):
    """A matrix of `dtype` held as int8 values `q` (its shape) and an fp32 scale per row `scale`.

    `device` is fixed when it is made (a wrapper's): the conductor makes it on the GPU and points
    `q` and `scale` at the block's slot while it is loaded and at its host copy while it is not.
    Ops that would change it raise (the conductor's host copy is what it loads again)."""

    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(
        cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None
    ) -> Int8Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls, q.shape, dtype=dtype, device=device if device is not None else q.device, requires_grad=False
        )

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        self.q, self.scale = q, scale

    def dequantize(self) -> torch.Tensor:
        """The matrix in its dtype (`dequantize`)."""
        return dequantize(self.q, self.scale, self.dtype)

    def __repr__(self) -> str:  # (the default would print the dequantized values)
        return f"Int8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["q", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], dtype: torch.dtype, size: Any, stride: Any) -> Int8Weight:
        return Int8Weight(inner["q"], inner["scale"], dtype)

    def _stable_hash_for_caching(self) -> str:
        """What AOTAutograd's cache keys a graph input of this class on: its layout, not its values."""
        layout = (tuple(self.shape), self.dtype, self.device.type, self.q.stride(), self.scale.stride())
        return hashlib.sha256(repr(layout).encode()).hexdigest()[:32]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _ALIASES:  # a parameter's detach() (nn.Module.state_dict, optimizers): the same values
            weight = args[0]
            return Int8Weight(weight.q, weight.scale, weight.dtype, weight.device)
        if func is torch.ops.aten.empty_like.default and kwargs.get("device") == torch.device("meta"):
            # its layout without its values, as dynamo saves a precompiled graph's guards on it
            weight = args[0]
            meta = [torch.empty_like(t, device="meta") for t in (weight.q, weight.scale)]
            return Int8Weight(*meta, weight.dtype)
        if func._schema.is_mutable and any(
            isinstance(value, Int8Weight) and argument.alias_info is not None and argument.alias_info.is_write
            for argument, value in zip(func._schema.arguments, args)
        ):
            raise RuntimeError(
                f"{func} would change a frozen weight that an offload conductor streams in int8 (an Int8Weight); "
                "the change would be lost at its next load. Call the conductor's remove() first"
            )
        args, kwargs = tree_map_only(Int8Weight, Int8Weight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-row int8 values `q` times their row's fp32 `scale`, computed in fp32 and rounded once to
    `dtype`: what `compile_accel.int8.dequantize_int8_` writes."""
    rows = q.shape[0]
    # (one multiplication, int8 by fp32: no conversion of q of its own, which a compiler would
    # merge with int8_linear's backward's and keep from the forward)
    return (q.reshape(rows, -1) * scale[:, None]).to(dtype).reshape(q.shape)


def plain_tensors(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors that hold `tensor`'s memory: its int8 values and scales for an Int8Weight
    (which has no storage of its own), else itself."""
    return (tensor.q, tensor.scale) if isinstance(tensor, Int8Weight) else (tensor,)


def separate_aliased_outputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> None:
    """Where dynamo's graph `gm` takes an Int8Weight, each output but the first that shares its
    memory with another output and with no input becomes a copy of its own. AOTAutograd cannot
    compile a graph with tensor subclass inputs whose outputs alias one intermediate tensor
    (diffusers' Flux single-stream blocks return two slices of one); a copy costs a pass over
    one block output's bytes."""
    if not any(isinstance(value, Int8Weight) for value in example_inputs):
        return
    inputs = {
        StorageWeakRef(plain.untyped_storage())
        for node in gm.graph.find_nodes(op="placeholder")
        if isinstance(value := node.meta.get("example_value"), torch.Tensor)
        for plain in plain_tensors(value)
    }
    output = next(iter(gm.graph.find_nodes(op="output")))
    seen: set[StorageWeakRef] = set()

    def own(arg: Any) -> Any:
        value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or isinstance(value, Int8Weight):
            return arg
        storage = StorageWeakRef(value.untyped_storage())
        if storage in inputs or storage not in seen:
            seen.add(storage)
            return arg
        with gm.graph.inserting_before(output):
            copy = gm.graph.call_function(torch.clone, (arg,))
        copy.meta = dict(arg.meta)
        return copy

    output.args = torch.fx.node.map_arg(output.args, own)
    gm.recompile()
