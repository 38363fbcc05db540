"""compile_accel.cache_files on Windows' terms, tested as strings and with a simulated held file:
cache file names Windows accepts, and an atomic replace retried while another process holds the
target (Windows refuses os.replace then)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from compile_accel import cache_files
from compile_accel.cache_files import run_key, write_atomically

# Windows refuses these characters in a file name, a name that is a device, and long paths (260
# characters in all unless long paths are enabled; the cache directory takes part of them).
WINDOWS_FORBIDDEN = re.compile(r'[<>:"/\\|?*\x00-\x1f]')
WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def test_run_keys_make_file_names_windows_accepts() -> None:
    model = torch.nn.Linear(3, 2)
    inputs = [torch.randn(1, 3)]
    key = run_key(model, 'blocks budget="auto": C:\\x|y?*<z>', inputs, torch.device("cpu"), "extra:1")
    for name in (f"{key}.bin", f"{key}.precompiled", "auto_budget.json", f"{key}.bin.{os.getpid()}.tmp"):
        assert not WINDOWS_FORBIDDEN.search(name), name
        assert name.split(".")[0].upper() not in WINDOWS_DEVICES
        assert len(name) < 100
    assert run_key(model, "other", inputs, torch.device("cpu")) != key


def _held(times: int, refused: list[str]):
    """os.replace refused `times` times, as Windows refuses it while another process has the file open."""
    replace = os.replace

    def held_replace(source: str | Path, target: str | Path) -> None:
        if len(refused) < times:
            refused.append(str(target))
            raise PermissionError(13, "The process cannot access the file because it is being used by another process")
        replace(source, target)

    return held_replace


def test_an_atomic_write_is_retried_while_the_file_is_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "entry.bin"
    path.write_bytes(b"old")
    refused: list[str] = []
    monkeypatch.setattr(cache_files.os, "replace", _held(2, refused))
    monkeypatch.setattr(cache_files.time, "sleep", lambda seconds: None)
    write_atomically(path, b"new")
    assert path.read_bytes() == b"new" and refused == [str(path)] * 2
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_a_file_held_past_the_retries_raises_and_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "entry.bin"
    path.write_bytes(b"old")
    refused: list[str] = []
    monkeypatch.setattr(cache_files.os, "replace", _held(10, refused))
    monkeypatch.setattr(cache_files.time, "sleep", lambda seconds: None)
    with pytest.raises(PermissionError):
        write_atomically(path, b"new", tries=3)
    assert path.read_bytes() == b"old" and len(refused) == 3
    assert list(tmp_path.iterdir()) == [path]
