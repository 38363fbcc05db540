"""kohya sd-scripts' launcher (compile_accel.integrations.sd_scripts): its forms on a fake
sd-scripts checkout written into tmp_path (argument parsing, refusals, the script run with its
blocks compiled), its flags' CompileConfig, and what it reports at the first step and at exit.
The adapters of sd-scripts' own models: tests/test_sd_scripts_families.py.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import compile_accel
from compile_accel import CompileConfig, compile_workers
from compile_accel.compile_cache import RunCompileCache
from compile_accel.compile_profile import PHASES, CompileTimes
from compile_accel.dynamo_settings import HAS_CACHE_ARTIFACTS
from compile_accel.integrations import sd_scripts as accel
from compile_accel.integrations.sd_scripts import flags
from compile_accel.integrations.sd_scripts import launcher

BLOCKS = CompileConfig(mode="blocks", activation_memory_budget=0.5)
CPU = torch.device("cpu")

# ---- a fake checkout: the two functions the launcher hooks, and a script that uses them ----

FAKE_TRAIN_UTIL = """
def add_training_arguments(parser, support_dreambooth):
    parser.add_argument("--torch_compile", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
"""

FAKE_MODEL = """
import torch.nn as nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.gradient_checkpointing = False

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
"""

FAKE_SCRIPT = """
import argparse, json
from accelerate import Accelerator
from library import model, train_util

parser = argparse.ArgumentParser()
train_util.add_training_arguments(parser, True)
args = parser.parse_args()
net = model.Model()
for block in net.blocks:
    block.gradient_checkpointing = args.gradient_checkpointing
Accelerator(cpu=True).prepare(net)
compiled = type(net.blocks[0].__dict__.get("forward")).__name__ == "Region"
print(json.dumps({"compiled": compiled, "checkpointing": [b.gradient_checkpointing for b in net.blocks]}))
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "__init__.py").write_text("")
    (tmp_path / "library" / "train_util.py").write_text(FAKE_TRAIN_UTIL)
    (tmp_path / "library" / "model.py").write_text(FAKE_MODEL)
    (tmp_path / "train.py").write_text(textwrap.dedent(FAKE_SCRIPT))
    return tmp_path


def _launch(*args: str, form: str = "cli", env: dict | None = None) -> subprocess.CompletedProcess:
    prefix = {
        "cli": ["-m", "compile_accel.cli", "sd-scripts"],
        "module": ["-m", "compile_accel.integrations.sd_scripts"],
        "accelerate": [
            "-m",
            "accelerate.commands.launch",
            "--cpu",
            "--num_processes",
            "1",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "compile_accel.integrations.sd_scripts",
        ],
    }[form]
    env = {**{k: v for k, v in os.environ.items() if k != accel.SELECTIVE_ENV}, **(env or {})}
    return subprocess.run([sys.executable, *prefix, *args], capture_output=True, text=True, env=env, timeout=300)


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("form", ["cli", "module", "accelerate"])
def test_launcher_forms_run_the_script_with_the_blocks_compiled(checkout: Path, form: str) -> None:
    proc = _launch(
        str(checkout / "train.py"), "--activation_memory_budget", "0.5", "--gradient_checkpointing", form=form
    )
    assert _result(proc) == {"compiled": True, "checkpointing": [False, False]}
    assert "2 checkpoint switches (the gradient_checkpointing flags of the model and its blocks) turned off: " in proc.stderr


PRELOAD_SCRIPT = """
import argparse, json, sys
from compile_accel import compile_workers, preload
from library import train_util

parser = argparse.ArgumentParser()
train_util.add_training_arguments(parser, True)
parser.parse_args()
started, workers = preload.PRELOAD.thread is not None, compile_workers.running()
preload.wait_for_preload()
print(json.dumps({"started": started, "inductor": "torch._inductor.compile_fx" in sys.modules, "workers": workers}))
"""


def test_launcher_preloads_inductor_and_starts_the_workers_once_the_flags_ask_for_a_compile(checkout: Path) -> None:
    (checkout / "setup.py").write_text(PRELOAD_SCRIPT)
    assert _result(_launch(str(checkout / "setup.py"))) == {"started": False, "inductor": False, "workers": False}
    compiled = _launch(str(checkout / "setup.py"), env={accel.SELECTIVE_ENV: "1"})
    assert _result(compiled) == {"started": True, "inductor": True, "workers": False}
    if compile_workers.SUPPORTED:  # started before the script's set-up, not at apply()
        with_workers = _launch(str(checkout / "setup.py"), "--compile_workers", "2", env={accel.SELECTIVE_ENV: "1"})
        assert _result(with_workers) == {"started": True, "inductor": True, "workers": True}


def test_script_name_resolves_against_sd_scripts_dir(checkout: Path) -> None:
    assert _result(_launch("--sd-scripts", str(checkout), "train.py")) == {
        "compiled": False,
        "checkpointing": [False, False],
    }


def test_env_var_turns_selective_compile_on_and_keeps_checkpointing(checkout: Path) -> None:
    proc = _launch(str(checkout / "train.py"), "--gradient_checkpointing", env={accel.SELECTIVE_ENV: "1"})
    assert _result(proc)["checkpointing"] == [True, True]
    assert "selective compile of Model ['blocks']: 2 regions" in proc.stderr


def test_help_lists_the_flags(checkout: Path) -> None:
    proc = _launch(str(checkout / "train.py"), "--help")
    assert proc.returncode == 0
    for flag in (
        "--selective_torch_compile",
        "--activation_memory_budget",
        "--compile_dynamic",
        "--compile_recompile_limit",
        "--compile_fast",
        "--base_compute",
    ):
        assert flag in proc.stdout
    assert accel.SELECTIVE_ENV in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--activation_memory_budget", "0.5", "--torch_compile"], "Drop --torch_compile"),
        (["--activation_memory_budget", "1.5"], r"argument --activation_memory_budget: must be in \[0, 1\], got 1.5"),
    ],
)
def test_refusals_are_argparse_errors_of_the_script(checkout: Path, args: list[str], message: str) -> None:
    proc = _launch(str(checkout / "train.py"), *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: error:")
    assert re.search(message, proc.stderr)


def test_not_a_checkout_names_what_was_looked_for(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    proc = _launch(str(tmp_path / "train.py"))
    assert proc.returncode == 2
    assert "is not an sd-scripts checkout (looked for library/train_util.py)" in proc.stderr


# A trainer with sd-scripts' own per-block compile flags (Anima's after the sd3 branch), added
# after add_training_arguments as its trainer adds them; --compile compiles each block itself.
OWN_COMPILE_SCRIPT = """
import argparse, json
import torch
from accelerate import Accelerator
from library import model, train_util

parser = argparse.ArgumentParser()
train_util.add_training_arguments(parser, True)
parser.add_argument("--compile", action="store_true")
parser.add_argument("--compile_backend", default="inductor")
parser.add_argument("--compile_mode", default="default")
parser.add_argument("--compile_dynamic", choices=["true", "false", "auto"], default=None)
parser.add_argument("--compile_fullgraph", action="store_true")
parser.add_argument("--compile_cache_size_limit", type=int, default=None)
args = parser.parse_args()
net = model.Model()
Accelerator(cpu=True).prepare(net)
ours = any(type(m.__dict__.get("forward")).__name__ == "Region" for m in net.modules())
if args.compile:
    net.blocks = torch.nn.ModuleList(torch.compile(block) for block in net.blocks)
print(json.dumps({"ours": ours, "theirs": args.compile, "dynamic": args.compile_dynamic}))
"""


def test_sd_scripts_own_compile_is_turned_off_where_ours_compiles(checkout: Path) -> None:
    (checkout / "own.py").write_text(OWN_COMPILE_SCRIPT)
    own_and_ours = ["--compile", "--compile_dynamic", "true", "--activation_memory_budget", "0.5"]
    proc = _launch(str(checkout / "own.py"), *own_and_ours)
    assert _result(proc) == {"ours": True, "theirs": False, "dynamic": "true"}
    assert "sd-scripts' own --compile is off: compile_accel compiles the blocks (blocks mode)" in proc.stderr


def _own_compile_parser() -> tuple[argparse.ArgumentParser, accel.Launch]:
    """A parser with sd-scripts' own compile flags, watched by a launch as the launcher does."""
    parser = argparse.ArgumentParser(prog="own.py")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile_mode", default="default")
    parser.add_argument("--compile_fullgraph", action="store_true")
    parser.add_argument("--compile_cache_size_limit", type=int, default=None)
    parser.add_argument("--compile_dynamic", choices=["true", "false", "auto"], default=None)
    launch = accel.Launch()
    launch.watch(parser)
    return parser, launch


@pytest.mark.parametrize(
    "argv, compiles, theirs",
    [
        (["--compile", "--compile_dynamic", "true"], False, True),  # theirs alone: as without the launcher
        (["--selective_torch_compile"], True, False),
        (["--compile", "--selective_torch_compile"], True, False),
    ],
)
def test_sd_scripts_own_compile_stays_on_only_without_ours(argv: list[str], compiles: bool, theirs: bool) -> None:
    parser, launch = _own_compile_parser()
    args = parser.parse_args(argv)
    assert (launch.config is not None, args.compile) == (compiles, theirs)
    assert "--activation_memory_budget" in parser.format_help()  # ours added at the first parse
    assert parser.format_help().count("\n  --compile_dynamic ") == 1  # once: the script's, read by both


@pytest.mark.parametrize(
    "flag", [["--compile_mode", "max-autotune"], ["--compile_fullgraph"], ["--compile_cache_size_limit", "32"]]
)
def test_sd_scripts_own_compile_settings_with_ours_are_an_argparse_error_naming_the_flag(
    flag: list[str], capsys: pytest.CaptureFixture
) -> None:
    parser, _ = _own_compile_parser()
    with pytest.raises(SystemExit) as exit:
        parser.parse_args(["--activation_memory_budget", "0.5", *flag])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"own.py: error: {flag[0]} configures sd-scripts' own --compile, which --activation_memory_budget "
        f"replaces on the blocks it compiles; drop {flag[0]}"
    )


def test_a_scripts_own_compile_dynamic_sets_ours_and_alone_asks_nothing_of_ours() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile_dynamic", choices=["true", "false", "auto"], default=None)
    theirs = accel.add_arguments(parser)
    assert theirs == {"--compile": False, "--compile_dynamic": None}

    def config(*argv: str) -> CompileConfig | None:
        return accel.config_from_args(parser.parse_args(list(argv)), theirs)

    assert config("--activation_memory_budget", "0.5", "--compile_dynamic", "true").dynamic is True
    assert config("--activation_memory_budget", "0.5").dynamic is None  # their default: ours, auto
    assert config("--compile", "--compile_dynamic", "false") is None
    with pytest.raises(accel.LaunchError, match="need --selective_torch_compile or --activation_memory_budget"):
        accel.config_from_args(_parse("--compile_dynamic", "true"))  # ours alone still asks


# ---- flag semantics, in process -------------------------------------------------------------


def _parse(*argv: str, **script_flags: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    accel.add_arguments(parser)
    return parser.parse_args(list(argv), namespace=argparse.Namespace(**script_flags))


@pytest.mark.parametrize("value", ["-0.1", "1.01", "nan", "half"])
def test_bad_budget_is_an_argparse_error(value: str) -> None:
    with pytest.raises(SystemExit):
        _parse("--activation_memory_budget", value)


@pytest.mark.parametrize(
    "argv, flags, message",
    [
        (["--selective_torch_compile"], {"torch_compile": True}, "Drop --torch_compile"),
        (["--selective_torch_compile", "--activation_memory_budget", "0.3"], {}, "choose one"),
        (["--activation_memory_budget", "0.3"], {"deepspeed": True}, "does not support --deepspeed"),
        (["--compile_dynamic", "true"], {}, "need --selective_torch_compile or --activation_memory_budget"),
        (["--compile_workers", "4"], {}, "need --selective_torch_compile or --activation_memory_budget"),
        (["--compile_cuda_graphs"], {}, "need --selective_torch_compile or --activation_memory_budget"),
        (["--compile_fast"], {}, "need --selective_torch_compile or --activation_memory_budget"),
        (
            ["--activation_memory_budget", "0.3", "--compile_cuda_graphs"],
            {"blocks_to_swap": 8},
            "--compile_cuda_graphs: a CUDA graph records the blocks' weights where they are, and --blocks_to_swap "
            "moves them every step",
        ),
        (
            ["--activation_memory_budget", "auto", "--compile_cuda_graphs"],
            {"blocks_to_swap": 8},
            "--compile_cuda_graphs: a CUDA graph records the blocks' weights where they are, and --blocks_to_swap",
        ),
        (
            ["--selective_torch_compile", "--compile_cuda_graphs"],
            {"blocks_to_swap": 8},
            "--compile_cuda_graphs: a CUDA graph records the blocks' weights where they are, and --blocks_to_swap",
        ),
        (
            ["--selective_torch_compile", "--compile_workers_wait"],
            {},
            "--compile_workers_wait waits for the compile workers: give --compile_workers N too",
        ),
        (["--base_compute", "int8"], {}, "--base_compute need --selective_torch_compile or --activation_memory_budget"),
        (
            ["--activation_memory_budget", "auto", "--compile_workers", "2", "--compile_workers_wait"],
            {},
            "--compile_workers_wait: --activation_memory_budget auto measures its candidates in the steps after",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused(argv: list[str], flags: dict, message: str) -> None:
    with pytest.raises(accel.LaunchError, match=message):
        accel.config_from_args(_parse(*argv, **flags))


def test_base_compute_reaches_the_config_and_a_gpu_that_cannot_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    config = accel.config_from_args(_parse("--activation_memory_budget", "0.5", "--base_compute", "int8"))
    assert config.base_compute == "int8"
    assert accel.config_from_args(_parse("--selective_torch_compile")).base_compute is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    refusal = r"--base_compute int8: .*compute capability 8\.0 or newer; cuda is 7\.5"
    with pytest.raises(accel.LaunchError, match=refusal):
        accel.config_from_args(_parse("--selective_torch_compile", "--base_compute", "int8"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))  # an RTX 3090
    assert accel.config_from_args(_parse("--selective_torch_compile", "--base_compute", "int8")).base_compute
    refusal = r"--base_compute fp8: .*compute capability 8\.9 or newer; cuda is 8\.6"
    with pytest.raises(accel.LaunchError, match=refusal):
        accel.config_from_args(_parse("--selective_torch_compile", "--base_compute", "fp8"))


def test_without_msvc_on_windows_auto_compiles_a_graph_per_size_and_dynamic_true_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Dynamic shapes need MSVC on Windows (fixed ones compile with triton-windows' own C
    compiler): auto, which turns dynamic at a second bucket size, becomes a graph per size."""
    from compile_accel import dynamo_settings

    monkeypatch.setattr(flags, "dynamic_shapes_refusal", lambda: dynamo_settings.MSVC_FOR_DYNAMIC_SHAPES)
    config = accel.config_from_args(_parse("--activation_memory_budget", "0.5"))
    assert config.dynamic is False
    assert "compiling a graph per input size (--compile_dynamic false): on Windows" in capsys.readouterr().err
    assert accel.config_from_args(_parse("--selective_torch_compile", "--compile_dynamic", "false")).dynamic is False
    with pytest.raises(accel.LaunchError, match=r"--compile_dynamic true: on Windows, dynamic shapes .* need MSVC"):
        accel.config_from_args(_parse("--selective_torch_compile", "--compile_dynamic", "true"))
    monkeypatch.setattr(flags, "dynamic_shapes_refusal", lambda: None)  # MSVC found, or not Windows
    assert accel.config_from_args(_parse("--selective_torch_compile", "--compile_dynamic", "true")).dynamic is True


def test_dynamic_shapes_need_msvc_only_on_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    from compile_accel import dynamo_settings

    importlib.import_module("torch._inductor.codegen.cpp")  # (reads sys.platform at its import)
    monkeypatch.setattr(dynamo_settings, "cpp_compiler", lambda: (None, "cl is not found"))
    monkeypatch.setattr(sys, "platform", "win32")
    assert dynamo_settings.dynamic_shapes_refusal() == dynamo_settings.MSVC_FOR_DYNAMIC_SHAPES
    monkeypatch.setattr(dynamo_settings, "cpp_compiler", lambda: ("cl", None))
    assert dynamo_settings.dynamic_shapes_refusal() is None
    monkeypatch.setattr(dynamo_settings, "cpp_compiler", lambda: (None, "g++ is not found"))
    monkeypatch.setattr(sys, "platform", "linux")
    assert dynamo_settings.dynamic_shapes_refusal() is None


def test_compile_fast_becomes_the_compile_config() -> None:
    assert accel.config_from_args(_parse("--selective_torch_compile")).fast_compile is False
    assert accel.config_from_args(_parse("--selective_torch_compile", "--compile_fast")).fast_compile is True
    assert accel.config_from_args(_parse("--activation_memory_budget", "0.5", "--compile_fast")).fast_compile is True


def test_compile_workers_become_the_compile_config_where_torch_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert accel.config_from_args(_parse("--selective_torch_compile")).compile_workers == 0
    monkeypatch.setattr(compile_workers, "SUPPORTED", True)
    config = accel.config_from_args(_parse("--activation_memory_budget", "0.5", "--compile_workers", "4"))
    assert (config.mode, config.compile_workers) == ("blocks", 4)
    monkeypatch.setattr(compile_workers, "SUPPORTED", False)  # Windows, or a torch before 2.8
    with pytest.raises(accel.LaunchError, match="--compile_workers needs torch's graph pickler"):
        accel.config_from_args(_parse("--selective_torch_compile", "--compile_workers", "4"))
    assert accel.config_from_args(_parse("--selective_torch_compile")).compile_workers == 0


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_compile_workers_is_an_argparse_error(value: str) -> None:
    with pytest.raises(SystemExit):
        _parse("--selective_torch_compile", "--compile_workers", value)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "lots"])
def test_bad_vram_limit_is_an_argparse_error(value: str) -> None:
    with pytest.raises(SystemExit):
        _parse("--activation_memory_budget", "auto", "--vram_limit_gib", value)


def test_a_vram_limit_without_auto_is_refused() -> None:
    with pytest.raises(accel.LaunchError, match="--vram_limit_gib is the limit of --activation_memory_budget auto"):
        accel.config_from_args(_parse("--activation_memory_budget", "0.5", "--vram_limit_gib", "20"))


def test_auto_and_the_original_pull_requests_variable_become_the_compile_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = accel.config_from_args(_parse("--activation_memory_budget", "auto", "--vram_limit_gib", "22.5"))
    assert (config.mode, config.activation_memory_budget, config.vram_limit_gib) == ("blocks", "auto", 22.5)
    monkeypatch.setenv(accel.BUDGET_ENV, "0.3")
    assert accel.config_from_args(_parse()).activation_memory_budget == 0.3
    assert accel.config_from_args(_parse("--activation_memory_budget", "0.7")).activation_memory_budget == 0.7
    monkeypatch.setenv(accel.BUDGET_ENV, "most")
    with pytest.raises(SystemExit):
        _parse()


def test_cuda_graphs_flag_becomes_inductors_reduce_overhead_mode() -> None:
    assert accel.config_from_args(_parse("--selective_torch_compile")).compile_mode is None
    for budget, expected in (("0.1", 0.1), ("auto", "auto")):
        config = accel.config_from_args(_parse("--activation_memory_budget", budget, "--compile_cuda_graphs"))
        assert (config.activation_memory_budget, config.compile_mode) == (expected, "reduce-overhead")
    config = accel.config_from_args(_parse("--selective_torch_compile", "--compile_cuda_graphs"))
    assert (config.mode, config.compile_mode) == ("selective", "reduce-overhead")


def test_cuda_graphs_on_a_cpu_run_are_refused_before_anything_compiles() -> None:
    launch = accel.Launch()
    launch.config = accel.config_from_args(_parse("--activation_memory_budget", "0.1", "--compile_cuda_graphs"))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(accel.LaunchError, match="--compile_cuda_graphs records CUDA graphs, and this run's device is cpu"):
        launch.accelerate(model, torch.device("cpu"))
    assert launch.acceleration is None


def test_flags_become_the_compile_config(monkeypatch: pytest.MonkeyPatch) -> None:
    config = accel.config_from_args(
        _parse("--activation_memory_budget", "0", "--compile_dynamic", "true", "--compile_recompile_limit", "128")
    )
    assert (config.mode, config.activation_memory_budget, config.dynamic, config.recompile_limit) == (
        "blocks",
        0.0,
        True,
        128,
    )
    assert accel.config_from_args(_parse()) is None
    monkeypatch.setenv(accel.SELECTIVE_ENV, "1")
    assert accel.config_from_args(_parse()).mode == "selective"


def test_compile_accel_apply_uses_the_family_of_a_known_sd_scripts_model(caplog: pytest.LogCaptureFixture) -> None:
    """A class sd-scripts' library defines and the integration lists gets its family's blocks
    through compile_accel.apply too (here only joint_blocks, not the look-alike list beside it)."""
    mmdit = type("MMDiT", (torch.nn.Module,), {"__module__": "library.sd3_models"})()
    mmdit.joint_blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    mmdit.other_blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    with caplog.at_level(logging.INFO, logger="compile_accel"):
        acceleration = compile_accel.apply(mmdit, CompileConfig(mode="off"))
    assert "MMDiT is known to the sd-scripts integration" in caplog.text
    assert [b.path for b in acceleration.block_lists] == ["joint_blocks"]


def test_compile_accel_apply_gives_a_known_sd_scripts_model_its_block_swap_under_auto() -> None:
    """auto's offload ladder for MMDiT is sd-scripts' block swap, from none to all but two of its
    blocks, through compile_accel.apply as through the launcher's apply; a class without block
    swap keeps the default (no BlockOffloadConductor here: none)."""
    config = CompileConfig(mode="blocks", activation_memory_budget="auto", vram_limit_gib=1, backend="eager")
    for apply in (compile_accel.apply, accel.apply):
        mmdit = type("MMDiT", (torch.nn.Module,), {"__module__": "library.sd3_models"})()
        mmdit.joint_blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(6)])
        mmdit.num_blocks, mmdit.blocks_to_swap = 6, None
        ladder = apply(mmdit, config).auto_budget.find_ladder(torch.device("cpu"))
        assert (ladder.name, ladder.levels) == ("blocks_to_swap", (0, 1, 2, 3, 4))
    unet = type("SdxlUNet2DConditionModel", (torch.nn.Module,), {"__module__": "library.sdxl_original_unet"})()
    unet.middle_block = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    assert compile_accel.apply(unet, config).auto_budget.find_ladder(torch.device("cpu")) is None


def test_a_known_class_without_its_block_lists_is_an_unknown_layout_before_anything_changes() -> None:
    """NextDiT without its lists: compile_accel.apply refuses it before the Lumina rewrite (which
    would fail on this model), and the launcher reports an unknown sd-scripts layout."""
    nextdit = type("NextDiT", (torch.nn.Module,), {"__module__": "library.lumina_models"})()
    nextdit.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"NextDiT has no ModuleList matching \['context_refiner'"):
        compile_accel.apply(nextdit, CompileConfig(mode="selective"))
    launch = accel.Launch()
    launch.config = CompileConfig(mode="selective")
    with pytest.raises(accel.LaunchError, match="unknown sd-scripts layout: NextDiT has no ModuleList matching"):
        launch.accelerate(nextdit, torch.device("cpu"))
    assert "_compile_accel" not in vars(nextdit)


def test_a_checkout_without_the_parser_hook_stops_before_training_naming_it_and_what_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    train_util = types.ModuleType("library.train_util")  # a newer layout: the function moved
    library = types.ModuleType("library")
    library.train_util = train_util
    monkeypatch.setitem(sys.modules, "library", library)
    monkeypatch.setitem(sys.modules, "library.train_util", train_util)
    with pytest.raises(accel.LaunchError) as refusal:
        launcher._install_hooks(accel.Launch())
    assert str(refusal.value) == (
        "unknown sd-scripts layout: neither library/train_util.py nor library/args.py has add_training_arguments. "
        f"Nothing was trained; the launcher is known to work with sd-scripts' {accel.KNOWN_TO_WORK}"
    )
    e2e = (Path(__file__).parents[1] / ".ci" / "e2e").read_text()
    assert all(commit in accel.KNOWN_TO_WORK and commit in e2e for commit in ("3265f2ed", "c162e903"))


def test_newer_sd_scripts_training_arguments_in_library_args_get_the_compile_flags(checkout: Path) -> None:
    """Newer sd-scripts define add_training_arguments in library/args.py and re-export it from
    train_util; a trainer that calls library.args' gets the compile flags and its blocks compiled."""
    (checkout / "library" / "args.py").write_text(FAKE_TRAIN_UTIL)
    (checkout / "library" / "train_util.py").write_text("from library.args import add_training_arguments  # noqa\n")
    script = textwrap.dedent(FAKE_SCRIPT).replace("train_util", "args_util")
    script = script.replace("from library import model, args_util", "from library import args as args_util, model")
    (checkout / "train.py").write_text(script)
    proc = _launch(str(checkout / "train.py"), "--activation_memory_budget", "0.5", "--gradient_checkpointing")
    assert _result(proc) == {"compiled": True, "checkpointing": [False, False]}


def test_a_model_prepared_before_the_compile_flags_were_read_stops_the_launch(checkout: Path) -> None:
    """A script whose parser was built without add_training_arguments never reads the compile
    flags (here: the selective switch in the environment): it stops at Accelerator.prepare
    instead of training uncompiled."""
    own_parser = 'parser.add_argument("--gradient_checkpointing", action="store_true")'
    script = textwrap.dedent(FAKE_SCRIPT).replace("train_util.add_training_arguments(parser, True)", own_parser)
    (checkout / "train.py").write_text(script)
    proc = _launch(str(checkout / "train.py"), env={accel.SELECTIVE_ENV: "1"})
    assert proc.returncode != 0 and '"compiled"' not in proc.stdout
    assert (
        "unknown sd-scripts layout: Model reached Accelerator.prepare, but the script parsed its arguments without "
        "add_training_arguments of library/train_util.py or library/args.py"
    ) in proc.stderr


@pytest.mark.skipif(not HAS_CACHE_ARTIFACTS, reason="torch without cache artifacts")
def test_the_first_step_says_whether_the_runs_compiled_graphs_were_loaded(capsys: pytest.CaptureFixture) -> None:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    launch.compile_cache = RunCompileCache(model, launch.acceleration.signature)
    # A ModuleList has no forward of its own: the hook is run by hand, as the model's first call would.
    launch.compile_cache._first_forward(model, (torch.randn(1, 2),), {})
    launch.first_step_done()
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "first step done" in line]
    prefix, cache = line.split("; compiled graphs ")
    assert prefix == (
        "compile_accel: first step done: 0.0 s compiling (nothing); no inductor graph looked up; 0 graphs, "
        "0 recompiles, 0 fallbacks"
    )
    # Saved when this process compiled anything before (earlier tests): the file is then there.
    path = launch.compile_cache.path
    assert cache == f"not yet in {path}" + (", saved there" if path.is_file() else "")


def _gpu_memory(monkeypatch: pytest.MonkeyPatch, reserved_gib: float, dedicated_gib: float) -> None:
    """A GPU of `dedicated_gib` on which this process reserved `reserved_gib` (more: spilled)."""
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved_gib * 2**30))
    properties = SimpleNamespace(total_memory=int(dedicated_gib * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)


@pytest.mark.parametrize(
    "budget, swaps, fix",
    [
        (None, True, "--activation_memory_budget auto keeps the steps within the GPU's memory, swapping more blocks"),
        (0.5, False, "--activation_memory_budget auto keeps the steps within the GPU's memory"),
        ("auto", True, "a lower --vram_limit_gib than auto's"),
    ],
)
def test_a_step_that_spills_out_of_the_gpus_memory_is_warned_about_once_with_the_flag_that_fixes_it(
    monkeypatch: pytest.MonkeyPatch, budget: float | str | None, swaps: bool, fix: str
) -> None:
    """Windows' driver keeps what passes the GPU's memory in shared system memory (50-100x slower
    steps): a step whose reserved memory passes the dedicated memory is the sign."""
    launch = accel.Launch()
    launch.config = None if budget is None else CompileConfig(mode="blocks", activation_memory_budget=budget)
    model = torch.nn.Linear(2, 2)
    if swaps:
        model.enable_block_swap = lambda count, device: None
    monkeypatch.setattr(launch, "config", None)  # accelerate() compiles nothing here
    launch.accelerate(model, torch.device("cpu"))
    launch.config = None if budget is None else CompileConfig(mode="blocks", activation_memory_budget=budget)
    cuda = torch.device("cuda", 0)
    _gpu_memory(monkeypatch, reserved_gib=23.9, dedicated_gib=24.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch.step_done(cuda)  # within: nothing said
    _gpu_memory(monkeypatch, reserved_gib=25.5, dedicated_gib=24.0)
    with pytest.warns(RuntimeWarning) as caught:
        launch.step_done(cuda)
        launch.step_done(cuda)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith(
        "compile_accel: this process reserved 25.5 GiB of GPU memory, more than the 24.0 GiB the GPU has: Windows' "
        "driver keeps the rest in shared system memory, where steps run 50-100x slower"
    )
    assert message.endswith(fix) or fix in message
    assert ("swapping more blocks" in message) == (swaps and budget != "auto")


def test_the_first_step_reports_compile_time_once(capsys: pytest.CaptureFixture) -> None:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.first_step_done()  # nothing accelerated: nothing to say
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    launch.first_step_done()
    launch.first_step_done()
    lines = [line for line in capsys.readouterr().err.splitlines() if "first step done" in line]
    assert lines == [
        "compile_accel: first step done: 0.0 s compiling (nothing); no inductor graph looked up; "
        "0 graphs, 0 recompiles, 0 fallbacks"
    ]


@pytest.mark.parametrize("compiled", [False, True])
def test_the_first_step_freezes_what_compiling_left_out_of_the_garbage_collector(
    compiled: bool, capsys: pytest.CaptureFixture
) -> None:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    launch.acceleration._stats.worker_graphs_started = int(compiled)  # a graph handed to a worker
    assert gc.get_freeze_count() == 0
    launch.first_step_done()
    frozen = [line for line in capsys.readouterr().err.splitlines() if "frozen" in line]
    if not compiled:  # nothing compiled: the collector is left as it is
        assert frozen == [] and gc.get_freeze_count() == 0
        return
    (line,) = frozen
    said = re.fullmatch(
        r"compile_accel: (\d+) Python objects frozen out of the garbage collector's passes \(a full pass over what "
        r"compiling leaves takes a step's time; gc\.unfreeze\(\) undoes it\)",
        line,
    )
    assert said and int(said[1]) > 0
    # (Fewer now: frozen objects freed since by reference counting leave the count.)
    assert 0 < gc.get_freeze_count() <= int(said[1])


def test_with_compile_workers_wait_the_first_step_loads_the_workers_graphs_and_says_so(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.args = _parse("--selective_torch_compile", "--compile_workers", "2", "--compile_workers_wait")
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    stats = launch.acceleration._stats

    def loaded() -> int:  # what the workers compiled, loaded here
        stats.worker_graphs_started = stats.worker_graphs_compiled = 3
        return 3

    monkeypatch.setattr(compile_workers, "wait_and_load", loaded)
    launch.first_step_done()
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "first step done" in line]
    assert line.endswith("; waited for the 3 graphs compiling in the workers (--compile_workers_wait)")


def test_the_first_step_says_how_many_graphs_are_still_compiling_in_the_workers(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.args = _parse("--selective_torch_compile", "--compile_workers", "2")  # without --compile_workers_wait
    monkeypatch.setattr(compile_workers, "wait_and_load", lambda: pytest.fail("waited without --compile_workers_wait"))
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    stats = launch.acceleration._stats
    stats.worker_graphs_started, stats.worker_graphs_compiled, stats.worker_failures = 5, 1, ["graph 0/1: failed"]
    launch.first_step_done()
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "first step done" in line]
    assert line.endswith(
        "; 3 graphs from the compile workers not running compiled yet (run uncompiled until then; the compile_accel "
        "log says when each does)"
    )


@pytest.mark.skipif(not HAS_CACHE_ARTIFACTS, reason="torch without cache artifacts")
@pytest.mark.parametrize("ends_early", [False, True])
def test_the_runs_compiled_graphs_are_saved_again_once_the_workers_graphs_run_compiled(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, ends_early: bool
) -> None:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    launch.compile_cache = RunCompileCache(model, launch.acceleration.signature)
    launch.compile_cache._first_forward(model, (torch.randn(1, 2),), {})
    saves = []
    monkeypatch.setattr(launch.compile_cache, "save", lambda: saves.append(1) or 100)
    stats = launch.acceleration._stats
    stats.worker_graphs_started = 2
    launch.step_done(CPU)  # the first step: saved, both graphs still in the workers
    stats.worker_graphs_compiled = 1
    launch.step_done(CPU)  # one still out
    assert saves == [1]
    path = launch.compile_cache.path
    if ends_early:  # the run ends first: saved at exit with what is back
        launch.report()
        again = f"1 of 2 graphs from the compile workers run compiled; compiled graphs saved to {path}"
    else:
        stats.worker_failures = ["graph 1/0: failed"]  # compiled here instead: none is out
        stats.worker_graphs_started = 3  # a new shape's graph, after the first step: not waited for
        launch.step_done(CPU)
        launch.step_done(CPU)
        launch.report()
        again = f"1 of 3 graphs from the compile workers run compiled; compiled graphs saved to {path}"
    assert saves == [1, 1]
    err = capsys.readouterr().err
    assert f"{path}, saved there (again once the compile workers' graphs run compiled)" in err  # loaded or not
    assert err.count(again) == 1


@pytest.mark.skipif(not HAS_CACHE_ARTIFACTS, reason="torch without cache artifacts")
def test_while_auto_measures_a_candidate_from_the_workers_the_cache_waits_and_an_early_end_says_so(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first step leaves auto's partitions in the workers, then a candidate over the limit
    hands the next to the workers: the file waits for auto's choice, not only for the graphs out
    at the first step (none here); a run that ends before says that auto did not finish."""
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    stats = launch.acceleration._stats
    partitions = "the partitions of the traced step's graphs"
    auto = launch.acceleration.auto_budget = SimpleNamespace(waiting_for=partitions, result=None, counted=lambda: stats)
    launch.compile_cache = RunCompileCache(model, launch.acceleration.signature)
    launch.compile_cache._first_forward(model, (torch.randn(1, 2),), {})
    saves = []
    monkeypatch.setattr(launch.compile_cache, "save", lambda: saves.append(1) or 100)
    launch.step_done(CPU)  # the first step: no graph in the workers, auto's partitions are
    err = capsys.readouterr().err
    assert f"auto goes on once {partitions} are back from the compile workers" in err
    assert "(again once auto has chosen)" in err
    stats.worker_graphs_started, auto.waiting_for = 2, "the graphs of budget 0.7"  # back: 0.7 handed over
    launch.step_done(CPU)
    stats.worker_graphs_started, stats.worker_graphs_compiled = 4, 2  # 0.7 over: 0.5 handed over
    auto.waiting_for = "the graphs of budget 0.5"
    launch.step_done(CPU)
    assert saves == [1]  # 0.5's graphs are not in it yet
    auto.waiting_for, stats.worker_graphs_compiled = None, 4  # 0.5 measured and chosen
    launch.step_done(CPU)
    assert saves == [1, 1]
    auto.waiting_for = "the graphs of budget 0.3"  # (as if a run ended while a candidate was in the workers)
    launch.report()
    err = capsys.readouterr().err
    assert "auto did not finish: training ended while it waited for the graphs of budget 0.3 from the compile" in err


@pytest.mark.parametrize("workers, seconds, hinted", [(None, 25.0, True), (None, 5.0, False), (4, 25.0, False)])
def test_a_long_first_compile_without_workers_says_how_to_shorten_it(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, workers: int | None, seconds: float, hinted: bool
) -> None:
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    launch = accel.Launch()
    launch.acceleration = compile_accel.apply(model, CompileConfig(mode="off"), blocks=[model])
    launch.acceleration.config.compile_workers = workers or 0
    times = CompileTimes(dict.fromkeys(PHASES, 0.0) | {"dynamo": seconds}, 0.0, 1, 0, 0)
    monkeypatch.setattr(launch.acceleration, "compile_times", lambda: times)
    monkeypatch.setattr(compile_workers, "SUPPORTED", True)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    launch.first_step_done()
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "first step done" in line]
    assert ("; --compile_workers 3 would compile the graphs in worker processes" in line) == hinted


def test_no_compiler_stops_a_budget_and_lets_selective_train_eager() -> None:
    import torch._inductor.config

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    launch = accel.Launch()
    launch.config = BLOCKS
    # config.patch, not monkeypatch: torch >= 2.14's config module loses an attribute that
    # monkeypatch sets and deletes again, and every later compile fails on it.
    with torch._inductor.config.patch({"cpp.cxx": (None, "no-such-compiler")}):  # as $CXX sets it
        with pytest.raises(accel.LaunchError, match=r"needs inductor.*no C\+\+ compiler"):
            launch.accelerate(model, torch.device("cpu"))
        launch.config = CompileConfig(mode="selective")
        stopped = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compile_workers, "stop", lambda: stopped.append(True))
            launch.accelerate(model, torch.device("cpu"))
    assert launch.acceleration is None and "forward" not in model[0].__dict__
    assert stopped == [True]  # the workers the flags started compile nothing


def test_the_launcher_starts_the_workers_at_the_parse_that_asks_and_stops_them_at_one_that_compiles_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(compile_workers, "SUPPORTED", True)
    monkeypatch.setattr(compile_workers, "start", lambda count: calls.append(("start", count)))
    monkeypatch.setattr(compile_workers, "stop", lambda: calls.append(("stop",)))
    monkeypatch.setattr(launcher, "start_preloading", lambda: None)
    parser = argparse.ArgumentParser()
    accel.Launch().watch(parser)  # (which adds the flags at the first parse)
    parser.parse_known_args(["--selective_torch_compile", "--compile_workers", "2"])  # the command line
    parser.parse_known_args([])  # a --config_file's parse that compiles nothing
    assert calls == [("start", 2), ("stop",)]


# ---- the real checkout's scripts ($SD_SCRIPTS_DIR) ---------------------------------------------


@pytest.mark.parametrize(
    "script", ["lumina_train_network.py", "flux_train_network.py", "sd3_train_network.py", "sdxl_train_network.py"]
)
def test_real_script_help_and_torch_compile_refusal(sd_scripts: Path, script: str) -> None:
    help_text = _launch("--sd-scripts", str(sd_scripts), script, "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "--activation_memory_budget" in help_text.stdout and "--selective_torch_compile" in help_text.stdout
    refused = _launch("--sd-scripts", str(sd_scripts), script, "--selective_torch_compile", "--torch_compile")
    assert refused.returncode == 2
    assert f"{script}: error: --torch_compile compiles the whole model" in refused.stderr
