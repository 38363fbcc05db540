"""compile_accel.gc_freeze: garbage collected first, then what is alive left out of later collections;
and compile_accel.first_step, which calls it at the end of the first step."""

from __future__ import annotations

import gc
import weakref

import torch

import compile_accel
from compile_accel import CompileConfig, first_step
from compile_accel.gc_freeze import freeze_after_first_step


class Node:
    """An object Python's collector tracks, in a reference cycle with itself."""

    def __init__(self) -> None:
        self.me = self


def accelerated(graphs_compiled: int) -> compile_accel.Acceleration:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    acceleration._stats.worker_graphs_started = graphs_compiled  # graphs handed to compile workers
    return acceleration


def test_nothing_compiled_leaves_the_collector_alone() -> None:
    gc.disable()  # from before the garbage is made: no automatic collection takes it
    try:
        garbage = weakref.ref(Node())
        assert freeze_after_first_step(accelerated(0)) is None
        assert gc.get_freeze_count() == 0 and garbage() is not None  # not collected either
    finally:
        gc.enable()


def test_freezing_collects_the_garbage_then_leaves_what_is_alive_out_of_later_collections() -> None:
    acceleration = accelerated(1)
    gc.disable()  # only the freeze's own collection runs, from before the garbage is made
    try:
        garbage = weakref.ref(Node())  # unreachable at once, held by its cycle alone
        alive = Node()
        frozen = freeze_after_first_step(acceleration)
        assert garbage() is None, "the garbage there was before the freeze was not collected"
        assert 0 < gc.get_freeze_count() <= frozen  # (frozen objects freed since leave the count)
        assert not any(obj is alive for obj in gc.get_objects()), "a live object stayed in the collector's view"
        still_there = weakref.ref(alive)
        del alive  # now garbage, but frozen: its cycle outlives every collection until gc.unfreeze()
        gc.collect()
        assert still_there() is not None
        assert freeze_after_first_step(acceleration) >= frozen  # a second call freezes what came since, on top
    finally:
        gc.enable()
        gc.unfreeze()
    gc.collect()
    assert still_there() is None


def test_the_first_steps_end_saves_while_the_pool_is_up_then_freezes(monkeypatch) -> None:
    """end_first_step, shared by the launcher and the bench: the run's cache is saved before the
    compile workers may stop (they precompile the graphs it saves), the collector frozen last."""
    events: list[str] = []

    class RunCache:
        def save(self) -> int:
            events.append("save")
            return 7

    monkeypatch.setattr(first_step.compile_workers, "first_step_done", lambda: events.append("pool may stop"))
    monkeypatch.setattr(first_step, "freeze_after_first_step", lambda acceleration: events.append("freeze") or 3)
    ended = first_step.end_first_step(accelerated(graphs_compiled=1), RunCache())
    assert events == ["save", "pool may stop", "freeze"]
    assert (ended.saved_bytes, ended.frozen) == (7, 3)

    events.clear()
    ended = first_step.end_first_step(accelerated(graphs_compiled=1), None)  # no run cache
    assert events == ["pool may stop", "freeze"] and ended.saved_bytes == 0
