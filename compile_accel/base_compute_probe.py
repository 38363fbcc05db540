"""base_compute's accuracy check: once per block class, 8-bit compute against the class's own.

At the first training call of each compiled region class, the region runs once more, compiled
(its base Linears in 8 bits), and once eagerly (its own dtype), on copies of that call's inputs,
each followed by a backward of the same random output gradient. The output's relative error
(Frobenius) and the LoRA gradients' cosine similarity go to the log and to
`stats()["base_compute"]["accuracy"]`; a warning when they pass the issue's bars. Neither run
touches the step: no `.grad` is written (`torch.autograd.grad`), the random state is restored,
and the model's checkpoint, if any, sees none of their saved tensors.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from .autograd_graph import accumulating_leaves
from .checkpointing import keep_saved_tensors
from .stats import warn

logger = logging.getLogger("compile_accel")

# The bars of 8-bit compute (docs/base-compute.md#accuracy-check): a block's output within this relative error of
# its own dtype's, and every LoRA gradient at least this cosine-similar.
MAX_OUTPUT_ERROR = {"int8": 0.02, "fp8": 0.04}
MIN_GRADIENT_COSINE = 0.99


def compare_compute(
    compute: str, name: str, compiled: Callable[..., Any], eager: Callable[..., Any], args: tuple, kwargs: dict
) -> dict[str, Any]:
    """Run `compiled` and `eager` (the region named `name`) on copies of `args`/`kwargs` and
    compare: {"output_error", "min_gradient_cosine" (None without a nonzero LoRA gradient),
    "gradients" (how many compared)}, or {"skipped": why}. Logs the figures; warns above the bars
    of `compute`."""
    devices = {t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    try:
        # A checkpoint's saved-tensor hooks, active around this call, must not see these runs' tensors.
        with torch.random.fork_rng([d for d in devices if d.type == "cuda"]), torch.enable_grad():
            with keep_saved_tensors(), _step_backward_still_pending(devices):
                expected, expected_gradients = _output_and_gradients(eager, args, kwargs, None)
                output, gradients = _output_and_gradients(compiled, args, kwargs, list(expected_gradients))
    except torch.OutOfMemoryError:
        warn(f"base_compute: {name}'s accuracy check was skipped: no GPU memory for one more forward and backward")
        return {"skipped": "out of GPU memory"}
    error = (_norm([o - e for o, e in zip(output, expected)]) / _norm(expected).clamp_min(1e-30)).item()
    # Gradients zero in both are left out: at the first step a LoRA whose up weight starts at zero
    # (kohya's, peft's) gives its down weight none.
    cosines = [
        torch.nn.functional.cosine_similarity(g.flatten().float(), e.flatten().float(), dim=0).item()
        for g, e in zip(gradients.values(), expected_gradients.values())
        if g.any() or e.any()
    ]
    cosine = min(cosines, default=None)
    logger.info(
        "base_compute=%s, %s: output %.3f%% off its own dtype's; LoRA gradients' cosine similarity %s",
        compute,
        name,
        100 * error,
        "(no nonzero gradient)" if cosine is None else f">= {cosine:.5f} ({len(cosines)})",
    )
    # (written so that NaN fails)
    if not error <= MAX_OUTPUT_ERROR[compute] or (cosine is not None and not cosine >= MIN_GRADIENT_COSINE):
        warn(
            f"base_compute={compute!r}: {name}'s output is {100 * error:.2f}% off its own dtype's (bar "
            f"{100 * MAX_OUTPUT_ERROR[compute]:g}%) and its LoRA gradients' cosine similarity is {cosine} "
            f"(bar {MIN_GRADIENT_COSINE}); training may differ: leave the block out of 8-bit compute "
            "(CompileConfig.exclude) or train without base_compute"
        )
    return {"output_error": error, "min_gradient_cosine": cosine, "gradients": len(cosines)}


@contextlib.contextmanager
def _step_backward_still_pending(devices: set[torch.device]) -> Iterator[None]:
    """Under CUDA graphs (compile_mode "reduce-overhead"): inductor's CUDA graph trees take the first
    forward after any backward for the next step's, and free what the forwards before it recorded,
    saved for the step's backward. The check's backward, inside the step's forward, is not the
    step's: the trees are told again that a backward is pending, as they were before."""
    cudagraph_trees = sys.modules.get("torch._inductor.cudagraph_trees")  # (not imported: no tree exists)
    managers = [
        cudagraph_trees.get_manager(device.index, create_if_none_exists=False)
        for device in devices
        if cudagraph_trees is not None and device.type == "cuda" and device.index is not None
    ]
    pending = {manager: manager.running_forwards_with_pending_backwards for manager in managers if manager}
    try:
        yield
    finally:
        for manager, was_pending in pending.items():
            manager.running_forwards_with_pending_backwards = was_pending


def _output_and_gradients(
    call: Callable[..., Any], args: tuple, kwargs: dict, parameters: list[nn.Parameter] | None
) -> tuple[list[torch.Tensor], dict[nn.Parameter, torch.Tensor]]:
    """The floating outputs of `call` on fresh copies of the inputs, and the gradients of
    `parameters` (None: the trainable ones the outputs reach) for an output gradient drawn
    from a fixed seed."""
    args, kwargs = _copies((args, kwargs))
    outputs = [t for t in tree_flatten(call(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
    outputs = [t for t in outputs if t.is_floating_point()]
    if parameters is None:
        parameters = [leaf for leaf in accumulating_leaves(*outputs) if isinstance(leaf, nn.Parameter)]
    differentiable = [t for t in outputs if t.requires_grad]
    gradients: tuple[torch.Tensor, ...] = ()
    if parameters and differentiable:
        generator = torch.Generator().manual_seed(0)
        cotangents = [torch.randn(t.shape, generator=generator).to(t) for t in differentiable]
        gradients = torch.autograd.grad(
            differentiable, parameters, cotangents, allow_unused=True, materialize_grads=True
        )
    return [t.detach() for t in outputs], dict(zip(parameters, gradients))


def _copies(inputs: Any) -> Any:
    """Copies of the tensors of `inputs` as the call got them: each storage copied once and each
    tensor the same view of its copy (sizes, strides, offset; inputs that share memory share it),
    requiring grad where it did. So the compiled run takes the graph the call took: dynamo guards
    strides and requires_grad (a broadcast mask of stride 0, copied dense, compiled another)."""
    storages: dict[tuple[torch.device, int], torch.UntypedStorage] = {}

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        storage = value.untyped_storage()
        key = (value.device, storage.data_ptr())
        if key not in storages:
            storages[key] = storage.clone()
        view = torch.empty(0, dtype=value.dtype, device=value.device)
        view.set_(storages[key], value.storage_offset(), value.size(), value.stride())
        return view.requires_grad_(value.requires_grad)

    return tree_map(copy, inputs)


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.float().norm() for t in tensors]).norm()
