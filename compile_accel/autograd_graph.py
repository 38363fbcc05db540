"""What an autograd graph reaches."""

from __future__ import annotations

import torch


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
