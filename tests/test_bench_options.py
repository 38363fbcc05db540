"""compile-accel bench's sd-scripts memory options (--fp8-base, --blocks-to-swap) and its GPU
memory cap (--vram-cap-gib): refusals, what reaches the child, OOM rows, and the sd-scripts
models at small sizes (the last only with $SD_SCRIPTS_DIR)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from conftest import run_bench

from compile_accel import cli
from compile_accel.benchmarks import models, runner
from compile_accel.benchmarks.measure import cap_gpu_memory
from compile_accel.benchmarks.models import SdScriptsOptions
from compile_accel.benchmarks.modes import ModeSpec, parse_mode
from compile_accel.benchmarks.report import markdown_table
from compile_accel.benchmarks.runner import BenchSettings, StepResult


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp8-base"], "--fp8-base is sd-scripts' --fp8_base, for sdscripts-flux, sdscripts-lumina2"),
        (["--fp8-base", "--model", "sdscripts-anima"], "not for sdscripts-anima"),
        (["--fp8-base", "--model", "flux"], "not for flux"),
        (["--fp8-base", "--model", "sdscripts-hunyuan-image"], "not for sdscripts-hunyuan-image"),
        (["--fp8-scaled"], "--fp8-scaled is sd-scripts' --fp8_scaled, for sdscripts-hunyuan-image; not for tiny"),
        (["--fp8-scaled", "--model", "sdscripts-anima"], "not for sdscripts-anima"),
        (["--blocks-to-swap", "4"], "--blocks-to-swap is sd-scripts' block swap"),
        (["--blocks-to-swap", "4", "--model", "sdscripts-sdxl"], "not in sdscripts-sdxl"),
        (["--blocks-to-swap", "4", "--model", "sd3"], "not in sd3"),
        (
            ["--blocks-to-swap", "4", "--model", "sdscripts-flux", "--modes", "eager+ckpt,blocks+ckpt+offload=0.5"],
            "--blocks-to-swap moves the blocks itself; blocks+ckpt+offload=0.5",
        ),
        (
            ["--blocks-to-swap", "4", "--model", "sdscripts-sd3", "--modes", "blocks+ckpt+ddp=2"],
            "--blocks-to-swap moves the blocks itself; blocks+ckpt+ddp=2",
        ),
        (
            ["--blocks-to-swap", "4", "--model", "sdscripts-flux", "--modes", "eager+ckpt,blocks+budget=0.1+cudagraphs"],
            "blocks+budget=0.1+cudagraphs: a CUDA graph records the blocks' weights where they are, and "
            "--blocks-to-swap moves them every step",
        ),
        (["--vram-cap-gib", "24", "--device", "cpu"], "--vram-cap-gib caps GPU memory, and this run is on the CPU"),
        (
            ["--modes", "eager+ckpt,blocks+budget=0.5+cudagraphs"],
            "blocks+budget=0.5+cudagraphs records CUDA graphs, and this run is on the CPU",
        ),
    ],
)
def test_bench_refuses_memory_options_that_cannot_apply(capsys, no_mode_runs, flags: list[str], message: str) -> None:
    status, err = run_bench(capsys, "--device", "cpu", *flags)
    assert status == 2
    assert message in err


@pytest.mark.parametrize(
    "flag, value, wanted",
    [
        ("--vram-cap-gib", "0", "a finite number of GiB > 0"),
        ("--vram-cap-gib", "-24", "a finite number of GiB > 0"),
        ("--vram-cap-gib", "nan", "a finite number of GiB > 0"),
        ("--vram-cap-gib", "inf", "a finite number of GiB > 0"),
        ("--vram-cap-gib", "24GB", "a finite number of GiB > 0"),
        ("--blocks-to-swap", "0", "a whole number >= 1"),
        ("--vram-limit-gib", "-1", "a finite number of GiB > 0"),
        ("--vram-limit-gib", "0", "a finite number of GiB > 0"),
        ("--vram-limit-gib", "nan", "a finite number of GiB > 0"),
        ("--vram-limit-gib", "inf", "a finite number of GiB > 0"),
    ],
)
def test_bench_refuses_bad_option_values(capsys, no_mode_runs, flag: str, value: str, wanted: str) -> None:
    status, err = run_bench(capsys, "--model", "sdscripts-flux", flag, value)
    assert status == 2
    assert f"argument {flag}: expected {wanted}, got '{value}'" in err


def test_bench_help_explains_the_memory_options(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--fp8-base sd-scripts Flux, SD3, Lumina 2, SDXL and SD 1.5 only: the frozen base model stored" in help_text
    assert "--fp8-scaled sd-scripts HunyuanImage only: its blocks' Linear weights" in help_text
    assert "--blocks-to-swap N sd-scripts Flux, SD3, Lumina 2, Anima and HunyuanImage only" in help_text
    assert "--vram-cap-gib G GPU only: each mode may allocate at most G GiB per GPU" in help_text
    assert "sdscripts-sdxl" in help_text


def _child_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device")
    runner.add_settings_arguments(parser)
    return parser


@pytest.mark.parametrize(
    "settings",
    [
        BenchSettings(model="sdscripts-flux", device="cuda", fp8_base=True, blocks_to_swap=18, vram_cap_gib=24.0),
        BenchSettings(model="sdscripts-sd3", device="cuda", vram_cap_gib=23.5, compile_workers=4),
        BenchSettings(model="sdscripts-hunyuan-image", device="cuda", fp8_scaled=True, blocks_to_swap=9),
        BenchSettings(),
    ],
)
def test_settings_reach_the_child_through_its_flags(settings: BenchSettings) -> None:
    flags = settings.flags()
    assert ("--fp8-base" in flags) == settings.fp8_base  # a switch, with no value after it
    assert ("--fp8-scaled" in flags) == settings.fp8_scaled
    assert BenchSettings.from_args(_child_parser().parse_args(flags), settings.device) == settings


def test_only_set_options_reach_the_model_builder(monkeypatch) -> None:
    """The sd-scripts builders get SdScriptsOptions; the others (and unset options) get none."""
    calls = []

    class Built(Exception):
        """Stops run_mode at the build: the builder's arguments are what is tested."""

    def builder(*args):
        calls.append(args)
        raise Built

    monkeypatch.setitem(models.MODELS, "sdscripts-flux", builder)
    spec = parse_mode("eager+ckpt")
    for settings in (
        BenchSettings(model="sdscripts-flux", fp8_base=True, blocks_to_swap=2),
        BenchSettings(model="sdscripts-flux", lora_rank=8),
    ):
        with pytest.raises(Built):
            runner.run_mode(spec, settings)
    assert calls == [("cpu", 16, None, None, SdScriptsOptions(True, 2)), ("cpu", 8, None, None)]


def test_the_cap_is_a_fraction_of_each_gpu(monkeypatch) -> None:
    totals = {0: 80 * 2**30, 1: 16 * 2**30}
    fractions = {}
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda gpu: argparse.Namespace(total_memory=totals[gpu.index])
    )
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, gpu: fractions.update({gpu.index: f}))
    cap_gpu_memory(24, [torch.device("cuda", 0), torch.device("cuda", 1)])
    assert fractions == {0: pytest.approx(0.3), 1: 1.0}  # a GPU smaller than the cap is not capped below itself


# ---- a mode that runs out of memory --------------------------------------------------------

OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 24.00 GiB"


def _result(spec: ModeSpec, settings: BenchSettings, seconds: float) -> StepResult:
    return StepResult(
        mode=spec.name,
        model=settings.model,
        description="fake model",
        device=settings.device,
        steps=settings.steps,
        step_s_median=seconds,
        step_s_min=seconds,
        step_s_each=[seconds] * settings.steps,
        first_step_s=1.0,
        peak_bytes=3 * 2**30,
        peak_kind="cuda max allocated",
        reserved_bytes=4 * 2**30,
        loss=0.5,
        stats={"unique_graphs": 1},
    )


def _fake_modes(monkeypatch, outcomes: dict[str, float | BaseException]) -> None:
    """Each child runs in this process (runner.main, as the real child does) and its mode
    takes the seconds in `outcomes`, or raises the error there."""

    def run_mode(spec, settings):
        outcome = outcomes[spec.name]
        if isinstance(outcome, BaseException):
            raise outcome
        return _result(spec, settings, outcome)

    def run_child(mode, settings, env, log):
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            runner.main(["--mode", mode, "--device", settings.device, *settings.flags()])
        return json.loads(stdout.getvalue().strip().splitlines()[-1])

    monkeypatch.setattr(runner, "run_mode", run_mode)
    monkeypatch.setattr(runner, "_run_child", run_child)
    monkeypatch.setattr(runner, "start_preloading", lambda: None)  # nothing compiles here


def _compiled_out_of_memory() -> RuntimeError:
    """An OOM as a compiled graph may surface it: raised from inside another error."""
    try:
        raise torch.OutOfMemoryError(OOM_MESSAGE + "\nmore lines")
    except torch.OutOfMemoryError as oom:
        error = RuntimeError("backend failed")
        error.__cause__ = oom
        return error


@pytest.mark.parametrize("error", [torch.OutOfMemoryError(OOM_MESSAGE + "\nmore lines"), _compiled_out_of_memory()])
def test_a_mode_out_of_memory_is_a_row_and_the_others_run(monkeypatch, capsys, tmp_path: Path, error) -> None:
    modes = ["eager+ckpt", "blocks+budget=0.5", "blocks+budget=1.0"]
    _fake_modes(monkeypatch, {"eager+ckpt": 0.5, "blocks+budget=0.5": error, "blocks+budget=1.0": 0.25})
    assert cli.main(["bench", "--device", "cpu", "--modes", ",".join(modes), "--out", str(tmp_path)]) == 0
    results = {r["mode"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    assert list(results) == modes
    oom = results["blocks+budget=0.5"]
    assert "test_bench_options.py" in oom.pop("oom_where")  # the last frames: where it ran out
    assert oom == {
        "mode": "blocks+budget=0.5", "model": "tiny", "device": "cpu", "oom": OOM_MESSAGE, "processes": 1, "devices": 1,
    }  # fmt: skip
    assert results["eager+ckpt"]["step_s_median"] == 0.5 and results["blocks+budget=1.0"]["step_s_median"] == 0.25
    rows = {line.split(" | ")[0].strip("| "): line for line in (tmp_path / "bench.md").read_text().splitlines()}
    assert rows["blocks+budget=0.5"].startswith(f"| blocks+budget=0.5 | OOM: {OOM_MESSAGE} | - |")
    assert "x |" not in rows["blocks+budget=0.5"]  # no speed-up from a mode that did not run
    assert "| 2.00x |" in rows["blocks+budget=1.0"]
    assert "blocks+budget=0.5: OOM (CUDA out of memory" in capsys.readouterr().err  # the progress line


def test_a_bench_cut_short_keeps_the_modes_it_finished(monkeypatch, tmp_path: Path) -> None:
    modes = ["eager+ckpt", "blocks+budget=0.5", "blocks+budget=1.0"]
    _fake_modes(monkeypatch, {"eager+ckpt": 0.5, "blocks+budget=0.5": KeyboardInterrupt(), "blocks+budget=1.0": 0.25})
    with pytest.raises(KeyboardInterrupt):
        cli.main(["bench", "--device", "cpu", "--modes", ",".join(modes), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench.json").read_text())
    assert [r["mode"] for r in report["results"]] == ["eager+ckpt"]
    assert report["modes_left"] == modes[1:]
    table = (tmp_path / "bench.md").read_text()
    assert "| eager+ckpt | 0.5000 |" in table
    assert "Not run (the bench stopped first): blocks+budget=0.5, blocks+budget=1.0." in table


def test_no_speed_up_when_the_baseline_ran_out_of_memory(monkeypatch, tmp_path: Path) -> None:
    _fake_modes(monkeypatch, {"eager+ckpt": torch.OutOfMemoryError(OOM_MESSAGE), "blocks+budget=1.0": 0.25})
    modes = "eager+ckpt,blocks+budget=1.0"
    assert cli.main(["bench", "--device", "cpu", "--modes", modes, "--out", str(tmp_path)]) == 0
    row = next(line for line in (tmp_path / "bench.md").read_text().splitlines() if "blocks+budget=1.0" in line)
    assert row.startswith("| blocks+budget=1.0 | 0.2500 | 0.2500 | - |")


def test_an_error_that_is_not_out_of_memory_still_fails_the_run(monkeypatch) -> None:
    _fake_modes(monkeypatch, {"eager+ckpt": RuntimeError("shapes do not match")})
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cli.main(["bench", "--device", "cpu", "--modes", "eager+ckpt"])


def test_the_table_says_once_what_a_capped_run_measured() -> None:
    settings = BenchSettings(model="sdscripts-flux", device="cuda", vram_cap_gib=24.0)
    row = {"mode": "eager+ckpt", "model": "sdscripts-flux", "device": "cuda", "oom": OOM_MESSAGE}
    report = {"environment": {"device_name": "NVIDIA H100 80GB HBM3"}, "settings": vars(settings), "results": [row]}
    table = markdown_table(report)
    note = (
        "Under --vram-cap-gib 24: each process could allocate at most 24 GiB per GPU, so the memory columns and OOM "
        "rows are what a 24 GiB card would see, while the speeds are those of NVIDIA H100 80GB HBM3."
    )
    assert table.split("\n\n")[1] == note and table.count("--vram-cap-gib") == 1
    settings.vram_cap_gib = None
    assert "--vram-cap-gib" not in markdown_table({**report, "settings": vars(settings)})


def test_the_workers_table_names_the_slowest_graph_in_a_worker_by_phase() -> None:
    from compile_accel.benchmarks.report import compile_workers_table

    def compiled(worker_s: float, queued_s: float, aot_s: float) -> dict:
        phases = {"dynamo_s": 0.0, "guards_s": 0.0, "aot_s": aot_s, "inductor_s": 2.0, "kernels_s": 0.01,
                  "autotune_s": 0.0}
        return {"graph": "g", "worker_s": worker_s, "queued_s": queued_s, "load_s": 1.0, **phases}

    def row(mode: str, compiles: list[dict], second_step_s: float | None = 2.0) -> dict:
        workers = {"second_step_s": second_step_s, "compiled_after_s": 20.0}
        stats = {"worker_graphs_started": 2, "worker_graphs_compiled": len(compiles), "worker_failures": [],
                 "worker_compiles": compiles, "compile_workers": workers}
        return {"mode": mode, "first_step_s": 9.0, "stats": stats}

    report = {"results": [row("blocks+budget=0.5", [compiled(4.0, 0.0, 1.0), compiled(7.5, 0.5, 3.0)]),
                          row("selective+ckpt", []), {"mode": "eager+ckpt", "stats": {}},
                          row("blocks+budget=1.0", [compiled(3.0, 0.0, 1.0)], second_step_s=None)]}
    lines = compile_workers_table(report).splitlines()
    assert lines[4].endswith("| 2 of 2 | 0 | 7.5 (0.5; aot 3.0, inductor 2.0) |")  # kernels under 0.05 s left out
    assert lines[5].endswith("| 0 of 2 | 0 | - |")
    # --compile-workers-wait: every graph was back within the first step, no second step of its own.
    assert lines[6].startswith("| blocks+budget=1.0 | 9.0 | - | 20.0 |") and len(lines) == 7  # no eager row


def test_weights_left_on_the_meta_device_are_drawn_and_kept_on_the_host() -> None:
    """As the HunyuanImage builder draws them: every meta parameter gets its module's own
    initialisation (a LayerNorm's ones, a Linear's bounded uniform), the buffers a module made
    for itself stay, and a module with meta weights but no reset_parameters is refused by name."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    model.register_buffer("table", torch.arange(4.0))
    models._drawn_on_host(model, "cpu")
    assert all(p.device.type == "cpu" for p in model.parameters()) and torch.equal(model.table, torch.arange(4.0))
    assert torch.equal(model[1].weight, torch.ones(16)) and model[0].weight.abs().max() <= 8**-0.5
    assert model[0].weight.std() > 0.05  # drawn, not left empty or zero

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        holder = nn.Sequential(nn.Linear(2, 2), Scaled())
    with pytest.raises(TypeError, match=r"1 \(Scaled\): no reset_parameters to draw its weights with"):
        models._drawn_on_host(holder, "cpu")


# ---- the sd-scripts models at small sizes ($SD_SCRIPTS_DIR) --------------------------------

SD_SCRIPTS_DIR = os.environ.get("SD_SCRIPTS_DIR")


@pytest.fixture
def small_sd_scripts(monkeypatch):
    """sd-scripts importable, and its bench models at small sizes (same code, small configs)."""
    if not SD_SCRIPTS_DIR:
        pytest.skip("set SD_SCRIPTS_DIR to an sd-scripts checkout")
    monkeypatch.syspath_prepend(SD_SCRIPTS_DIR)
    try:
        from library import flux_models, lumina_models, sdxl_original_unet  # noqa: F401
    except ImportError as error:
        pytest.skip(f"sd-scripts' library does not import here: {error}")
    sys.path.insert(0, str(Path(__file__).parent))
    from sd_scripts_small_anima import ANIMA_SHAPES, SMALL_ADAPTER, SMALL_ANIMA, small_llm_adapter
    from sd_scripts_small_hunyuan_image import WIDTH, patches as small_hunyuan_image
    from sd_scripts_small_lumina import small_nextdit
    from sd_scripts_small_sd15 import small_factories

    sys.path.pop(0)
    flux = dict(in_channels=16, vec_in_dim=16, context_in_dim=32, hidden_size=64, num_heads=4, axes_dim=[4, 6, 6])
    monkeypatch.setattr(models, "FLUX_CONFIG", dict(flux, depth=3, depth_single_blocks=4))
    sd3 = dict(num_patches=64, pos_embed_max_size=8, adm_in_channels=16, context_embedder_in_features=32)
    monkeypatch.setattr(models, "SD3_CONFIG", dict(sd3, depth=3, context_embedder_out_features=3 * 64))
    monkeypatch.setattr(sdxl_original_unet, "MODEL_CHANNELS", 32)
    for owner, name, value in small_factories():
        monkeypatch.setattr(owner, name, value)
    small_lumina = lambda: small_nextdit(n_layers=4, cap_feat_dim=2304)  # noqa: E731 - the builder's captions
    monkeypatch.setattr(lumina_models, "NextDiT_2B_GQA_patch2_Adaln_Refiner", small_lumina)
    from library import anima_models

    monkeypatch.setattr(models, "ANIMA_CONFIG", {**ANIMA_SHAPES, **SMALL_ANIMA})
    monkeypatch.setattr(models, "QWEN3_FEATURES", SMALL_ADAPTER["source_dim"])
    monkeypatch.setattr(anima_models, "LLMAdapter", small_llm_adapter)
    for owner, name, value in small_hunyuan_image():
        monkeypatch.setattr(owner, name, value)
    monkeypatch.setattr(models, "HUNYUAN_IMAGE_TEXT_FEATURES", WIDTH)


def _lora_step(bench: models.BenchModel) -> tuple[float, list[torch.Tensor]]:
    """One LoRA step as eager+ckpt runs it (checkpointing on, bf16 autocast: on the CPU here), with
    random LoRA up weights (sd-scripts starts them at zero, which leaves the down weights no grad)."""
    torch.manual_seed(1)
    for name, param in bench.model._bench_network[0].named_parameters():
        if "lora_up" in name:
            nn.init.normal_(param, std=0.05)
    bench.enable_checkpointing()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = (bench.predict().float() - bench.target.float()).square().mean()
    loss.backward()
    return loss.item(), [p.grad for p in bench.lora_params]


# SD 1.x at 64x64 has one token at its middle block, whose attention's q and k then get no gradient;
# HunyuanImage's 32x latents want more than 2x2.
RESOLUTION = {"sdscripts-sd15": 128, "sdscripts-hunyuan-image": 128}


def _build(name: str, options: SdScriptsOptions) -> models.BenchModel:
    torch.manual_seed(0)
    return models.MODELS[name]("cpu", 4, 1, RESOLUTION.get(name, 64), options)


def _assert_trains(grads: list[torch.Tensor | None]) -> None:
    assert grads and all(g is not None and g.isfinite().all() and g.abs().sum() > 0 for g in grads)


def _assert_fp8_base(bench: models.BenchModel) -> None:
    linears = [m for m in bench.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert all(p.dtype == torch.float32 for p in bench.lora_params)


# The SDXL U-Net's fp8 forward needs CUDA's autocast (CPU autocast does not cast a float8
# LayerNorm weight): on the CPU its fp8 cast alone is checked. Block swap on the CPU goes through
# sd-scripts' non-CUDA swap, which pairs two blocks' modules in order and so fails on SD3, whose
# last block has another layout (pre_only); it runs on a GPU only, as does the SDXL U-Net's none.
FP8_ON_CPU = ["sdscripts-flux", "sdscripts-sd3", "sdscripts-lumina2"]
SWAP_ON_CPU = [("sdscripts-flux", 2), ("sdscripts-lumina2", 2)]


@pytest.mark.parametrize("name", models.SD_SCRIPTS_MODELS)
def test_sd_scripts_bench_model_trains_its_lora(small_sd_scripts, name: str) -> None:
    bench = _build(name, SdScriptsOptions())
    assert {p.dtype for p in bench.model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in bench.model.parameters())  # (HunyuanImage's drawn from the meta device)
    _assert_trains(_lora_step(bench)[1])


def test_hunyuan_image_bench_model_swaps_blocks_in_its_backward_too(small_sd_scripts) -> None:
    """As its trainer enables it: with backward support, so that the backward finds each block's
    weights back on the device, and it computes what it computes without swap."""
    expected_loss = _lora_step(_build("sdscripts-hunyuan-image", SdScriptsOptions()))[0]
    bench = _build("sdscripts-hunyuan-image", SdScriptsOptions(blocks_to_swap=1))  # (the fewest it accepts here)
    assert bench.model.offloader_double.supports_backward and bench.model.offloader_single.supports_backward
    loss, grads = _lora_step(bench)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    _assert_trains(grads)


@pytest.mark.parametrize("name", FP8_ON_CPU)
def test_sd_scripts_fp8_base_trains_lora_on_a_float8_model(small_sd_scripts, name: str) -> None:
    bench = _build(name, SdScriptsOptions(fp8_base=True))
    _assert_fp8_base(bench)
    _assert_trains(_lora_step(bench)[1])


def test_sd_scripts_fp8_base_casts_the_sdxl_unet(small_sd_scripts) -> None:
    bench = _build("sdscripts-sdxl", SdScriptsOptions(fp8_base=True))
    _assert_fp8_base(bench)
    assert "fp8 base" in bench.description


def test_sd_scripts_fp8_scaled_quantizes_the_layers_its_loader_quantizes(small_sd_scripts) -> None:
    """--fp8_scaled as the trainer's loader applies it: the blocks' Linear weights in float8 with
    their scales and a forward that dequantizes them, the layers its loader excludes left bf16.
    Each quantized layer computes the bf16 layer's product up to e4m3's rounding (3 mantissa
    bits: 1/16 relative at most per weight, up to 2.6% in norm seen), and its LoRA trains."""
    from library import hunyuan_image_models as loader

    name = "sdscripts-hunyuan-image"
    targets, excluded = loader.FP8_OPTIMIZATION_TARGET_KEYS, loader.FP8_OPTIMIZATION_EXCLUDE_KEYS
    plain = dict(_build(name, SdScriptsOptions()).model.named_modules())  # (the same seed: the same weights)
    bench = _build(name, SdScriptsOptions(fp8_scaled=True))
    linears = {n: m for n, m in bench.model.named_modules() if isinstance(m, nn.Linear)}
    quantized = {n for n, m in linears.items() if m.weight.dtype == torch.float8_e4m3fn}
    assert quantized == {n for n in linears if any(t in n for t in targets) and not any(e in n for e in excluded)}
    assert quantized != set(linears)  # (some are excluded)
    for n in quantized:
        eye = torch.eye(linears[n].in_features, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # (the LoRA wrapped around it is fp32; its up weights 0)
            product, expected = (m(eye) - (0 if m.bias is None else m.bias) for m in (linears[n], plain[n]))
        error = (product.float() - expected.float()).norm() / expected.float().norm()
        assert 0 < error <= 1 / 16, n
    assert all(p.dtype == torch.bfloat16 for p in bench.model.parameters() if p.dtype != torch.float8_e4m3fn)
    assert "fp8 scaled" in bench.description
    _assert_trains(_lora_step(bench)[1])


@pytest.mark.parametrize("fp8_base", [False, True])
@pytest.mark.parametrize("name, blocks", SWAP_ON_CPU)
def test_sd_scripts_block_swap_swaps_blocks_during_the_step(
    small_sd_scripts, monkeypatch, name: str, blocks: int, fp8_base: bool
) -> None:
    """sd-scripts' ModelOffloader swaps block weights in forward and backward, and the forward
    computes what it computes without swap. Its non-CUDA swap (custom_offloading_utils'
    swap_weight_devices_no_cuda, "not tested" there) leaves a block swapped out on the CPU
    sharing the weights of the one swapped in, so the backward's recompute differs on the CPU:
    the gradients are only checked to be finite and nonzero here."""
    from library import custom_offloading_utils

    swaps = []
    swap = custom_offloading_utils.Offloader.swap_weight_devices
    monkeypatch.setattr(
        custom_offloading_utils.Offloader, "swap_weight_devices", lambda self, *b: swaps.append(swap(self, *b))
    )
    expected_loss = _lora_step(_build(name, SdScriptsOptions(fp8_base)))[0]
    bench = _build(name, SdScriptsOptions(fp8_base, blocks_to_swap=blocks))
    assert bench.model.blocks_to_swap == blocks and f"{blocks} blocks swapped" in bench.description
    loss, grads = _lora_step(bench)
    assert len(swaps) >= 2 * blocks  # forward and backward
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    _assert_trains(grads)


def test_with_auto_the_bench_steps_until_its_choice_is_made_before_warm_up() -> None:
    """A candidate measured over the limit hands the next to the workers: the steps go on until
    auto has chosen, so that warm-up and timed steps run the chosen budget compiled."""
    from compile_accel.benchmarks.runner import _await_compile_workers

    auto = SimpleNamespace(waiting_for="the partitions of the traced step's graphs")
    # Each step: the partitions back and 0.7 handed over, 0.7 measured over the limit and 0.5
    # handed over, then 0.5 chosen.
    waits = iter(["the graphs of budget 0.7", "the graphs of budget 0.5", None])

    def step() -> float:
        auto.waiting_for = next(waits)
        return 0.0

    _await_compile_workers(step, [], 0.0, auto)
    assert auto.waiting_for is None and next(waits, "all used") == "all used"


def test_a_compute_suffix_sets_base_compute_on_compiled_modes_only(capsys, no_mode_runs, monkeypatch) -> None:
    assert parse_mode("blocks+budget=0.5+compute=int8").config.base_compute == "int8"
    offloaded = parse_mode("selective+ckpt+offload=0.5+compute=int8")
    assert (offloaded.config.base_compute, offloaded.offload.fraction) == ("int8", 0.5)
    assert parse_mode("blocks+budget=0.5").config.base_compute is None
    cuda_graphs = parse_mode("blocks+budget=0.5+cudagraphs+compute=fp8").config
    assert (cuda_graphs.base_compute, cuda_graphs.compile_mode) == ("fp8", "reduce-overhead")
    for spec, message in [
        ("eager+ckpt+compute=int8", "this mode compiles none with compile_accel"),
        ("perblock+ckpt+compute=int8", "this mode compiles none with compile_accel"),
        ("blocks+budget=0.5+compute=int4", "base_compute must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_mode(spec)
    # A computation the device cannot run is refused before any mode starts (a device that cannot
    # stood in for: every compute runs on the CPU).
    from compile_accel import base_compute

    cannot = {"fp8": "base_compute='fp8' needs a CUDA GPU of compute capability 8.9 or newer"}
    monkeypatch.setattr(base_compute, "base_compute_refusal", lambda compute, devices: cannot.get(compute))
    status, err = run_bench(capsys, "--device", "cpu", "--modes", "eager+ckpt,blocks+budget=0.5+compute=fp8")
    assert status == 2
    assert "blocks+budget=0.5+compute=fp8: base_compute='fp8' needs a CUDA GPU of compute capability 8.9" in err
