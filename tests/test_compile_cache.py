"""Cache artifacts carry compiled graphs to a process with an empty inductor cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import torch

from compile_accel.compile_cache import RunCompileCache, load_compile_cache
from compile_accel.dynamo_settings import HAS_CACHE_ARTIFACTS

needs_artifacts = pytest.mark.skipif(not HAS_CACHE_ARTIFACTS, reason="torch without cache artifacts")

PROGRAM = """
import json, sys, torch
from compile_accel.compile_cache import load_compile_cache, save_compile_cache
action, path = sys.argv[1], sys.argv[2]
loaded = load_compile_cache(path) if action == "load" else None

def block(x, w):
    return torch.nn.functional.gelu(x @ w).square().mean(-1)

torch.compile(block)(torch.randn(8, 16), torch.randn(16, 16))
counters = torch._dynamo.utils.counters["inductor"]
saved = save_compile_cache(path) if action == "save" else None
print(json.dumps({"loaded": loaded, "saved": saved, "hits": counters["fxgraph_cache_hit"]}))
"""


def _run(action: str, path: str, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, action, path], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_artifacts
def test_artifacts_give_a_fresh_cache_directory_its_graphs(tmp_path) -> None:
    artifacts = str(tmp_path / "artifacts.bin")
    first = _run("save", artifacts, str(tmp_path / "inductor_a"))
    assert first["saved"] > 0 and first["hits"] == 0
    second = _run("load", artifacts, str(tmp_path / "inductor_b"))  # an empty inductor cache
    assert second["loaded"] is True and second["hits"] > 0


@needs_artifacts
def test_missing_artifacts_file_is_not_an_error(tmp_path) -> None:
    assert load_compile_cache(tmp_path / "none.bin") is False


@needs_artifacts
def test_unreadable_artifacts_file_is_reported_not_loaded(tmp_path) -> None:
    path = tmp_path / "garbage.bin"
    path.write_bytes(b"not a pickle of cache artifacts")
    with pytest.warns(RuntimeWarning, match="could not load"):
        assert load_compile_cache(path) is False


class _ModelWithACompiledBlock(torch.nn.Module):
    """An eager model whose block runs compiled, as compile_accel leaves a model."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        self.__dict__["compiled_block"] = torch.compile(self.block)  # not a submodule: keys unchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compiled_block(x)


def _first_forward(model: torch.nn.Module, compiled: str, inputs: torch.Tensor) -> RunCompileCache:
    """A run's cache after the model's first forward (which keys and loads it)."""
    cache = RunCompileCache(model, compiled)
    model(inputs)
    return cache


@pytest.fixture
def saved_run(tmp_path, monkeypatch) -> tuple[torch.nn.Module, RunCompileCache]:
    """A run that compiled its block and saved the artifacts under its key."""
    monkeypatch.setenv("COMPILE_ACCEL_CACHE_DIR", str(tmp_path))
    model = _ModelWithACompiledBlock()
    cache = _first_forward(model, "config A", torch.randn(4, 8))
    assert cache.loaded is False and cache.save() > 0 and cache.path.is_file()
    assert cache.save() == 0  # nothing compiled since: not written again
    return model, cache


@needs_artifacts
def test_a_run_loads_its_own_entry_and_no_other_config_shape_or_torch(saved_run, monkeypatch) -> None:
    model, first = saved_run
    again = _first_forward(model, "config A", torch.randn(4, 8))
    assert again.path == first.path and again.loaded is True
    assert again.save() == 0  # nothing compiled that the file lacks: not written again
    others = [_first_forward(model, "config B", torch.randn(4, 8)), _first_forward(model, "config A", torch.randn(2, 8))]
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    others.append(_first_forward(model, "config A", torch.randn(4, 8)))
    assert all(other.path != first.path and other.loaded is False for other in others)


@needs_artifacts
@pytest.mark.parametrize("damage", ["garbage", "cut short"])
def test_a_damaged_entry_warns_compiles_again_and_is_rewritten(saved_run, damage) -> None:
    model, first = saved_run
    data = first.path.read_bytes()
    first.path.write_bytes(b"\x80\x04 not artifacts" if damage == "garbage" else data[: len(data) // 2])
    torch._dynamo.reset()
    with pytest.warns(RuntimeWarning, match="could not load"):
        again = _first_forward(model, "config A", torch.randn(4, 8))
    assert again.loaded is False
    assert again.save() > 0
    torch._dynamo.reset()
    assert _first_forward(model, "config A", torch.randn(4, 8)).loaded is True


def test_a_diffusers_models_run_key_is_its_config_and_weights_not_its_bookkeeping() -> None:
    """diffusers lists the arguments that took their defaults in a set's order, which changes with
    each process's string hashing, and where the model was loaded from: neither is in the key
    (with the first, every restart missed its entries). Its config and its weights' dtypes are."""
    pytest.importorskip("diffusers")
    from diffusers import Lumina2Transformer2DModel

    from compile_accel.cache_files import run_key

    def lumina2(hidden_size: int = 32) -> torch.nn.Module:
        return Lumina2Transformer2DModel(
            sample_size=8, in_channels=4, hidden_size=hidden_size, num_layers=1, num_refiner_layers=1,
            num_attention_heads=2, num_kv_heads=1, multiple_of=16, cap_feat_dim=16, axes_dim_rope=(8, 4, 4),
            axes_lens=(8, 8, 8),
        )

    def key(model: torch.nn.Module) -> str:
        return run_key(model, "config A", [torch.zeros(1, 4, 8, 8)], torch.device("cpu"))

    model = lumina2()
    first = key(model)
    defaults = model.config["_use_default_values"]
    assert len(defaults) > 1
    model.register_to_config(_use_default_values=defaults[::-1], _name_or_path="/elsewhere")
    assert key(model) == first
    assert key(lumina2(hidden_size=64)) != first
    assert key(model.to(torch.bfloat16)) != first
