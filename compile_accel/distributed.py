"""Data parallel training of an accelerated model: DDP, or FSDP2 sharding per block.

Apply in torchtitan's order: `compile_accel.apply` first (checkpointing or budget, then
compile), then `apply_ddp` or `apply_fsdp`. The compiled regions are instance-level forwards,
so the hooks DDP and FSDP2 put on the modules still run around them; dynamo never traces
DDP's or FSDP's own code. Dynamo's DDP optimizer is switched off in every thread that
compiles (see dynamo_settings), so a block's graph is never split at gradient buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .blocks import resolve_block_lists


def _require_world(what: str) -> int:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed initialised (torchrun, accelerate launch)")
    world = dist.get_world_size()
    if world < 2:
        raise ValueError(
            f"{what} was asked for with a world size of 1; run on two or more processes, or train without it"
        )
    return world


def apply_ddp(model: nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wrap `model` (already accelerated) in DistributedDataParallel; raises on a world of one."""
    _require_world("apply_ddp")
    return DistributedDataParallel(model, **ddp_kwargs)


def _is_sharded(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor"


def apply_fsdp(
    model: nn.Module, blocks: Sequence[str | nn.ModuleList] | None = None, **fully_shard_kwargs: Any
) -> nn.Module:
    """`fully_shard` every repeated block, then the model (FSDP2); returns the model.

    blocks: as for `compile_accel.apply` (None finds them). Raises before sharding anything
    on a world of one or when some parameter is already sharded.
    """
    from torch.distributed.fsdp import fully_shard

    _require_world("apply_fsdp")
    sharded = [name for name, p in model.named_parameters() if _is_sharded(p)]
    if sharded:
        raise ValueError(f"{type(model).__name__} is already sharded ({sharded[0]}, ...); apply_fsdp it once")
    for block_list in resolve_block_lists(model, blocks):
        for block in block_list.blocks:
            fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model
