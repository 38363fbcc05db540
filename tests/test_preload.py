"""The inductor preload: apply() waits for it; a preload that fails leaves the import to the first compile."""

from __future__ import annotations

import logging
import sys
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

    monkeypatch.setattr(preload.PRELOAD, "thread", None)
    monkeypatch.setattr(preload, "preload_inductor", slow_preload)
    model, _ = build()
    compile_accel.start_preloading()
    acceleration = compile_accel.apply(model, CompileConfig(mode="off"))
    assert done.is_set()
    acceleration.remove()


def test_a_failing_preload_logs_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch._inductor.compile_fx", None)  # importing it raises ModuleNotFoundError
    with caplog.at_level(logging.DEBUG, logger="compile_accel"):
        preload.preload_inductor()
    assert "preloading inductor failed: ModuleNotFoundError" in caplog.text
