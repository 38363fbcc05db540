"""The graph pass of CompileConfig.base_compute (compile_accel/base_compute.py): RegionBackend
rewrites each `linear` call in dynamo's graph of a region whose weight is a frozen nn.Linear of
that region: a plain Linear, the base a kohya-style LoRA calls through its saved `org_forward`,
peft's `base_layer`, all of which reach F.linear with that weight. The call becomes `int8_linear`
or `fp8_linear` before AOTAutograd, so every compile path (in this process, compile workers,
precompile, auto's traced step) gets the same graph, and the LoRA path, trainable, stays in its
dtype."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn as nn

from .base_compute import IN_8_BITS, LINEARS, BaseLinears, why_not_8_bits
from .int8_weight import Int8Weight


def _linear_arguments(node: torch.fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of an F.linear call, given by position or keyword."""
    args = (*node.args, *(node.kwargs[k] for k in ("input", "weight", "bias")[len(node.args) :] if k in node.kwargs))
    return args[0], args[1], args[2] if len(args) > 2 else None


def rewrite_base_linears(gm: torch.fx.GraphModule, example_inputs: list[Any], base_linears: BaseLinears) -> None:
    """Turn each F.linear call of dynamo's graph `gm` (and of the graphs nested in it, a checkpoint's
    body) whose weight is one of `base_linears` into int8_linear or fp8_linear, or record why it stays.
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
    """Replace one F.linear call by base_linears.compute's 8-bit linear if its weight is a base
    weight one of whose products can run in 8 bits, or a held Int8Weight; whether it did. The
    outcome of each product of a base weight is recorded (a reason where it stays)."""
    x, weight, bias = (_value(arg, values) for arg in _linear_arguments(node))
    if (
        not isinstance(weight, nn.Parameter)
        or weight not in base_linears.roles
        or weight.requires_grad
        or not isinstance(x, torch.Tensor)  # (an input without a traced value: left as it is)
    ):
        return False
    why = why_not_8_bits(base_linears.compute, x, weight, bias)
    base_linears.record(weight, bias, tuple(reason or IN_8_BITS for reason in why))
    # (an Int8Weight's call is rewritten with both products in its dtype too: its backward then
    # multiplies its int8 values, and no dequantized copy is saved for it)
    if all(why) and not isinstance(weight, Int8Weight):
        return False
    x_node, weight_node, bias_node = _linear_arguments(node)
    with gm.graph.inserting_before(node):
        replacement = gm.graph.call_function(
            LINEARS[base_linears.compute],
            (x_node, weight_node, bias_node, node.meta["example_value"].dtype, *(reason is None for reason in why)),
        )
    replacement.meta = dict(node.meta)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    return True
