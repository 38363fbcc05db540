"""compile-accel doctor and bench, as a user runs them."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import run_bench

from compile_accel import cli
from compile_accel.benchmarks import runner
from compile_accel.benchmarks.measure import kernel_kind
from compile_accel.benchmarks.modes import MODES_HELP, parse_mode
from compile_accel.benchmarks.report import gpu_time_table
from compile_accel.benchmarks.runner import BenchSettings, StepResult, run_mode
from compile_accel.compile_profile import PHASES, CompileTimes


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compile_accel.cli", *args], capture_output=True, text=True, env={**os.environ, **env}
    )


# The bench model at small latents and one sample: its steps cost little next to its compile, and
# what the bench tests check does not depend on the shape.
SMALL = {"res": 64, "batch": 1}
SMALL_FLAGS = [arg for name, value in SMALL.items() for arg in (f"--{name}", str(value))]


def test_doctor_reports_a_usable_setup() -> None:
    proc = _cli("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "budget knob      yes" in proc.stdout and "eager backward   yes" in proc.stdout
    assert proc.stdout.strip().endswith("usable")


def test_doctor_names_a_missing_compiler_from_cxx() -> None:
    proc = _cli("doctor", CXX="/nonexistent/g++")
    assert proc.returncode == 1
    assert "C++ compiler     not found" in proc.stdout
    assert "no C++ compiler" in proc.stderr and "/nonexistent/g++" in proc.stderr


def test_doctor_hints_at_byte_compiling_a_torch_that_has_no_bytecode(tmp_path, monkeypatch) -> None:
    """A module without __pycache__ where Python writes none: every process compiles its source
    again; doctor says how to byte-compile. With the bytecode written, nothing to say."""
    import py_compile

    source = tmp_path / "compilerish_passes.py"  # top level: finding it imports nothing
    source.write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    modules = ("compilerish_passes",)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert cli.bytecode_status(modules) == ("not yet (the first import writes it)", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    text, hint = cli.bytecode_status(modules)
    assert text.startswith("no") and "PYTHONDONTWRITEBYTECODE" in hint
    assert f"python -m compileall -q {os.path.dirname(torch.__file__)}" in hint
    py_compile.compile(str(source), doraise=True)
    assert cli.bytecode_status(modules) == ("yes", None)


def _install_fake_triton(site: Path, distribution: str, version: str, module_version: str) -> None:
    """A `triton` module provided by the wheel `distribution` (metadata as pip writes it), in `site`."""
    (site / "triton").mkdir()
    (site / "triton" / "__init__.py").write_text(f"__version__ = {module_version!r}\n")
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"triton/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.mark.parametrize(
    "distribution, version, reported",
    [
        ("triton-windows", "3.3.1.post19", "3.3.1.post19 (triton-windows, the Windows build)"),
        ("triton", "3.3.1", "3.3.1"),
    ],
)
def test_doctor_names_the_distribution_that_provides_triton(
    tmp_path, monkeypatch, distribution: str, version: str, reported: str
) -> None:
    """triton-windows installs the `triton` module, whose own version string lacks the build's."""
    module_version = version if distribution == "triton" else "3.3.0"  # triton-windows: not its wheel's version
    _install_fake_triton(tmp_path, distribution, version, module_version)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "triton", None)  # its undo removes the fake (inductor would import it)
    del sys.modules["triton"]
    importlib.invalidate_caches()
    assert cli.triton_status() == (reported, None)


def test_doctor_asks_windows_users_for_triton_windows(monkeypatch) -> None:
    # Inductor's C++ code generation reads sys.platform once, at its import (which this test's
    # patches set off): imported now, a later compile in this process writes Linux code.
    importlib.import_module("torch._inductor.codegen.cpp")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "platform", "win32")
    version, problem = cli.triton_status()
    assert version == "not installed" and "(pip install triton-windows)" in problem


@pytest.mark.parametrize("platform, gpu", [("win32", True), ("win32", False), ("linux", True)])
def test_doctor_on_windows_with_a_gpu_and_no_msvc_says_what_dynamic_shapes_need(monkeypatch, platform, gpu) -> None:
    """triton-windows compiles fixed-shape GPU graphs without MSVC: a hint naming what to install,
    not a problem; without a GPU (inductor's CPU code) or elsewhere, a missing compiler is one."""
    importlib.import_module("torch._inductor.codegen.cpp")  # (see the test above)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(sys, "platform", platform)
    problem, hint = cli.missing_compiler_status("cl is not found")
    if platform == "win32" and gpu:
        assert problem is None and "Visual Studio 2022 Build Tools" in hint and "--compile_dynamic true" in hint
    else:
        assert hint is None and problem.startswith("no C++ compiler: inductor needs one")
    assert cli.missing_compiler_status(None) == (None, None)


# One bench run with a row of each kind (eager, compiled, offload, data-parallel, split), read by
# several tests: each mode is a child process that builds and compiles the model.
BENCH_MODES = [
    "eager+ckpt",
    "blocks+budget=1.0",
    "eager+ckpt+offload=0.5",
    "blocks+budget=1.0+ddp=2",
    "blocks+budget=1.0+split=2",
]


@dataclass
class BenchRun:
    proc: subprocess.CompletedProcess
    results: dict[str, dict]  # mode -> its row of bench.json
    report: dict
    out: Path


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    out = tmp_path_factory.mktemp("bench")
    modes = ",".join(BENCH_MODES)
    # torchrun starts the +ddp processes with OMP_NUM_THREADS=1, and inductor's C++ kernels are
    # written for the thread count: with one thread in every mode, the +ddp and +split rows find
    # the kernels the one-process row compiled in the inductor cache.
    flags = ["--steps", "2", "--warmup", "1", *SMALL_FLAGS, "--out", str(out)]
    proc = _cli("bench", "--modes", modes, *flags, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "bench.json").read_text())
    return BenchRun(proc, {r["mode"]: r for r in report["results"]}, report, out)


def test_bench_runs_each_mode_and_writes_json(bench_run: BenchRun) -> None:
    proc, results = bench_run.proc, bench_run.results
    assert "[1/5] eager+ckpt" in proc.stderr and "[2/5] blocks+budget=1.0" in proc.stderr  # progress
    assert list(results) == BENCH_MODES
    assert all(r["step_s_median"] > 0 and r["peak_bytes"] > 0 for r in results.values())
    assert all(len(r["step_s_each"]) == 2 and min(r["step_s_each"]) == r["step_s_min"] for r in results.values())
    assert results["blocks+budget=1.0"]["stats"]["compiled_regions"] > 0
    assert results["eager+ckpt"]["stats"]["regions"] == 0
    # As the launcher: a compiled mode's process froze what was alive after its first step, eager's did not.
    assert results["blocks+budget=1.0"]["stats"]["gc_freeze"]["objects"] > 0
    assert "gc_freeze" not in results["eager+ckpt"]["stats"]
    offload = results["eager+ckpt+offload=0.5"]["stats"]["offload"]
    assert offload["streamed_blocks"] == 3 and offload["bytes_to_device_per_step"] > 0
    assert "| blocks+budget=1.0 |" in proc.stdout and "vs eager+ckpt" in proc.stdout
    tables = (bench_run.out / "bench.md").read_text().strip().split("\n\n")
    # Header, rule and a row per mode; the offload row; the data-parallel and split rows.
    assert [table.count("\n") for table in tables] == [6, 2, 3]
    assert bench_run.report["environment"]["torch"]


def test_bench_warm_column_comes_from_a_second_child_on_the_cache_the_cold_one_filled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """--warm: a mode's first child compiles into an empty inductor cache of its own, a second
    child runs one step on it. The children are stand-ins here (a real cold compile of the bench
    model took 95 s of the suite): each reports a hit per file it finds in the cache and leaves one.
    """
    children: list[tuple[BenchSettings, str, bool, Path | None]] = []

    def run_child(mode: str, settings: BenchSettings, env: dict[str, str], log: Path | None) -> dict:
        cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
        hits = len(list(cache.iterdir()))
        children.append((settings, str(cache), hits == 0, log))
        (cache / f"graph{len(children)}").touch()
        times = CompileTimes(dict.fromkeys(PHASES, 1.0), 0.0, int(hits == 0), hits, 0).as_dict()
        row = StepResult(
            mode, settings.model, "stand-in", settings.device, settings.steps, 0.5, 0.5, [0.5] * settings.steps,
            first_step_s=10.0 - 8.0 * hits, peak_bytes=2**20, peak_kind="activation bytes saved for backward",
            reserved_bytes=None, loss=0.5, stats={"fxgraph_cache_hits": hits, "compile_times": times},
        )  # fmt: skip
        return dataclasses.asdict(row)

    monkeypatch.setattr(runner, "_run_child", run_child)
    flags = ["--steps", "3", "--warmup", "2", "--warm", "--out", str(tmp_path)]
    status, _ = run_bench(capsys, "--modes", "blocks+budget=1.0", *flags)
    assert status == 0
    (cold, cache, cold_empty, log), (warm, warm_cache, warm_empty, warm_log) = children
    assert cold_empty and not warm_empty and warm_cache == cache != os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    assert (cold.steps, cold.warmup, warm.steps, warm.warmup) == (3, 2, 1, 0)
    assert log == warm_log == tmp_path / "blocks+budget=1.0.log"  # both children's standard error kept
    assert not Path(cache).exists()  # the mode's cache goes with it
    result = json.loads((tmp_path / "bench.json").read_text())["results"][0]
    assert result["stats"]["fxgraph_cache_hits"] == 0 and result["warm_fxgraph_cache_hits"] == 1
    assert result["first_step_s"] == 10.0 and result["warm_first_step_s"] == 2.0
    assert "warm first step s" in (tmp_path / "bench.md").read_text()


def test_bench_refuses_an_unknown_mode_before_running(capsys, no_mode_runs) -> None:
    status, err = run_bench(capsys, "--modes", "eager+ckpt,turbo")
    assert status == 2
    assert f"unknown mode 'turbo'; modes: {MODES_HELP}" in err


def test_the_mode_grammar_in_the_docs_is_the_help_text() -> None:
    """docs/bench.md quotes MODES_HELP (the --modes help and an unknown mode's error), so the
    grammar cannot change in one place only; line breaks do not count."""
    docs = (Path(__file__).parents[1] / "docs" / "bench.md").read_text()
    assert MODES_HELP in " ".join(docs.split())


@pytest.mark.parametrize(
    "flag, value, wanted",
    [
        ("--steps", "0", ">= 1"),
        ("--profile-steps", "-1", ">= 1"),
        ("--profile-steps", "two", ">= 1"),
        ("--warmup", "-1", ">= 0"),
        ("--batch", "0", ">= 1"),
        ("--lora-rank", "0", ">= 1"),
        ("--res", "40", ">= 16 that is a multiple of 16"),
    ],
)
def test_bench_refuses_counts_out_of_range(capsys, no_mode_runs, flag: str, value: str, wanted: str) -> None:
    status, err = run_bench(capsys, flag, value)
    assert status == 2
    assert f"argument {flag}: expected a whole number {wanted}, got '{value}'" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--modes", "blocks+auto", "--device", "cpu"], "blocks+auto on the CPU needs --vram-limit-gib"),
        (["--device", "cpu", "--compile-workers-wait"], "--compile-workers-wait waits for the compile workers: give "
         "--compile-workers N too"),
        (["--modes", "blocks+auto", "--device", "cpu", "--vram-limit-gib", "1", "--compile-workers", "2",
          "--compile-workers-wait"], "--compile-workers-wait: blocks+auto measures its candidates in the steps after"),
        pytest.param(
            ["--device", "cuda"],
            "sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),
        ),
    ],
)
def test_bench_refuses_what_cannot_run_before_running_a_mode(
    capsys, no_mode_runs, flags: list[str], message: str
) -> None:
    status, err = run_bench(capsys, "--modes", "eager+ckpt", *flags)  # a later --modes wins
    assert status == 2
    assert message in err  # and no mode started (no_mode_runs)


@pytest.mark.parametrize("flags", [["--mode", "selective", "--budget", "0.5"], ["--budget", "1.5"]])
def test_offload_memory_refuses_a_bad_budget_before_building_the_model(flags: list[str], monkeypatch, capsys) -> None:
    from compile_accel.benchmarks import offload_memory

    monkeypatch.setattr(offload_memory, "MODELS", {"flux": None})  # calling it would raise TypeError
    with pytest.raises(SystemExit) as exit_info:
        offload_memory.main(["--model", "flux", *flags])
    assert exit_info.value.code == 2
    assert "activation_memory_budget" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, mode, budget, ckpt",
    [
        ("eager+ckpt", "off", None, True),
        ("selective+ckpt", "selective", None, True),
        ("blocks+budget=0.25", "blocks", 0.25, False),
    ],
)
def test_parse_mode(spec: str, mode: str, budget: float | None, ckpt: bool) -> None:
    parsed = parse_mode(spec)
    assert (parsed.config.mode, parsed.config.activation_memory_budget, parsed.checkpointing) == (mode, budget, ckpt)


@pytest.mark.parametrize("spec", ["blocks+budget=0.1", "blocks+budget=1.0", "blocks+auto", "selective+ckpt"])
def test_cudagraphs_turns_on_inductors_cuda_graphs_for_a_budget_or_selective_mode(spec: str) -> None:
    plain, recorded = parse_mode(spec), parse_mode(spec + "+cudagraphs")
    assert (plain.config.compile_mode, recorded.config.compile_mode) == (None, "reduce-overhead")
    assert recorded.name == spec + "+cudagraphs"
    plain.config.compile_mode = "reduce-overhead"  # otherwise the same mode
    assert (recorded.config, recorded.checkpointing) == (plain.config, plain.checkpointing)


@pytest.mark.parametrize(
    "spec",
    [
        "eager+ckpt+cudagraphs",
        "blocks+ckpt+cudagraphs",
        "selective+ckpt+cudagraphs+offload=0.5",
        "blocks+budget=0.1+cudagraphs+offload=0.5",
        "blocks+budget=0.1+cudagraphs+ddp=2",
        "blocks+budget=0.1+cudagraphs+split=2",
    ],
)
def test_cudagraphs_is_refused_where_nothing_is_compiled_checkpointing_runs_or_weights_move(spec: str) -> None:
    refused = (
        r"\+cudagraphs goes after blocks\+budget=B, blocks\+auto or selective\+ckpt alone: "
        r"(CUDA graphs need whole blocks|"
        r"a CUDA graph records the blocks' weights where they are, and \+(offload|ddp|split) moves)"
    )
    with pytest.raises(ValueError, match=refused):
        parse_mode(spec)


def test_parse_mode_rejects_out_of_range_budget() -> None:
    with pytest.raises(ValueError, match=r"\[0.0, 1.0\]"):
        parse_mode("blocks+budget=1.5")


def test_parse_mode_with_offload() -> None:
    parsed = parse_mode("blocks+ckpt+offload=0.9+act+int8")
    assert (parsed.config.mode, parsed.checkpointing) == ("blocks", True)
    assert (parsed.offload.fraction, parsed.offload.activation_offload, parsed.offload.int8) == (0.9, True, True)
    assert parse_mode("eager+ckpt").offload is None
    for bad in ("eager+ckpt+offload=1.2", "eager+ckpt+offload=0.5+fast", "eager+ckpt+offload=x"):
        with pytest.raises(ValueError, match="offload"):
            parse_mode(bad)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "matmul"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "triton"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "other"),
    ],
)
def test_kernel_kinds_from_names_seen_on_hopper(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind


def test_gpu_time_table_gives_the_step_less_all_kernels() -> None:
    gpu_time = {"attention": 0.080, "matmul": 0.110, "triton": 0.050, "copies": 0.001, "other": 0.004}
    report = {"results": [{"mode": "blocks+budget=1.0", "step_s_median": 0.262, "stats": {"gpu_time_per_step_s": gpu_time}}]}
    row = gpu_time_table(report).splitlines()[-1]
    assert row == "| blocks+budget=1.0 | 262.0 | 80.0 | 110.0 | 50.0 | 1.0 | 4.0 | 245.0 | 17.0 |"


def test_pareto_front_keeps_only_undominated_settings() -> None:
    from compile_accel.benchmarks.plot import pareto_front

    # (GiB, s/step): eager+ckpt is beaten on both by the 0.1 budget; 1.0 is fastest, 0.1 smallest.
    points = [(10.8, 0.62), (8.8, 0.37), (8.9, 0.33), (14.7, 0.30), (24.7, 0.26), (15.0, 0.31)]
    assert pareto_front(points) == [1, 2, 3, 4]


def test_bench_data_parallel_and_split_rows_train_as_one_process(bench_run: BenchRun) -> None:
    """+ddp=2 runs two gloo processes with the same batch, so DDP's averaged gradients equal one
    process's and the loss after the same steps matches; +split=2 places the blocks on two
    devices (both the CPU here) without changing the result."""
    modes = ("blocks+budget=1.0", "blocks+budget=1.0+ddp=2", "blocks+budget=1.0+split=2")
    single, ddp, split = (bench_run.results[mode] for mode in modes)
    assert (ddp["processes"], ddp["devices"], split["processes"], split["devices"]) == (2, 2, 1, 2)
    for other in (ddp, split):
        assert other["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert other["stats"]["unique_graphs"] == single["stats"]["unique_graphs"]
        assert other["stats"]["recompiles"] == 0
    assert "| blocks+budget=1.0+ddp=2 | 2 | 2 |" in bench_run.proc.stdout


@pytest.mark.parametrize("mode", ["blocks+ckpt+ddp=1", "blocks+ckpt+split=x", "blocks+ckpt+offload=0.5+ddp=2"])
def test_bench_refuses_bad_device_counts(mode: str) -> None:
    with pytest.raises(ValueError, match=r"\+ddp"):
        parse_mode(mode)


def test_bench_int8_error_is_the_quantization_alone() -> None:
    """The int8 row's output error compares outputs at the same LoRA weights, so the number of
    steps trained before it is taken does not change it."""
    spec = parse_mode("eager+ckpt+offload=0.5+int8")
    errors = [
        run_mode(spec, BenchSettings(steps=steps, warmup=0, **SMALL)).stats["offload"]["int8_output_rel_error"]
        for steps in (1, 4)
    ]
    assert errors[0] > 0
    assert errors[1] == pytest.approx(errors[0], rel=1e-5)
