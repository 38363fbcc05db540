"""Cache artifacts carry compiled graphs to a process with an empty inductor cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from compile_accel.compile_cache import load_compile_cache
from compile_accel.dynamo_settings import HAS_CACHE_ARTIFACTS

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


@pytest.mark.skipif(not HAS_CACHE_ARTIFACTS, reason="torch without cache artifacts")
def test_artifacts_give_a_fresh_cache_directory_its_graphs(tmp_path) -> None:
    artifacts = str(tmp_path / "artifacts.bin")
    first = _run("save", artifacts, str(tmp_path / "inductor_a"))
    assert first["saved"] > 0 and first["hits"] == 0
    second = _run("load", artifacts, str(tmp_path / "inductor_b"))  # an empty inductor cache
    assert second["loaded"] is True and second["hits"] > 0


@pytest.mark.skipif(not HAS_CACHE_ARTIFACTS, reason="torch without cache artifacts")
def test_missing_artifacts_file_is_not_an_error(tmp_path) -> None:
    assert load_compile_cache(tmp_path / "none.bin") is False


@pytest.mark.skipif(not HAS_CACHE_ARTIFACTS, reason="torch without cache artifacts")
def test_unreadable_artifacts_file_is_reported_not_loaded(tmp_path) -> None:
    path = tmp_path / "garbage.bin"
    path.write_bytes(b"not a pickle of cache artifacts")
    with pytest.warns(RuntimeWarning, match="could not read"):
        assert load_compile_cache(path) is False
