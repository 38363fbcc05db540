"""The README stays a front door: short, with its Quick start near the top, and its commands the
ones CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _ci_command(program: str) -> str:
    """The .ci/run line that runs `program`, without its comment."""
    return next(line for line in CI.splitlines() if line.startswith(program)).split("#")[0].strip()


def test_the_readme_is_under_10_kb_with_its_quick_start_in_the_first_60_lines() -> None:
    assert len(README.encode()) <= 10_000
    assert "## Quick start" in README.splitlines()[:60]


def test_the_readmes_commands_are_the_ones_ci_runs() -> None:
    tests = _ci_command("python3 -m pytest")
    assert tests == "python3 -m pytest -q -n 2 --dist loadfile tests"
    test_setup = _ci_command("python3 -m pip install -q -e").replace(" -q", "")
    assert test_setup == 'python3 -m pip install -e ".[test]"'
    assert f"{test_setup} && {tests}" in README
    torch = _ci_command("python3 -m pip install -q torch").replace(" -q", "")  # (-q only quietens pip)
    assert torch == "python3 -m pip install torch==2.13.0"
    assert f"{torch} -e . && compile-accel bench" in README
