"""What an autograd graph reaches."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def differentiable_outputs(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's `output` that require grad: in pytree's containers, and in the
    attributes of an object pytree does not know (sd-scripts' SD 1.x U-Net returns a plain
    `SampleOutput` holding `sample`)."""
    found = []
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            found += [leaf] if leaf.requires_grad else []
        elif hasattr(leaf, "__dict__") and not isinstance(leaf, type):
            found += differentiable_outputs(dict(vars(leaf)))
    return found


def accumulating_leaves(*outputs: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose .grad a backward from `outputs` would accumulate into."""
    seen, stack, leaves = set(), [t.grad_fn for t in outputs], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves
