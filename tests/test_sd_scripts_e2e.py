"""sd-scripts' LoRA trainers, unmodified, end to end on the CPU through the launcher.

flux_train_network.py, sdxl_train_network.py, sd3_train_network.py, lumina_train_network.py,
anima_train_network.py, hunyuan_image_train_network.py and train_network.py (SD 1.x, and SD 2.x
with --v2) each train 3 LoRA steps on small random checkpoints (tests/sd_scripts_small_<model>.py
shrinks the model factories in the training process and writes the workspace), four ways: plain,
SDSCRIPTS_SELECTIVE_TORCH_COMPILE=1, --activation_memory_budget 0.5, and that with
--compile_workers 2; HunyuanImage also with --fp8_scaled, plain and with the budget; Anima with
sd-scripts' own --compile too, where the checkout has it (newer than the sd3 branch). A compiled
run must save the LoRA keys, shapes and dtypes of its plain run, see the plain run's loss at
every step (same seed), and compile every region it made. Needs $SD_SCRIPTS_DIR (a checkout of
sd-scripts' sd3 branch at 3265f2ed or its main at c162e903, with its requirements installed:
.ci/e2e builds that environment); skipped without.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")
pytestmark = pytest.mark.skipif(not SD_SCRIPTS_DIR, reason="set SD_SCRIPTS_DIR to an sd-scripts checkout")

TRAINERS = ["sdxl", "lumina", "flux", "sd3", "sd15", "sd2", "anima", "hunyuan_image"]  # the slowest to compile first
STEPS = 3
# What each run adds to the trainer's arguments: an environment variable, flags (the launcher's, the script's).
MODES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "plain": ({}, ()),
    "selective": ({"SDSCRIPTS_SELECTIVE_TORCH_COMPILE": "1"}, ()),
    "budget": ({}, ("--activation_memory_budget", "0.5")),
    # Each graph compiled in one of 2 worker processes; the steps run graphs not back yet uncompiled.
    # No cache: graphs another run compiled would load from it and never reach the workers.
    "workers": ({}, ("--activation_memory_budget", "0.5", "--compile_workers", "2", "--no_compile_cache")),
    # The trainers with sd-scripts' scaled fp8 weights (each Linear's forward patched to dequantize).
    "fp8_scaled": ({}, ("--fp8_scaled",)),
    "fp8_scaled_budget": ({}, ("--fp8_scaled", "--activation_memory_budget", "0.5")),
    # With sd-scripts' own per-block compile, which the launcher turns off.
    "their_compile_budget": ({}, ("--compile", "--activation_memory_budget", "0.5")),
}
BASELINE = {"fp8_scaled_budget": "fp8_scaled"}  # the run a compiled mode is compared with, if not plain
FP8_SCALED_TRAINERS = ["hunyuan_image"]  # (anima_train_network.py has the flag commented out)
# sd-scripts' own --compile: Anima's, in kohya-ss/sd-scripts' main since 2026-06 (not the sd3 branch at 3265f2ed).
OWN_COMPILE_TRAINERS = ["anima"]
_ANIMA_HELPERS = Path(SD_SCRIPTS_DIR or ".") / "library" / "anima_train_utils.py"
HAS_OWN_COMPILE = _ANIMA_HELPERS.is_file() and '"--compile"' in _ANIMA_HELPERS.read_text()
# Every trainer: LoRA on the DiT/U-Net only (the harnesses whose script can cache the text
# encoders' outputs ask for it), fp32 on the CPU, one batch of both images a step, 3 steps.
COMMON_ARGS = [
    *("--save_model_as", "safetensors", "--network_dim", "4", "--network_alpha", "4", "--network_train_unet_only"),
    *("--learning_rate", "1e-2", "--optimizer_type", "AdamW", "--lr_scheduler", "constant"),
    *("--max_train_steps", str(STEPS), "--mixed_precision", "no", "--gradient_checkpointing", "--seed", "0"),
    *("--cache_latents", "--max_data_loader_n_workers", "0"),
]
# Compiled and eager fp32 kernels round differently (fused reductions, other summation orders):
# a step's loss differs by a few float32 ulps (up to 3e-7 relative seen), also from the second
# step on, when the LoRA weights were moved by slightly different gradients. 1e-5 leaves room
# for that and stays far below what training changes: at this learning rate the second and
# third steps' losses of each trainer move by 1e-3 to 9e-3 relative against a run that does not
# train (learning rate 1e-12), so a LoRA update left out or made from a wrong gradient fails.
LOSS_TOLERANCE = 1e-5
# The saved LoRA weights, per tensor (relative norm of the difference). Adam scales each
# gradient element by its own running magnitude, so an element whose gradient is near zero moves
# by about the learning rate whatever its size, and rounding can flip its sign: up to 1e-3 seen
# (SDXL). A tensor trained on a wrong gradient, or not trained, is off by about 1.
WEIGHT_TOLERANCE = 1e-2
RUN_TIMEOUT = 1200  # seconds for one run (the slowest, SDXL compiled, take a few minutes)


@dataclass
class Run:
    log: str  # the script's stdout and stderr
    seconds: float
    losses: list[float]
    lora: dict[str, tuple[list[int], str]]  # key: (shape, dtype) in the saved file
    weights: Path  # the saved file
    stats: dict[str, object] | None  # compile_accel's stats of the model at exit (None: nothing accelerated)


Runs = dict[tuple[str, str], Run | Exception]  # by (trainer, mode): the run, or why it failed

@pytest.fixture(scope="module")
def sd_scripts(sd_scripts: Path) -> Path:
    """conftest's checkout, with the tokenizers the harnesses write."""
    pytest.importorskip("tokenizers")
    return sd_scripts


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, sd_scripts: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every run the selected tests read, made once, as many at a time as there are cores:
    compiling is mostly one core's work (tracing, one C++ compiler at a time). A run that failed
    maps to its exception, which the tests that read the run raise."""
    wanted = _wanted(request.session)
    workspaces = {}
    for trainer in dict.fromkeys(trainer for trainer, _ in wanted):
        harness = importlib.import_module(f"sd_scripts_small_{trainer}")
        workspaces[trainer] = harness, harness.make_workspace(tmp_path_factory.mktemp(trainer))

    def run(job: tuple[str, str]) -> Run | Exception:
        try:
            return _train(sd_scripts, *workspaces[job[0]], job[1])
        except Exception as failure:  # noqa: BLE001 - reported by the tests that read this run
            return failure

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        return dict(zip(wanted, pool.map(run, wanted)))


def _wanted(session: pytest.Session) -> list[tuple[str, str]]:
    """(trainer, mode) of the runs this module's selected tests read (not those skipped by a
    mark), the compiled ones first."""
    wanted = set()
    for item in session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        skipped = any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))
        if getattr(item, "module", None) is sys.modules[__name__] and params and not skipped:
            mode = params.get("mode", "plain")
            wanted |= {(params["trainer"], BASELINE.get(mode, "plain")), (params["trainer"], mode)}
    baselines = ("plain", *BASELINE.values())
    return sorted(wanted, key=lambda job: (job[1] in baselines, TRAINERS.index(job[0]), job[1]))


def _train(sd_scripts: Path, harness: ModuleType, paths: dict[str, Path], mode: str) -> Run:
    """The trainer's script, run through its harness and the launcher in a process of its own."""
    from safetensors import safe_open
    from sd_scripts_small_common import environment

    env, flags = MODES[mode]
    out = paths["dataset"].parent / mode
    out.mkdir()
    args = [
        *harness.train_args(paths),
        *COMMON_ARGS,
        *("--dataset_config", str(paths["dataset"]), "--output_dir", str(out), "--output_name", "lora"),
        *flags,
    ]
    command = [sys.executable, harness.__file__, "--record", str(out), "--sd-scripts", str(sd_scripts)]
    # One thread a process: runs share the cores, and OpenMP threads that wait for a busy core
    # spin (steps of a fraction of a second took seconds with more threads than cores).
    if mode == "workers":  # an inductor cache of its own, for the reason above
        env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor")}
    env = environment(sd_scripts, paths["hub"], OMP_NUM_THREADS="1", **env)
    start = time.perf_counter()
    with (out / "log").open("w") as log:
        proc = subprocess.run(
            [*command, harness.SCRIPT, *args], cwd=sd_scripts, env=env, stdout=log, stderr=log, timeout=RUN_TIMEOUT
        )
    seconds, text = time.perf_counter() - start, (out / "log").read_text()
    assert proc.returncode == 0, text[-5000:]
    with safe_open(out / "lora.safetensors", "pt") as file:
        lora = {k: (file.get_slice(k).get_shape(), file.get_slice(k).get_dtype()) for k in file.keys()}
    losses = [json.loads(line) for line in (out / "losses").read_text().splitlines()]
    stats = json.loads((out / "stats.json").read_text()) if (out / "stats.json").exists() else None
    return Run(text, seconds, losses, lora, out / "lora.safetensors", stats)


def _run(runs: Runs, trainer: str, mode: str) -> Run:
    result = runs[trainer, mode]
    if isinstance(result, Exception):
        raise result
    return result


# The launcher's lines: the regions it made, and at exit what became of them.
REGIONS = re.compile(r"^compile_accel: \w+ compile of \w+ .*: (\d+) regions$", re.M)
SUMMARY = re.compile(
    r"^compile_accel: compiled_regions=(\d+), unique_graphs=\d+, recompiles=(\d+), graph_breaks=(\d+), "
    r"compile_seconds=[\d.]+, fallbacks=(.*)$",
    re.M,
)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_plain_run_trains_without_compile_accel(runs: Runs, trainer: str) -> None:
    """The baseline: every step's loss recorded and finite, LoRA saved, nothing compiled."""
    run = _run(runs, trainer, "plain")
    print(f"{trainer} plain: {run.seconds:.1f} s, losses {run.losses}")
    assert len(run.losses) == STEPS and all(math.isfinite(loss) for loss in run.losses)
    assert run.lora and all(dtype == "F32" for _, dtype in run.lora.values())
    assert run.stats is None and "compile_accel:" not in run.log


@pytest.mark.parametrize("mode", ["selective", "budget", "workers"])
@pytest.mark.parametrize("trainer", TRAINERS)
def test_compiled_run_trains_as_plain(runs: Runs, trainer: str, mode: str) -> None:
    """The plain run's LoRA file layout and, within tolerances, its loss at every step and its
    saved weights; every region compiled and called, no graph compiled twice or broken (the
    acceleration's stats at exit, the launcher's exit report, and no warning of it)."""
    _assert_trains_as(runs, trainer, mode)


@pytest.mark.parametrize("mode", ["fp8_scaled_budget"])
@pytest.mark.parametrize("trainer", FP8_SCALED_TRAINERS)
def test_compiled_run_with_fp8_scaled_weights_trains_as_its_plain_run(runs: Runs, trainer: str, mode: str) -> None:
    """--fp8_scaled (float8 weights, each Linear's forward patched to dequantize them) with the
    budget: as the plain --fp8_scaled run, every region compiled, no recompile or graph break."""
    _assert_trains_as(runs, trainer, mode)


@pytest.mark.skipif(not HAS_OWN_COMPILE, reason="this sd-scripts has no --compile of its own (sd3 at 3265f2ed)")
@pytest.mark.parametrize("mode", ["their_compile_budget"])
@pytest.mark.parametrize("trainer", OWN_COMPILE_TRAINERS)
def test_sd_scripts_own_compile_is_off_where_the_launcher_compiles(runs: Runs, trainer: str, mode: str) -> None:
    """sd-scripts' own per-block --compile (Anima's, library/anima_train_utils.py) with the
    budget: one log line says it is off, and the run trains as plain with every region compiled
    once, by compile_accel alone."""
    _assert_trains_as(runs, trainer, mode)
    line = "compile_accel: sd-scripts' own --compile is off: compile_accel compiles the blocks (blocks mode)"
    assert _run(runs, trainer, mode).log.count(line) == 1


def _assert_trains_as(runs: Runs, trainer: str, mode: str) -> None:
    from safetensors.torch import load_file

    plain, run = _run(runs, trainer, BASELINE.get(mode, "plain")), _run(runs, trainer, mode)
    if "--fp8_scaled" in MODES[mode][1]:  # taken by both runs' loader (a line rich may wrap)
        assert all(re.search(r"fp8_scaled:\s+True", r.log) for r in (plain, run)), run.log[-5000:]
    assert run.lora == plain.lora and len(run.losses) == STEPS
    losses = [abs(a - b) / abs(b) for a, b in zip(run.losses, plain.losses)]
    got, want = load_file(run.weights), load_file(plain.weights)
    weights = {key: ((got[key] - w).norm() / w.norm().clamp_min(1e-30)).item() for key, w in want.items()}
    print(f"{trainer} {mode}: {run.seconds:.1f} s, loss differences {losses}, weights {max(weights.values()):.2g}")
    assert max(losses) <= LOSS_TOLERANCE, (run.losses, plain.losses)
    assert max(weights.values()) <= WEIGHT_TOLERANCE, weights
    stats = run.stats
    assert stats is not None and stats["mode"] == ("selective" if mode == "selective" else "blocks"), stats
    assert stats["compiled_regions"] == stats["regions"] > 0 and stats["uncalled_regions"] == [], stats
    assert (stats["recompiles"], stats["graph_breaks"], stats["fallbacks"]) == (0, 0, []), stats
    # With workers every graph went to them (back or not by the end of these 3 steps), none failed.
    assert stats["worker_failures"] == [], stats
    assert (stats["worker_graphs_started"] > 0) == (mode == "workers"), stats
    # What a user sees: the regions made, the exit report, and no warning of regions never called.
    assert REGIONS.findall(run.log) == [str(stats["regions"])], run.log[-5000:]
    assert SUMMARY.findall(run.log) == [(str(stats["compiled_regions"]), "0", "0", "[]")], run.log[-5000:]
    assert "regions were not called" not in run.log, run.log[-5000:]
    # Graphs still out in the workers at exit (a run shorter than their compile) end with the pool.
    assert "pool process exited" not in run.log, run.log[-5000:]
