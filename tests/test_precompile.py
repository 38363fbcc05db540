"""Precompiled graphs (compile_accel.precompile): compiled in the compile workers after a first
start, a new start runs them without dynamo's trace, as eager does, and compiles as usual
whatever they do not fit or a damaged file."""

from __future__ import annotations

import concurrent.futures
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error

import compile_accel
from compile_accel import CompileConfig, compile_workers, precompile
from compile_accel.compile_cache import RunCompileCache
from compile_accel.dynamo_settings import HAS_CACHE_ARTIFACTS

pytestmark = pytest.mark.skipif(
    not (precompile.SUPPORTED and HAS_CACHE_ARTIFACTS and compile_workers.SUPPORTED),
    reason="needs torch's aot_compile, cache artifacts and compile workers",
)

CONFIG = CompileConfig(mode="blocks", activation_memory_budget=0.5, compile_workers=2)


def _start(cache_dir: Path) -> tuple[torch.nn.Module, list, compile_accel.Acceleration, RunCompileCache]:
    """A new start (fresh dynamo, same seed, same cache directory): the model accelerated, its run cache."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, params = build("kohya", None, **ONE_BLOCK_CLASS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COMPILE_ACCEL_CACHE_DIR", str(cache_dir))
        acceleration = compile_accel.apply(model, CONFIG)
        cache = RunCompileCache(model, acceleration.signature, acceleration)
        model(*inputs_for(model))  # the first forward keys the cache and loads what it holds
    return model, params, acceleration, cache


@pytest.fixture(scope="module")
def first_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The cache directory after a first start that compiled a step and saved; its graphs."""
    cache_dir = tmp_path_factory.mktemp("first_start")
    model, params, acceleration, cache = _start(cache_dir)
    lora_step(model, params, inputs_for(model))
    cache.save()  # traces for the workers, whose compile is written by a thread
    graphs = acceleration.stats()["unique_graphs"]
    assert graphs > 0 and cache.precompiling.join(timeout=600) == graphs and cache.precompiled_loaded == 0
    return cache_dir, graphs


@pytest.fixture
def cache_dir(first_start: tuple[Path, int], tmp_path: Path) -> Path:
    """A copy of the first start's cache directory, for one test to use or damage."""
    copy = tmp_path / "cache"
    shutil.copytree(first_start[0], copy)
    return copy


def _eager_step(inputs: tuple) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    eager, params = build("kohya", None, **ONE_BLOCK_CLASS)
    return lora_step(eager, params, inputs)


def _assert_as_eager(model: torch.nn.Module, params: list, inputs: tuple) -> None:
    """Loss and LoRA gradients of a step within 1e-4 of eager's (fp32; inductor reorders sums), as test_parity."""
    loss, grads = lora_step(model, params, inputs)
    expected_loss, expected_grads = _eager_step(inputs)
    assert relative_error(loss, expected_loss) < 1e-4
    assert max(map(relative_error, grads, expected_grads)) < 1e-4


def test_a_new_start_runs_the_precompiled_graphs_without_dynamo_and_as_eager(first_start, cache_dir) -> None:
    model, params, acceleration, cache = _start(cache_dir)
    assert cache.precompiled_loaded == first_start[1]
    _assert_as_eager(model, params, inputs_for(model))  # fresh random inputs
    assert acceleration.stats()["unique_graphs"] == 0  # dynamo traced nothing
    assert sum(f.precompiled.used for f in acceleration.functions) == first_start[1]


def test_calls_the_precompiled_graphs_do_not_fit_compile_as_usual(first_start, cache_dir) -> None:
    """A new input shape fails the loaded guards; a forward without grad is not the training
    graph's grad mode: both compile, and both run as eager does."""
    model, params, acceleration, _ = _start(cache_dir)
    _assert_as_eager(model, params, inputs_for(model, res=24))
    assert acceleration.stats()["unique_graphs"] == 1
    inputs = inputs_for(model)
    torch.manual_seed(0)
    eager, _ = build("kohya", None, **ONE_BLOCK_CLASS)
    with torch.no_grad():
        assert relative_error(model(*inputs), eager(*inputs)) < 1e-4
    assert acceleration.stats()["unique_graphs"] == 2


@pytest.mark.parametrize("damage", ["garbage", "cut short"])
def test_a_damaged_file_warns_and_everything_compiles_as_usual(cache_dir, damage: str) -> None:
    (path,) = (cache_dir / "compiled").glob("*.precompiled")
    data = path.read_bytes()
    path.write_bytes(b"\x80\x04 not precompiled" if damage == "garbage" else data[: len(data) // 2])
    with pytest.warns(RuntimeWarning, match="precompile: could not load"):
        model, params, acceleration, cache = _start(cache_dir)
    assert cache.precompiled_loaded == 0
    _assert_as_eager(model, params, inputs_for(model))
    assert acceleration.stats()["unique_graphs"] > 0


def test_the_launcher_says_how_many_graphs_ran_precompiled(first_start, cache_dir, capsys) -> None:
    from compile_accel.integrations import sd_scripts

    model, params, acceleration, cache = _start(cache_dir)
    lora_step(model, params, inputs_for(model))
    launch = sd_scripts.Launch()
    launch.acceleration, launch.compile_cache = acceleration, cache
    launch.first_step_done()
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "first step done" in line]
    assert f", {first_start[1]} of them precompiled at an earlier start (run without dynamo's trace)" in line


def test_a_graph_traced_from_source_changed_since_is_not_loaded(cache_dir, monkeypatch, caplog) -> None:
    """A newer sd-scripts or LoRA network: the saved graph would run the old code."""
    module_lines = precompile.module_lines
    monkeypatch.setattr(precompile, "module_lines", lambda name: [f"{line} " for line in module_lines(name)])
    with caplog.at_level("INFO", logger="compile_accel"):
        model, params, acceleration, cache = _start(cache_dir)
    assert cache.precompiled_loaded == 0 and "changed since it was saved" in caplog.text
    _assert_as_eager(model, params, inputs_for(model))
    assert acceleration.stats()["unique_graphs"] > 0


def test_an_entry_torch_cannot_load_is_left_out_and_written_anew(first_start, cache_dir) -> None:
    """The file reads, one graph in it does not (another Python or Triton): that start compiles
    as usual and precompiles again; the start after it loads the new graph."""
    (path,) = (cache_dir / "compiled").glob("*.precompiled")
    saved = pickle.loads(path.read_bytes())
    for entries in saved["functions"].values():
        entries[:] = [(*entry[:3], b"not a graph") for entry in entries]
    path.write_bytes(pickle.dumps(saved))
    model, params, acceleration, cache = _start(cache_dir)
    assert cache.precompiled_loaded == 0
    _assert_as_eager(model, params, inputs_for(model))
    cache.save()
    assert cache.precompiling.join(timeout=600) == first_start[1]
    assert _start(cache_dir)[3].precompiled_loaded == first_start[1]


def test_precompiles_cut_short_at_exit_leave_the_file_another_run_wrote(
    first_start, cache_dir, monkeypatch, caplog
) -> None:
    """A training that ends right after save(): the exit closes the worker pool, which fails each
    pending precompile. The file another run wrote on this cache directory meanwhile (after this
    run found none) keeps its graphs instead of being replaced by one without."""
    (path,) = (cache_dir / "compiled").glob("*.precompiled")
    good = path.read_bytes()
    path.unlink()
    model, params, acceleration, cache = _start(cache_dir)
    lora_step(model, params, inputs_for(model))
    path.write_bytes(good)  # the other run's file

    def closed_at_exit(*job: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(RuntimeError("SubprocPool closed"))  # what the pool's shutdown gives a pending job
        return future

    monkeypatch.setattr(compile_workers.POOL, "submit", closed_at_exit)
    with caplog.at_level("INFO", logger="compile_accel"):
        cache.save()
        assert cache.precompiling.join(timeout=600) == first_start[1]
    assert path.read_bytes() == good and "than this run precompiled; kept" in caplog.text
    assert _start(cache_dir)[3].precompiled_loaded == first_start[1]


def test_a_loaded_graph_runs_with_keywords_flagged_as_a_compiled_call() -> None:
    """sd-scripts' Flux calls its blocks with keywords; the offload conductor asks whether a
    compiled call is running."""
    from compile_accel.backend import compiled_call_running, flagged

    seen = []

    def graph(x: int, *, scale: int) -> int:
        seen.append(compiled_call_running())
        return x * scale

    assert flagged(graph)(2, scale=3) == 6 and seen == [True] and not compiled_call_running()


def test_graphs_compiled_after_auto_calibrated_here_are_precompiled_and_run_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto's traced estimate (its joint graphs) hangs off the blocks' regions, and dynamo's saved
    guards pickle the blocks it traced: the graphs of the chosen budget are still written (sd-scripts'
    SDXL under auto on an H200: every one was left out with a PicklingError), and the next start,
    its choice cached, runs them."""
    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path))
    auto = CompileConfig(mode="blocks", activation_memory_budget="auto", vram_limit_gib=1.0, compile_workers=2)

    def start() -> tuple[torch.nn.Module, list, compile_accel.Acceleration, RunCompileCache]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, params = build("kohya", None, **ONE_BLOCK_CLASS)
        acceleration = compile_accel.apply(model, auto)
        return model, params, acceleration, RunCompileCache(model, acceleration.signature, acceleration)

    model, params, acceleration, cache = start()
    inputs = inputs_for(model)
    for _ in range(10):  # the prediction, then the candidate measured once back from the workers
        lora_step(model, params, inputs)
        if acceleration.auto_budget.result is not None:
            break
        compile_workers.wait()
    assert acceleration.auto_budget.result is not None
    cache.save()
    assert cache.precompiling is not None
    written = cache.precompiling.join(timeout=600)
    assert 0 < written <= acceleration.stats()["unique_graphs"]

    model, params, acceleration, cache = start()
    lora_step(model, params, inputs_for(model))
    assert acceleration.auto_budget.result["cached"] and cache.precompiled_loaded == written
    assert sum(f.precompiled.used for f in acceleration.functions) == written


def test_diffusers_blocks_precompile_and_a_new_start_runs_them_as_eager(tmp_path: Path, monkeypatch) -> None:
    """diffusers' Attention reads its processor's signature; dynamo guards the identity of that
    `__call__`'s code, which torch cannot save: such guards are left out of the saved graph (every
    diffusers Lumina 2 block was left out on an H200), and the graph still runs as eager. A small
    SD3 of one block (the same Attention; one graph for the workers, where two blocks gave two)
    keeps the compile short."""
    from test_diffusers import LORA, _sd3, _step

    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path))

    def start() -> tuple[torch.nn.Module, list, tuple, compile_accel.Acceleration, RunCompileCache]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, inputs = _sd3(layers=1)
        model.requires_grad_(False)
        model.add_adapter(LORA)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        inputs = tuple(inputs.values())
        acceleration = compile_accel.apply(model, CONFIG)
        return model, params, inputs, acceleration, RunCompileCache(model, acceleration.signature, acceleration)

    model, params, inputs, acceleration, cache = start()
    _step(model, params, inputs)
    cache.save()
    graphs = acceleration.stats()["unique_graphs"]
    assert graphs > 0 and cache.precompiling is not None and cache.precompiling.join(timeout=600) == graphs

    model, params, inputs, acceleration, cache = start()
    inputs = tuple(torch.randn_like(t) for t in inputs)  # fresh
    loss, grads = _step(model, params, inputs)
    assert cache.precompiled_loaded == graphs and acceleration.stats()["unique_graphs"] == 0
    acceleration.remove()
    expected_loss, expected_grads = _step(model, params, inputs)
    assert relative_error(loss, expected_loss) < 1e-4
    assert max(map(relative_error, grads, expected_grads)) < 1e-4


def test_saved_guards_leave_out_what_torch_cannot_save_and_keep_the_rest() -> None:
    from torch._dynamo.types import GuardFilterEntry

    def entry(guard_type: str, derived: tuple[str, ...] = (), is_global: bool = False) -> GuardFilterEntry:
        return GuardFilterEntry("L['x']", False, None, guard_type, derived, is_global, None)

    entries = [
        entry("TENSOR_MATCH"),
        entry("TYPE_MATCH"),
        entry("TENSOR_MATCH", is_global=True),  # on a module global, as aot_compile's own filter
        entry("ID_MATCH"),  # a kind torch cannot save
        entry("CONSTANT_MATCH", ("ID_MATCH", "ID_MATCH")),  # a code object's identity (diffusers' Attention)
        entry("CONSTANT_MATCH"),
        entry("TENSOR_MATCH", ("ID_MATCH",)),  # a tensor matched by identity: kept, its save fails as before
    ]
    assert precompile.saved_guards(entries) == [True, True, False, False, False, True, True]
