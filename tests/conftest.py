"""Shared pieces: one inductor cache directory per run, a fresh dynamo per test, the embedded
DiT with LoRA, and a LoRA training step that returns the loss and every LoRA gradient."""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

# Compiles of identical graphs across tests hit this cache (.ci/run points it at a per-run dir).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "compile_accel_tests_inductor"))
# Inductor's C++ kernels without line tables (-g1), here and in the processes the tests start
# (bench children, compile workers, the launcher): nothing here debugs them, and they cost the
# compiler time (two parity tests, fresh caches: 119 s of CPU against 127 s with them).
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")
# Inductor's CPU kernels as scalar C++, here and in every process the tests start (bench children,
# torchrun ranks, the launcher, compile workers), read where inductor picks a vector ISA: what the
# tests check (graphs, partitions, parity) does not depend on vectorised code, whose templates take
# the C++ compiler most of a CPU compile's time (the bench test's compiling child: 48 s, was 60 s).
# (Not the sd-scripts trainers' end-to-end runs: sd_scripts_small_common.environment says why.)
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")
# compile_accel's own caches (auto's calibrations, compiled-graph files) start empty in every run:
# an entry left in the user's cache by an earlier run would make a test skip what it measures.
os.environ["COMPILE_ACCEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_accel_tests_cache_")

import pytest
import torch
import torch.nn as nn

from compile_accel import compile_workers
from compile_accel.benchmarks.lora import TINY_DIT_LORA_TARGETS, KohyaStyleLoRANetwork
from compile_accel.benchmarks.tiny_dit import TinyDiT, TinyDiTConfig, make_inputs

PEFT_TARGETS = ["qkv", "img_out", "txt_out", "linear1", "linear2"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Counters and caches of one test never leak into the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def dynamo_recompiles() -> Iterator[list[str]]:
    """The functions dynamo logs as recompiled ("Recompiling function ...", TORCH_LOGS=recompiles)."""
    recompiled: list[str] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Recompiling function"):
                recompiled.append(record.getMessage().splitlines()[0])

    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    recorder = Recorder()
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(recorder)
    yield recompiled
    logger.removeHandler(recorder)
    torch._logging.set_logs()


@pytest.fixture(autouse=True)
def compile_workers_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_workers.first_step_done() marks the whole process (the launcher's tests call it):
    each test starts with the mark as the process had it, no hold, no graph pending and no
    first step seen."""
    monkeypatch.setattr(compile_workers.POOL, "after_first_step", compile_workers.POOL.after_first_step)
    monkeypatch.setattr(compile_workers.HANDED_OVER, "held", set())  # a failed test's hold stays with it
    monkeypatch.setattr(compile_workers.POOL, "kept", weakref.WeakSet())
    # Graphs and jobs a test left in the workers (its model gone) are not the next test's.
    monkeypatch.setattr(compile_workers.HANDED_OVER, "graphs", [])
    monkeypatch.setattr(compile_workers.POOL, "out", [])
    # Each test's graphs are looked up in the caches, whatever the tests before it missed.
    monkeypatch.setattr(compile_workers.POOL, "misses_in_a_row", 0)
    monkeypatch.setattr(compile_workers.HANDED_OVER, "first_step_start", None)
    # A test that killed the workers' pool leaves the next one workers to start.
    monkeypatch.setattr(compile_workers.POOL, "exited", None)


def an_empty_inductor_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An inductor cache of the test's own at `cache`: its graphs compile in the workers, not loaded."""
    from torch._inductor.utils import clear_caches

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    clear_caches()
    torch._dynamo.reset()
    monkeypatch.setattr(compile_workers.POOL, "after_first_step", False)


@pytest.fixture(autouse=True)
def gc_unfrozen():
    """The launcher and the bench freeze what is alive after a first step (compile_accel.gc_freeze):
    a test that runs them in this process leaves the next test's garbage collected as usual."""
    yield
    gc.unfreeze()


# Single-stream blocks only: one block class, whose compile is a fraction of the double-stream
# block's. For tests whose property does not depend on how many block classes compile.
ONE_BLOCK_CLASS = {"double_blocks": 0, "single_blocks": 4}


@pytest.fixture(scope="module")
def sd_scripts() -> Iterator[Path]:
    """A real sd-scripts checkout from $SD_SCRIPTS_DIR, importable (`library`, `networks`) for the
    module; the test is skipped without one."""
    root = os.environ.get("SD_SCRIPTS_DIR")
    if not root:
        pytest.skip("set SD_SCRIPTS_DIR to an sd-scripts checkout")
    sys.path.insert(0, root)
    yield Path(root)
    sys.path.remove(root)


def small_config(**overrides) -> TinyDiTConfig:
    fields = dict(dim=32, heads=4, text_dim=24, double_blocks=2, single_blocks=2, rope="real")
    fields.update(overrides)
    return TinyDiTConfig(**fields)


def build(lora: str = "kohya", checkpointing: str | None = None, **config) -> tuple[TinyDiT, list[nn.Parameter]]:
    """The embedded DiT, frozen, with random-initialised LoRA; returns it and the LoRA parameters.

    checkpointing: None, "reentrant" or "non-reentrant".
    """
    model = TinyDiT(small_config(**config))
    model.requires_grad_(False)
    if lora == "kohya":
        network = KohyaStyleLoRANetwork(model, TINY_DIT_LORA_TARGETS, rank=4, alpha=4, up_init_std=0.05)
        model._test_network = [network]  # keep it alive without making it a submodule
        params = list(network.parameters())
    elif lora == "peft":
        from peft import LoraConfig, inject_adapter_in_model

        inject_adapter_in_model(
            LoraConfig(r=4, lora_alpha=4, target_modules=PEFT_TARGETS, init_lora_weights=False), model
        )
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        raise ValueError(lora)
    model.train()
    if checkpointing is not None:
        model.enable_gradient_checkpointing(use_reentrant=checkpointing == "reentrant")
    return model, params


def inputs_for(model: TinyDiT, **shape) -> tuple[torch.Tensor, ...]:
    return make_inputs(model.config, **shape)


def lora_step(model: nn.Module, params: list[nn.Parameter], inputs: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and every LoRA gradient of one step (gradients cleared afterwards)."""
    loss = model(*inputs).square().mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return loss.detach(), grads


def train_beside(
    model: nn.Module,
    params: list[nn.Parameter],
    reference: nn.Module,
    reference_params: list[nn.Parameter],
    steps: int,
    after_step: Callable[[int], None] | None = None,
    tolerance: float = 1e-3,
) -> None:
    """`steps` SGD steps (lr 0.1) of `model` and `reference` on the same fresh CUDA inputs: each
    loss and LoRA gradient within `tolerance` (relative) of the reference's. `after_step(step)`
    runs after each update."""
    for step in range(steps):
        inputs = tuple(t.cuda() for t in inputs_for(model, res=32, text_len=16))
        loss, grads = lora_step(model, params, inputs)
        expected_loss, expected_grads = lora_step(reference, reference_params, inputs)
        assert relative_error(loss, expected_loss) < tolerance
        assert max(map(relative_error, grads, expected_grads)) < tolerance
        with torch.no_grad():
            for param, grad, reference_param, reference_grad in zip(
                params, grads, reference_params, expected_grads, strict=True
            ):
                param -= 0.1 * grad
                reference_param -= 0.1 * reference_grad
        if after_step is not None:
            after_step(step)


def run_bench(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`compile-accel bench ARGS` in this process: (exit status, stderr)."""
    from compile_accel import cli

    try:
        status = cli.main(["bench", *args])
    except SystemExit as exit_info:  # argparse's refusals
        status = exit_info.code
    return status, capsys.readouterr().err


@pytest.fixture
def no_mode_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a bench mode starts: every refusal comes before."""
    from compile_accel.benchmarks import runner

    def run_ab(*args, **kwargs):
        raise AssertionError("a mode ran")

    monkeypatch.setattr(runner, "run_ab", run_ab)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def as_close_as_eager(compiled: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor) -> bool:
    """Compiled and eager round half precision differently, so both are measured against an
    fp32 reference: the compiled error may be at most twice eager's (plus 1e-3)."""
    return relative_error(compiled, reference) <= 2 * relative_error(eager, reference) + 1e-3
