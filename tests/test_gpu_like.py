"""`compile-accel bench --gpu-like CARD` and the peers' row `perblock+ckpt`: the card table, the SM
count chosen from measured rates (a fake rate function here; the GPU measures), the refusals,
what the calibration hands the modes, and the per-block compile against eager."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint
from conftest import relative_error, run_bench

from compile_accel.benchmarks import gpu_like, runner
from compile_accel.benchmarks.gpu_like import CARDS, choose_sm_count
from compile_accel.benchmarks.modes import parse_mode
from compile_accel.benchmarks.report import markdown_table


def test_the_cards_rates_keep_the_ratios_their_architectures_have() -> None:
    """Ada and Ampere GeForce cards run int8 at 4x their bf16 (fp32 accumulate) rate, Ada fp8 at
    2x; Ampere has no fp8."""
    assert {"rtx4090", "rtx4080", "rtx3090"} <= set(CARDS)
    for name, card in CARDS.items():
        assert card.int8_tops == pytest.approx(4 * card.bf16_tflops, rel=0.01), name
        if name == "rtx3090":
            assert card.fp8_tflops is None
        else:
            assert card.fp8_tflops == pytest.approx(2 * card.bf16_tflops, rel=0.01), name
    assert CARDS["rtx4090"].memory_gib == CARDS["rtx3090"].memory_gib == 24
    assert CARDS["rtx4080"].memory_gib == 16


class FakeRates:
    """A GPU whose bf16 matmul rate grows by `per_sm` TFLOP/s with each SM; records what was measured."""

    def __init__(self, per_sm: float) -> None:
        self.per_sm, self.measured = per_sm, []

    def __call__(self, sms: int) -> float:
        self.measured.append(sms)
        return self.per_sm * sms


@pytest.mark.parametrize("per_sm, wanted", [(7.0, 24), (6.6, 24), (6.4, 32), (3.5, 48)])
def test_the_fewest_sms_whose_measured_rate_reaches_the_card_are_chosen(per_sm: float, wanted: int) -> None:
    # 6.6 * 24 = 158.4 TFLOP/s is within RATE_TOLERANCE of the 4090's 165.2; 6.4 * 24 = 153.6 is not.
    rates = FakeRates(per_sm)
    assert choose_sm_count(rates, CARDS["rtx4090"].bf16_tflops, total_sms=132) == wanted
    assert rates.measured == list(range(gpu_like.SM_STEP, wanted + 1, gpu_like.SM_STEP))  # smallest first, then stop


def test_a_gpu_that_reaches_the_card_only_with_all_its_sms_uses_them_all() -> None:
    rates = FakeRates(1.2)  # 128 SMs: 153.6 TFLOP/s, short of 165.2 less 5%; 132: 158.4
    assert choose_sm_count(rates, CARDS["rtx4090"].bf16_tflops, total_sms=132) == 132
    assert rates.measured[-2:] == [128, 132]


def test_a_gpu_slower_than_the_card_is_refused_with_its_rate() -> None:
    with pytest.raises(ValueError, match=r"this GPU's 46 SMs reach 69\.0 TFLOP/s of bf16 matmul, below the card's 165\.2"):
        choose_sm_count(FakeRates(1.5), CARDS["rtx4090"].bf16_tflops, total_sms=46)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpu-like", "rtx4090"], "--gpu-like restricts a GPU's SMs, and this run is on the CPU"),
        (["--gpu-sms", "24"], "--gpu-sms restricts a GPU's SMs, and this run is on the CPU"),
    ],
)
def test_gpu_like_on_the_cpu_is_refused_before_any_mode(capsys, no_mode_runs, flags: list[str], message: str) -> None:
    status, err = run_bench(capsys, "--device", "cpu", *flags)
    assert status == 2 and message in err


def test_an_unknown_card_is_an_argparse_error(capsys, no_mode_runs) -> None:
    status, err = run_bench(capsys, "--gpu-like", "rtx9090")
    assert status == 2 and "argument --gpu-like: invalid choice: 'rtx9090'" in err


def test_what_cannot_be_emulated_is_refused(monkeypatch) -> None:
    one_gpu, two_gpus = [parse_mode("eager+ckpt")], [parse_mode("blocks+ckpt+ddp=2")]
    monkeypatch.setattr(torch.cuda.green_contexts, "SUPPORTED", False)
    assert "needs CUDA green contexts (torch >= 2.10" in gpu_like.refusal("--gpu-like", "cuda", one_gpu, None)
    monkeypatch.setattr(torch.cuda.green_contexts, "SUPPORTED", True)
    assert gpu_like.refusal("--gpu-like", "cuda", one_gpu, None) is None
    assert gpu_like.refusal("--gpu-like", "cuda", two_gpus, None) == (
        "--gpu-like emulates one card; blocks+ckpt+ddp=2 uses several GPUs"
    )
    assert gpu_like.refusal("--gpu-like", "cuda", one_gpu, 20.0) == (
        "--gpu-like caps memory at the card's size; drop --vram-cap-gib"
    )
    assert gpu_like.refusal("--gpu-like", "cuda", one_gpu, None, 24) == (
        "--gpu-like chooses the SM count by measurement; drop --gpu-sms"
    )
    assert gpu_like.refusal("--gpu-sms", "cuda", one_gpu, 20.0) is None  # N SMs under a cap of one's own


def _calibration(restricted: bool) -> dict:
    """What calibrate() returns, as measured on an H200 for an RTX 4090 (the figures are stand-ins)."""
    return {
        "card": "rtx4090",
        "card_spec": vars(CARDS["rtx4090"]),
        "gpu": "NVIDIA H200",
        "all_sms": 132,
        "sms": 24,
        "matmul_tflops_by_sms": {8: 55.0, 16: 109.0, 24: 164.0},
        "matmul_tflops": 164.0,
        "copy_gbs": 1725.0,
        "cuda_graphs": {
            "restricted": restricted,
            "replay_s": 0.0264 if restricted else 0.0057,
            "launched_restricted_s": 0.0264,
            "launched_whole_gpu_s": 0.0066,
        },
        "not_emulated": gpu_like.NOT_EMULATED,
    }


@pytest.fixture
def a_gpu_with_green_contexts(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The bench's view of a GPU with green contexts; run_ab records the settings it was given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.green_contexts, "SUPPORTED", True)
    ran: dict = {}

    def run_ab(modes, settings, **kwargs):
        ran.update(modes=modes, settings=settings)
        return {"environment": {"device_name": "NVIDIA H200", "torch": torch.__version__}, "results": []}

    monkeypatch.setattr(runner, "run_ab", run_ab)
    return ran


def test_the_calibration_sets_every_modes_sms_and_memory_cap(capsys, monkeypatch, a_gpu_with_green_contexts, tmp_path) -> None:
    monkeypatch.setattr(gpu_like, "calibrate", lambda name: _calibration(restricted=False))
    status, err = run_bench(capsys, "--gpu-like", "rtx4090", "--modes", "eager+ckpt,blocks+budget=0.5", "--out", str(tmp_path))
    assert status == 0
    settings = a_gpu_with_green_contexts["settings"]
    assert (settings.gpu_sms, settings.vram_cap_gib) == (24, 24)
    assert ["--gpu-sms", "24"] == settings.flags()[settings.flags().index("--gpu-sms") :][:2]  # what the children get
    assert "every mode ran on 24 of the 132 SMs of NVIDIA H200" in err
    assert '"gpu_like"' in (tmp_path / "bench.json").read_text()


def test_cuda_graph_rows_are_refused_when_a_replay_leaves_the_restricted_sms(
    capsys, monkeypatch, a_gpu_with_green_contexts
) -> None:
    monkeypatch.setattr(gpu_like, "calibrate", lambda name: _calibration(restricted=False))
    status, err = run_bench(capsys, "--gpu-like", "rtx4090", "--modes", "eager+ckpt,blocks+budget=0.5+cudagraphs")
    assert status == 2 and "modes" not in a_gpu_with_green_contexts
    assert "blocks+budget=0.5+cudagraphs: a CUDA graph replayed on the restricted stream ran on the whole GPU" in err
    monkeypatch.setattr(gpu_like, "calibrate", lambda name: _calibration(restricted=True))
    status, _ = run_bench(capsys, "--gpu-like", "rtx4090", "--modes", "eager+ckpt,blocks+budget=0.5+cudagraphs")
    assert status == 0 and a_gpu_with_green_contexts["modes"] == ["eager+ckpt", "blocks+budget=0.5+cudagraphs"]


def test_a_gpu_that_cannot_stand_in_for_the_card_is_refused(capsys, monkeypatch, a_gpu_with_green_contexts) -> None:
    def calibrate(name: str) -> dict:
        raise ValueError("rtx4090 has 24 GiB, more than this GPU's 15.6 GiB")

    monkeypatch.setattr(gpu_like, "calibrate", calibrate)
    status, err = run_bench(capsys, "--gpu-like", "rtx4090")
    assert status == 2 and "modes" not in a_gpu_with_green_contexts
    assert "--gpu-like rtx4090: rtx4090 has 24 GiB, more than this GPU's 15.6 GiB" in err


def test_the_report_says_what_was_emulated_instead_of_the_cap_note() -> None:
    report = {"settings": {"vram_cap_gib": 24}, "gpu_like": _calibration(restricted=False), "results": []}
    table = markdown_table(report)
    assert "As rtx4090 (--gpu-like): every mode ran on 24 of the 132 SMs of NVIDIA H200" in table
    assert "bf16 matmul measured 164.0 TFLOP/s (card: 165.2)" in table
    assert "CUDA graphs replayed on the whole GPU" in table and gpu_like.NOT_EMULATED in table
    assert "Under --vram-cap-gib" not in table


def test_perblock_is_the_peers_row_under_the_models_checkpointing() -> None:
    mode = parse_mode("perblock+ckpt")
    assert (mode.torch_compile, mode.checkpointing, mode.config.mode) == ("blocks", True, "off")
    for bad in ("perblock", "perblock+budget=0.5"):
        with pytest.raises(ValueError, match=re.escape(f"unknown mode {bad!r}")):
            parse_mode(bad)
    with pytest.raises(ValueError, match="perblock\\+ckpt\\+cudagraphs"):
        parse_mode("perblock+ckpt+cudagraphs")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    """Frozen blocks checkpointed from the model's loop (as musubi-tuner's models do), a trainable scale."""

    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth)).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def test_perblock_compiles_each_block_and_keeps_swapped_blocks_linear_layers_eager() -> None:
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(4, 16)
    eager_out = model(x)
    eager_out.square().mean().backward()
    eager_grad, model.scale.grad = model.scale.grad, None

    # The global knob it raises is put back after (monkeypatch would delete it: torch then hides it).
    with torch._dynamo.config.patch(recompile_limit=8):
        runner.compile_each_block(list(model.blocks), swapped=[model.blocks[0]])
        out = model(x)
        out.square().mean().backward()
        assert torch._dynamo.config.recompile_limit == runner.PER_BLOCK_RECOMPILE_LIMIT

    assert relative_error(out, eager_out) < 1e-5 and relative_error(model.scale.grad, eager_grad) < 1e-5  # fp32
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    disabled = [getattr(layer.forward, "_torchdynamo_disable", False) for layer in (model.blocks[0].up, model.blocks[1].up)]
    assert disabled == [True, False]
