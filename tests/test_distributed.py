"""DDP and FSDP2 around compiled blocks on two CPU processes (gloo): LoRA gradients equal to one
process on the global batch, one graph per block class; clear errors for a world of one,
re-sharding, and devices that are not there; the two-device block split's plan."""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import compile_accel
from compile_accel import CompileConfig
from compile_accel.distributed import apply_ddp, apply_fsdp
from compile_accel.placement import balanced_split, split_blocks

WORLD = 2
TOLERANCE = 1e-5
# Two tiny ranks take seconds; past these, a rank is stuck: it prints its stack, the test fails.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
RANKS_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        if p.requires_grad:
            grad = p.grad.full_tensor() if type(p.grad).__name__ == "DTensor" else p.grad
            grads.append(grad.detach().clone())
    return grads


MODES = {
    # mode -> (config, the stack's checkpointing)
    "blocks": (CompileConfig(mode="blocks", activation_memory_budget=0.5, backend="aot_eager"), None),
    "selective": (CompileConfig(mode="selective", backend="aot_eager"), "non-reentrant"),
}


def _worker(rank: int, port: int, wrapper: str, mode: str, queue) -> None:
    from offload_stand_ins import Stack

    faulthandler.dump_traceback_later(RANKS_TIMEOUT_S - 30)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":  # loopback only: gloo otherwise takes the address the host name resolves to
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    try:
        config, checkpointing = MODES[mode]
        torch.manual_seed(0)
        reference = Stack(n=4, checkpointing=checkpointing)
        model = Stack(n=4, checkpointing=checkpointing)
        model.load_state_dict(reference.state_dict())
        x, cond = torch.randn(2 * WORLD, 16, 32), torch.randn(2 * WORLD, 1, 32)
        reference(x, cond).square().mean().backward()
        acceleration = compile_accel.apply(model, config)
        wrapped = apply_ddp(model) if wrapper == "ddp" else apply_fsdp(model)
        local = slice(2 * rank, 2 * rank + 2)
        for _ in range(2):  # the second step must not compile again
            for p in model.parameters():
                p.grad = None
            wrapped(x[local], cond[local]).square().mean().backward()
        errors = [((g - e).norm() / e.norm()).item() for g, e in zip(_grads(model), _grads(reference), strict=True)]
        stats = acceleration.stats()
        second = None
        if wrapper == "fsdp":
            try:
                apply_fsdp(model)
            except ValueError as error:
                second = str(error)
        alone = Stack(n=4, checkpointing=checkpointing)  # the same config in this process, no wrapper
        alone.load_state_dict(reference.state_dict())
        alone_acceleration = compile_accel.apply(alone, config)
        alone(x[local], cond[local]).square().mean().backward()
        graphs = (stats["unique_graphs"], alone_acceleration.stats()["unique_graphs"])
        queue.put((rank, max(errors), graphs, stats["recompiles"], stats["graph_breaks"], second))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrapper, mode", [("ddp", "blocks"), ("ddp", "selective"), ("fsdp", "blocks")])
def test_compiled_blocks_under_data_parallel_match_one_process(wrapper: str, mode: str) -> None:
    queue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(
        _worker, args=(_free_port(), wrapper, mode, queue), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not ranks.join(timeout=1):  # raises if a rank failed
        if time.monotonic() > deadline:
            for rank in ranks.processes:
                rank.kill()
            pytest.fail(f"the ranks did not finish in {RANKS_TIMEOUT_S} s (their stacks are in the captured stderr)")
    results = sorted(queue.get() for _ in range(WORLD))
    for rank, error, (graphs, graphs_alone), recompiles, breaks, second in results:
        assert error < TOLERANCE, (rank, error)
        assert (graphs, recompiles, breaks) == (graphs_alone, 0, 0)  # the wrapper adds no graph
        if mode == "blocks":
            assert graphs == 1  # one block class, one graph
        if wrapper == "fsdp":
            assert "already sharded" in second


def test_world_of_one_is_refused() -> None:
    from offload_stand_ins import Stack

    with pytest.raises(RuntimeError, match="initialised"):
        apply_ddp(Stack(n=2))
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        for apply in (apply_ddp, apply_fsdp):
            with pytest.raises(ValueError, match="world size of 1"):
                apply(Stack(n=2))
    finally:
        dist.destroy_process_group()


def test_balanced_split_evens_out_bytes() -> None:
    assert balanced_split([1, 1, 1, 1], 2) == [2]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [1]  # a heavy first block goes alone
    assert balanced_split([1] * 9, 3) == [3, 6]


def test_split_refuses_missing_devices_and_bad_splits_without_moving_anything() -> None:
    from offload_stand_ins import Stack

    model = Stack(n=4)
    before = [p.device for p in model.parameters()]
    visible = torch.cuda.device_count()
    with pytest.raises(ValueError, match="not visible"):
        split_blocks(model, ["cpu", f"cuda:{visible}"])
    with pytest.raises(ValueError, match="increasing block indices"):
        split_blocks(model, ["cpu", "cpu"], split=[4])
    with pytest.raises(ValueError, match="two or more devices"):
        split_blocks(model, ["cpu"])
    assert [p.device for p in model.parameters()] == before
    assert not any(block._forward_pre_hooks for block in model.blocks)


def test_split_places_blocks_and_kohya_lora_and_remove_takes_the_hooks_off() -> None:
    from conftest import build, inputs_for

    model, params = build("kohya", None)
    x = inputs_for(model)
    expected = model(*x)
    placement = split_blocks(model, ["cpu", "cpu"])  # the plumbing; devices are checked on 2 GPUs
    assert len(placement.block_devices) == 4 and len(placement.delegates) == 12  # every LoRA module
    torch.testing.assert_close(model(*x), expected)
    placement.remove()
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in [*model.double_blocks, *model.single_blocks])


def test_undo_still_puts_the_placement_back_under_its_old_name() -> None:
    from offload_stand_ins import Stack

    model = Stack(n=4)
    split_blocks(model, ["cpu", "cpu"]).remove()
    assert not any(block._forward_pre_hooks or block._forward_hooks for block in model.blocks)
