"""Graph rewrites of scaled_dot_product_attention calls in a region, applied before it compiles.

Both keep what attention computes and change how: inputs the kernels take well, and no mask
larger than it needs to be.
"""

from __future__ import annotations

import torch
import torch.fx


def rewrite_attention(gm: torch.fx.GraphModule) -> None:
    """Both rewrites below, in the region's graph and in the graphs nested in it (the bodies of
    higher-order ops such as a checkpoint traced inside the region)."""
    for module in list(gm.modules()):
        if isinstance(module, torch.fx.GraphModule):
            additive_masks_before_expand(module)  # reads the query as traced, before the next rewrite replaces it
            token_major_attention_inputs(module)


def _attention_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        node
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is torch.nn.functional.scaled_dot_product_attention
    ]


_PARAMETERS = ("query", "key", "value", "attn_mask")  # the leading parameters of scaled_dot_product_attention


def _argument(node: torch.fx.Node, name: str) -> object:
    """An SDPA call's argument `name`, given by position or keyword; None when absent."""
    index = _PARAMETERS.index(name)
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _set_argument(node: torch.fx.Node, name: str, value: object) -> None:
    index = _PARAMETERS.index(name)
    if len(node.args) > index:
        node.args = (*node.args[:index], value, *node.args[index + 1 :])
    else:
        node.kwargs = {**node.kwargs, name: value}


def _example(value: object) -> torch.Tensor | None:
    return value.meta.get("example_value") if isinstance(value, torch.fx.Node) else None


def _is_expand(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and (
        (node.op == "call_method" and node.target == "expand")
        or (node.op == "call_function" and node.target is torch.Tensor.expand)
    )


def additive_masks_before_expand(gm: torch.fx.GraphModule) -> int:
    """Turn each boolean attention mask built by `expand` into an additive mask made before it.

    SDPA converts a boolean mask to an additive one (0 where attended, -inf elsewhere) at the
    mask's full size. sd-scripts' Lumina 2 expands a (batch, 1, 1, keys) padding mask to
    (batch, heads, queries, keys) first: at 1024x1024 that conversion writes 1.8 GB per layer,
    a fifth of a selective-compile step's time (docs/fallbacks.md). Converted before the expand
    it is batch x keys values, broadcast by stride 0 (the fused kernels take expanded masks).
    Returns how many masks were rewritten.
    """
    rewritten = 0
    for node in _attention_calls(gm):
        mask = _argument(node, "attn_mask")
        mask_value, query_value = _example(mask), _example(_argument(node, "query"))
        if mask_value is None or query_value is None or mask_value.dtype != torch.bool or not _is_expand(mask):
            continue
        expands, source = [], mask
        while _is_expand(source):
            expands.append(source)
            source = source.args[0]
        with gm.graph.inserting_before(node):
            zeros = gm.graph.call_function(torch.zeros_like, (source,), {"dtype": query_value.dtype})
            additive = gm.graph.call_method(
                "masked_fill", (zeros, gm.graph.call_method("logical_not", (source,)), float("-inf"))
            )
            for expand in reversed(expands):
                additive = gm.graph.call_method("expand", (additive, *expand.args[1:]), dict(expand.kwargs))
        _set_argument(node, "attn_mask", additive)
        for expand in expands:  # outermost first, so each inner one is unused when reached
            if not expand.users:
                gm.graph.erase_node(expand)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _tensor_method(gm: torch.fx.GraphModule, method: str, tensor: torch.fx.Node, *args: object) -> torch.fx.Node:
    """A `tensor.method(*args)` node with its example value, as dynamo makes them: AOTAutograd
    caches a graph only if every method call is on a node with one (a graph it would not cache
    cannot go to a compile worker)."""
    node = gm.graph.call_method(method, (tensor, *args))
    example = _example(tensor)
    if example is not None:
        node.meta["example_value"] = getattr(example, method)(*args)
    return node


def token_major_attention_inputs(gm: torch.fx.GraphModule) -> int:
    """Give each scaled_dot_product_attention call's q, k and v a dense buffer of its own, laid out
    (batch, tokens, heads, head_dim) and viewed as SDPA's (batch, heads, tokens, head_dim); inputs
    without a heads dimension a contiguous one. Returns how many calls were rewritten.

    With torch 2.11 (inductor, bf16 autocast), blocks whose q/k/v are permuted views of one
    projection or buffers laid out as inductor chose get NaN or wrong LoRA gradients from the
    compiled graph (the embedded test DiT on an H200: NaN, or 1.35 relative error against fp32
    where eager's is 0.010), where eager, aot_eager, fp32 and attention written out are right
    (docs/fallbacks.md). Dense inputs are right. Token-major ones, rather than contiguous
    (batch, heads, tokens, head_dim): that is the layout the projections write and the output
    projection reads, so the attention output and the gradients of q, k and v need no transposing
    copy; on sd-scripts' SD3 as a 4090 the contiguous layout cost about 10 ms of kernels a step.
    """
    calls = _attention_calls(gm)
    for node in calls:
        for name in _PARAMETERS[:3]:
            value = _argument(node, name)
            with gm.graph.inserting_before(node):
                example = _example(value)
                if example is not None and example.dim() == 4:
                    token_major = _tensor_method(gm, "transpose", value, 1, 2)
                    dense = _tensor_method(gm, "contiguous", token_major)
                    _set_argument(node, name, _tensor_method(gm, "transpose", dense, 1, 2))
                else:
                    _set_argument(node, name, _tensor_method(gm, "contiguous", value))
    if calls:
        gm.recompile()
    return len(calls)
