"""The inductor preload: apply() waits for it, so that no two threads import inductor at once."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import build

import compile_accel
from compile_accel import CompileConfig, preload


def test_apply_waits_for_a_preload_still_running(monkeypatch: pytest.MonkeyPatch) -> None:
    done = threading.Event()

    def slow_preload() -> None:
        time.sleep(0.3)
        done.set()

    monkeypatch.setattr(preload, "_thread", None)
    monkeypatch.setattr(preload, "_preload", slow_preload)
    model, _ = build()
    compile_accel.start_preloading()
    acceleration = compile_accel.apply(model, CompileConfig(mode="off"))
    assert done.is_set()
    acceleration.remove()


def test_a_failing_preload_leaves_the_import_to_the_first_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preload, "_thread", None)
    monkeypatch.setitem(__import__("sys").modules, "torch._inductor.compile_fx", None)  # import raises ImportError
    compile_accel.start_preloading()
    preload.wait_for_preload()  # returns: the thread logged the error instead of raising it
    assert not preload._thread.is_alive()
