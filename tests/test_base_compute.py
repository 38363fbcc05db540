"""base_compute="int8" | "fp8" on the CPU: the frozen Linears of compiled regions run as 8-bit matmuls.

Bars (the issue's): each block's output within 2% (int8) or 4% (fp8) (relative Frobenius error) of
eager fp32's on the same input, and every LoRA gradient's cosine similarity to eager's at least 0.99.
Eager is the reference of the same block compiled without base_compute, which matches it within
1e-4 (tests/test_parity.py). Inputs and weights are drawn fresh on every run.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import ONE_BLOCK_CLASS, build, inputs_for, lora_step, relative_error, train_beside
from torch.utils.checkpoint import checkpoint

import compile_accel
from compile_accel import CompileConfig, base_compute, base_compute_rewrite, int8_matmul
from compile_accel.base_compute_probe import compare_compute
from compile_accel.benchmarks.tiny_dit import make_inputs
from compile_accel.int8 import quantize_int8
from compile_accel.int8_weight import Int8Weight
from compile_accel.selective import RegionSpec

MAX_ERROR = 0.02
MAX_ERRORS = {"int8": MAX_ERROR, "fp8": 0.04}
MIN_COSINE = 0.99


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


@pytest.mark.parametrize("in_8_bits", [(True, True), (True, False), (False, True)], ids=["both", "forward", "gradient"])
@pytest.mark.parametrize("compute", base_compute.LINEARS)
def test_8_bit_linear_matches_linear_and_follows_its_weight(compute: str, in_8_bits: tuple[bool, bool]) -> None:
    """Each product in 8 bits within the format's error (and off: not exact), or, where the call
    says not, F.linear's (1e-6: the same matmul)."""
    torch.manual_seed(torch.seed())
    forward_bound, gradient_bound = (MAX_ERRORS[compute] if flag else 1e-6 for flag in in_8_bits)
    linear = nn.Linear(48, 40).requires_grad_(False)
    x = torch.randn(3, 10, 48, requires_grad=True)
    grad = torch.randn(3, 10, 40)

    def both() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x.grad = None
        expected = F.linear(x, linear.weight, linear.bias)
        (expected_input_grad,) = torch.autograd.grad(expected, x, grad)
        out = base_compute.LINEARS[compute](x, linear.weight, linear.bias, torch.float32, *in_8_bits)
        out.backward(grad)
        return out, expected, x.grad, expected_input_grad

    out, expected, input_grad, expected_input_grad = both()
    errors = relative_error(out, expected), relative_error(input_grad, expected_input_grad)
    assert errors[0] <= forward_bound and errors[1] <= gradient_bound
    assert (errors[0] > 1e-6, errors[1] > 1e-6) == in_8_bits

    with torch.no_grad():
        linear.weight.mul_(-2)  # in place
    out, expected, input_grad, expected_input_grad = both()
    assert relative_error(out, expected) <= forward_bound
    assert relative_error(input_grad, expected_input_grad) <= gradient_bound

    linear.weight.data = torch.randn(40, 48)  # a new storage (as a swapped block's)
    out, expected, input_grad, expected_input_grad = both()
    assert relative_error(out, expected) <= forward_bound
    assert relative_error(input_grad, expected_input_grad) <= gradient_bound


def test_fp8_multiplies_a_float8_weight_as_it_is() -> None:
    """An e4m3 weight (sd-scripts' --fp8_base) is not quantized again: with inputs whose rows fp8
    holds exactly (values of e4m3, each row's largest magnitude the format's maximum, so its scale
    is 1) the product is exact but for its fp32 sums and bf16 output. A weight re-quantized per row
    (to its own maximum) would round most of its values again."""
    torch.manual_seed(torch.seed())
    weight = (torch.randn(40, 48) * 0.05).to(torch.float8_e4m3fn)
    x = (torch.randn(6, 48) * 50).to(torch.float8_e4m3fn).float()
    x[:, 0] = torch.finfo(torch.float8_e4m3fn).max
    weight_t = weight.float().t().contiguous().to(torch.float8_e4m3fn)  # exact: a transpose
    grad = x[:, :40].contiguous()  # rows of the same kind for the backward

    x.requires_grad_(True)
    out = base_compute.fp8_linear(x, weight, None, torch.float32, True, True)
    out.backward(grad)
    expected = (x.detach().double() @ weight.double().t()).float()
    assert torch.allclose(out, expected.bfloat16().float(), rtol=2**-8, atol=0)
    expected_grad = (grad.double() @ weight_t.double().t()).float()
    assert torch.allclose(x.grad, expected_grad.bfloat16().float(), rtol=2**-8, atol=0)


def test_int8_multiplies_an_int8_weight_as_it_is() -> None:
    """An Int8Weight (int8 values and row scales: what the offload conductor streams) is multiplied
    as it is: the forward is the int8 product of the quantized input with its values and scales,
    the input gradient that of the output gradient with the row scales folded in (quantized per
    row) with its values transposed, not the dense weight's (quantized per input channel); both
    within int8's error of F.linear on its matrix."""
    torch.manual_seed(torch.seed())
    q, scale = quantize_int8(torch.randn(40, 48))
    weight = Int8Weight(q, scale, torch.float32)
    matrix = weight.dequantize()
    x = torch.randn(6, 48, requires_grad=True)
    grad = torch.randn(6, 40)
    out = base_compute.int8_linear(x, weight, None, torch.float32, True, True)
    out.backward(grad)
    assert torch.equal(out, int8_matmul.scaled_int8_mm(*quantize_int8(x.detach()), q, scale, None, torch.float32))
    folded = quantize_int8(grad * scale)
    expected_grad = int8_matmul.scaled_int8_mm(*folded, q.t().contiguous(), torch.ones(48), None, torch.float32)
    assert torch.equal(x.grad, expected_grad)
    dense = base_compute.int8_linear(x, matrix, None, torch.float32, True, True)
    assert not torch.equal(x.grad, torch.autograd.grad(dense, x, grad)[0])
    assert relative_error(out, F.linear(x, matrix)) <= MAX_ERROR
    assert relative_error(x.grad, grad @ matrix) <= MAX_ERROR


@pytest.mark.parametrize(
    "compute, capability, refusal",
    [
        ("int8", (7, 5), "base_compute='int8' needs a CUDA GPU of compute capability 8.0 or newer; cuda:0 is 7.5"),
        ("int8", (8, 0), None),
        ("fp8", (8, 6), "base_compute='fp8' needs a CUDA GPU of compute capability 8.9 or newer; cuda:0 is 8.6"),
        ("fp8", (8, 9), None),
    ],
)
def test_gpus_without_the_matmuls_are_refused(
    compute: str, capability: tuple[int, int], refusal: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert base_compute.base_compute_refusal(compute, {torch.device("cuda", 0)}) == refusal


@pytest.mark.parametrize(
    "compute, device, capability, advised",
    [
        ("int8", "cuda", (9, 0), True),
        ("fp8", "cuda", (9, 0), False),
        ("int8", "cuda", (8, 9), False),
        ("int8", "cpu", None, False),
    ],
)
def test_int8_on_a_gpu_that_runs_it_at_fp8s_rate_is_advised_against(
    compute: str, device: str, capability: tuple[int, int] | None, advised: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hopper multiplies int8 at fp8's rate (measured: int8 the slower): apply() warns to use fp8
    and goes on; Ada (int8 at twice fp8's rate) and CPUs get no advice."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    advice = base_compute.base_compute_advice(compute, {torch.device(device)})
    assert (advice is not None) == advised
    if advised:
        assert advice.startswith("base_compute='int8' on NVIDIA H200") and "use base_compute='fp8'" in advice
        from compile_accel import api

        monkeypatch.setattr(api, "base_compute_advice", lambda compute, devices: advice)
        model, _ = _peft_mlp(_MLPBlock)
        config = CompileConfig(mode="blocks", base_compute="int8")
        with pytest.warns(RuntimeWarning, match="use base_compute='fp8'"):
            acceleration = compile_accel.apply(model, config, blocks=["blocks"])
        assert acceleration.stats()["regions"] == 2
        acceleration.remove()


def _fake(*shape: int, device: str = "cuda", dynamic: bool = False) -> torch.Tensor:
    """A tensor as dynamo traces it (no GPU needed); its sizes symbolic when `dynamic`."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    if dynamic:
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        return mode.from_tensor(torch.empty(shape, device="meta"), symbolic_context=context)
    return FakeTensor(mode, torch.empty(shape, device="meta"), torch.device(device))


@pytest.mark.parametrize(
    "compute, x, weight, why",
    [
        ("int8", _fake(2, 512, 64), _fake(32, 64), None),
        ("int8", _fake(2, 512, 64, dynamic=True), _fake(32, 64), None),
        ("int8", _fake(2, 511, 64), _fake(32, 64), "input rows 1022: on CUDA 8 bits gain from 1024 rows"),
        ("fp8", _fake(2, 1, 64, dynamic=True), _fake(32, 64), "input rows 2: on CUDA 8 bits gain from 1024 rows"),
        ("int8", _fake(4096, 64), _fake(36, 64), "weight (36, 64): int8 on CUDA needs both sizes multiples of 8"),
        ("int8", _fake(4096, 24), _fake(32, 24), None),
        ("fp8", _fake(4096, 24), _fake(32, 24), "weight (32, 24): fp8 on CUDA needs both sizes multiples of 16"),
        ("fp8", _fake(1, 60, device="cpu"), _fake(36, 60, device="cpu"), None),  # every size on the CPU
    ],
)
def test_what_stays_out_of_8_bits_on_cuda(
    compute: str, x: torch.Tensor, weight: torch.Tensor, why: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reasons of the whole layer: both products stay (the products' width left out here)."""
    monkeypatch.setattr(base_compute, "CUDA_MIN_WIDTH", 0)
    forward, gradient = base_compute.why_not_8_bits(compute, x, weight, None)
    assert forward == gradient
    assert forward == why if why is None else forward.startswith(why)


@pytest.mark.parametrize(
    "weight, why",
    [
        ((4096, 2048), (None, None)),
        ((4096, 1024), (None, "output 1024 wide: on CUDA 8 bits gain from 2048")),  # (the input gradient's)
        ((1024, 4096), ("output 1024 wide: on CUDA 8 bits gain from 2048", None)),
        ((1024, 1024), ("output 1024 wide",) * 2),
    ],
)
def test_on_cuda_a_product_narrower_than_the_width_bar_stays(
    weight: tuple[int, int], why: tuple[str | None, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The forward's output is out_features wide, the input gradient's in_features: each product
    is decided on its own. On the CPU every product runs in 8 bits."""
    monkeypatch.setattr(base_compute, "CUDA_MIN_WIDTH", 2048)
    x = _fake(4096, weight[1])
    reasons = base_compute.why_not_8_bits("fp8", x, _fake(*weight), None)
    assert [r if r is None else r[: len(w)] for r, w in zip(reasons, why)] == list(why)
    x, weight = _fake(4096, weight[1], device="cpu"), _fake(*weight, device="cpu")
    assert base_compute.why_not_8_bits("fp8", x, weight, None) == (None, None)


def test_a_layer_whose_class_has_graphs_of_both_kinds_counts_as_both() -> None:
    """The outcomes of one layer role in several graphs (a class run on inputs of other sizes):
    8 bits where any graph runs it so, and every reason any graph kept it; a layer with one
    product in 8 bits counts as in 8 bits, and the other's reason is named with its product."""
    block = _MLPBlock().requires_grad_(False)
    found = base_compute.BaseLinears.find("fp8", [RegionSpec("blocks.0", block)], exclude=[])
    in_8_bits, rows, narrow = base_compute.IN_8_BITS, "input rows 512: ...", "output 32 wide: ..."
    found.record(block.fc1.weight, block.fc1.bias, (in_8_bits, in_8_bits))
    found.record(block.fc1.weight, block.fc1.bias, (rows, rows))
    found.record(block.fc2.weight, block.fc2.bias, (rows, rows))
    summary = found.summary()
    assert (summary["base_linears"], summary["in_8_bits"]) == (2, 1)
    assert summary["stayed"] == {
        "blocks.0.fc1": "input rows 512: ... (in 8 bits in other graphs of its class)",
        "blocks.0.fc2": "input rows 512: ...",
    }
    found.record(block.fc2.weight, block.fc2.bias, (in_8_bits, narrow))
    summary = found.summary()
    assert (summary["in_8_bits"], summary["matmuls_in_8_bits"]) == (2, 3)
    assert summary["stayed"]["blocks.0.fc2"] == (
        "forward: input rows 512: ... (in 8 bits in other graphs of its class) | "
        "input gradient: input rows 512: ...; output 32 wide: ..."
    )


def _inputs(model: nn.Module, height: int, width: int, text: int) -> tuple[torch.Tensor, ...]:
    latents, t, txt, mask = make_inputs(model.config, res=height, text_len=text)
    return torch.randn(*latents.shape[:2], height, width), t, txt, mask


def test_a_layer_swapped_out_counts_as_it_ran() -> None:
    """A block whose weights a block swap has moved to host memory when stats() is read (sd-scripts'
    ModelOffloader) counts as its compiled graph ran it, not as a layer no graph reached."""
    block = _MLPBlock().requires_grad_(False)
    found = base_compute.BaseLinears.find("int8", [RegionSpec("blocks.0", block)], exclude=[])
    for layer in (block.fc1, block.fc2):
        found.record(layer.weight, layer.bias, (base_compute.IN_8_BITS,) * 2)
        # (on another device: as host memory is to a GPU)
        layer.weight = nn.Parameter(layer.weight.to("meta"), requires_grad=False)
    summary = found.summary()
    assert (summary["in_8_bits"], summary["matmuls_in_8_bits"], summary["stayed"]) == (2, 4, {})


def test_kohya_dit_blocks_in_int8_match_eager_across_shapes_and_remove_restores_eager() -> None:
    """kohya-style LoRA (the base Linear reached through the LoRA's `org_forward`) and plain frozen
    Linears (the modulation), whole blocks compiled once with dynamic shapes."""
    torch.manual_seed(torch.seed())
    model, params = build("kohya", **ONE_BLOCK_CLASS)
    blocks = list(model.single_blocks)
    inputs = _inputs(model, 16, 16, 8)
    block_io: dict[nn.Module, tuple[tuple, torch.Tensor]] = {}

    def record(block: nn.Module, args: tuple, out: torch.Tensor) -> None:
        block_io[block] = (tuple(a.detach() for a in args), out.detach())

    handles = [block.register_forward_hook(record) for block in blocks]
    expected_out = model(*inputs).detach()
    expected_loss, expected_grads = lora_step(model, params, inputs)
    for handle in handles:
        handle.remove()

    acceleration = compile_accel.apply(model, CompileConfig(mode="blocks", dynamic=True, base_compute="int8"))
    lora_step(model, params, inputs)  # (the class's first call runs eager: compile_accel.region_inputs)
    # Each block on eager's input to it, so that its error is its own.
    outputs: dict[nn.Module, torch.Tensor] = {}
    handles = [block.register_forward_pre_hook(lambda block, args: block_io[block][0]) for block in blocks]
    handles += [block.register_forward_hook(lambda block, args, out: outputs.update({block: out})) for block in blocks]
    model(*inputs).sum().backward()  # the training graph: the one the steps below run
    for handle in handles:
        handle.remove()
    for p in params:
        p.grad = None
    errors = [relative_error(outputs[block], block_io[block][1]) for block in blocks]
    assert all(0 < error <= MAX_ERROR for error in errors), errors

    loss, grads = lora_step(model, params, inputs)
    assert relative_error(loss, expected_loss) <= MAX_ERROR
    cosines = [_cosine(grad, expected) for grad, expected in zip(grads, expected_grads, strict=True)]
    assert min(cosines) >= MIN_COSINE, cosines

    for shape in [(16, 8, 8), (8, 24, 6), (12, 20, 8), (20, 12, 6)]:  # 5 aspect-ratio buckets with the first
        lora_step(model, params, _inputs(model, *shape))
    with torch.no_grad():
        blocks[0].linear1.weight.mul_(0.5)  # in place between steps: the graph reads the new values
    changed_loss, _ = lora_step(model, params, inputs)
    assert changed_loss != loss
    with torch.no_grad():
        blocks[0].linear1.weight.mul_(2)  # back, exactly (powers of two)
    stats = acceleration.stats()
    assert (stats["graph_breaks"], stats["recompiles"], stats["fallbacks"]) == (0, 0, [])
    assert stats["base_compute"] == {
        "compute": "int8",
        "base_linears": 12,
        "in_8_bits": 12,
        "matmuls_in_8_bits": 24,
        "stayed": {},
        "accuracy": {"SingleStreamBlock": stats["base_compute"]["accuracy"]["SingleStreamBlock"]},
    }

    acceleration.remove()
    assert torch.equal(model(*inputs), expected_out)


class _MLPBlock(nn.Module):
    def __init__(self, width: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class _CheckpointedMLPBlock(_MLPBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


class _MLP(nn.Module):
    def __init__(self, block: type[_MLPBlock], count: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block() for _ in range(count)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _peft_mlp(block: type[_MLPBlock], stack: type[_MLP] = _MLP) -> tuple[nn.Module, list[nn.Parameter]]:
    from peft import LoraConfig, inject_adapter_in_model

    model = stack(block).requires_grad_(False)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["fc1", "fc2"], init_lora_weights=False)
    inject_adapter_in_model(config, model)
    return model, [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("kept", [0, 1], ids=["forward-kept", "gradient-kept"])
def test_a_compiled_graph_keeps_one_product_in_its_dtype_where_the_other_runs_in_8_bits(
    kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a product narrower than CUDA_MIN_WIDTH stays (stood in for on the CPU, where every
    product runs in 8 bits): with only the forward in 8 bits the output is the all-8-bit graph's,
    the LoRA gradients are not; with only the input gradient, the output is the model's own
    dtype's (within 1e-6) and not the all-8-bit graph's."""
    torch.manual_seed(torch.seed())
    model, params = _peft_mlp(_MLPBlock)
    x = torch.randn(2, 24, 32)
    own_out = model(x).detach()
    config = CompileConfig(mode="blocks", base_compute="int8", backend="aot_eager")

    def step(why: Callable[..., tuple[str | None, str | None]]) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
        monkeypatch.setattr(base_compute_rewrite, "why_not_8_bits", why)
        acceleration = compile_accel.apply(model, config, blocks=["blocks"])
        lora_step(model, params, (x,))  # (the class's first call runs eager)
        out = model(x)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        summary = acceleration.stats()["base_compute"]
        acceleration.remove()
        return out.detach(), grads, summary

    reasons: list[str | None] = [None, None]
    reasons[kept] = "stood in for the width bar"
    both_out, both_grads, _ = step(lambda compute, x, weight, bias: (None, None))
    out, grads, summary = step(lambda compute, x, weight, bias: tuple(reasons))
    assert summary["in_8_bits"] == summary["base_linears"] == 4 and summary["matmuls_in_8_bits"] == 4
    product = base_compute.PRODUCTS[kept]
    assert set(summary["stayed"].values()) == {f"{product}: stood in for the width bar"}
    if kept == 1:  # the forward in 8 bits, as in the all-8-bit graph; the input gradient not
        assert torch.equal(out, both_out)
        assert any(not torch.equal(g, b) for g, b in zip(grads, both_grads, strict=True))
    else:  # the forward in the model's dtype
        assert torch.allclose(out, own_out, rtol=1e-6, atol=1e-6) and not torch.equal(out, both_out)
    assert min(_cosine(g, b) for g, b in zip(grads, both_grads, strict=True)) >= MIN_COSINE


# selective: each peft Linear is a region; blocks: the whole block, and with the block's own
# checkpoint the Linears sit in the checkpoint's body, a graph nested in the block's.
PEFT_CASES = {"selective": _MLPBlock, "blocks": _MLPBlock, "blocks-checkpointed": _CheckpointedMLPBlock}


@pytest.mark.parametrize("compute", base_compute.LINEARS)
@pytest.mark.parametrize("case", PEFT_CASES)
def test_peft_base_layers_in_8_bits_and_a_trainable_bias_stays(case: str, compute: str) -> None:
    torch.manual_seed(torch.seed())
    model, params = _peft_mlp(PEFT_CASES[case])
    model.blocks[1].fc2.base_layer.bias.requires_grad_(True)  # weight frozen, bias trained: stays
    x = torch.randn(2, 24, 32)
    expected_loss, expected_grads = lora_step(model, params, (x,))

    # aot_eager: the rewrite and the op are the same under inductor (the kohya test compiles with it).
    config = CompileConfig(mode=case.split("-")[0], base_compute=compute, backend="aot_eager")
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    lora_step(model, params, (x,))  # (where a class's first call runs eager: compile_accel.region_inputs)
    loss, grads = lora_step(model, params, (x,))
    assert relative_error(loss, expected_loss) <= MAX_ERRORS[compute]
    cosines = [_cosine(grad, expected) for grad, expected in zip(grads, expected_grads, strict=True)]
    assert min(cosines) >= MIN_COSINE, cosines
    stats = acceleration.stats()
    assert (stats["graph_breaks"], stats["recompiles"], stats["fallbacks"]) == (0, 0, [])
    kind = "Linear" if case == "selective" else PEFT_CASES[case].__name__
    assert stats["base_compute"] == {
        "compute": compute,
        "base_linears": 4,
        "in_8_bits": 3,
        "matmuls_in_8_bits": 6,
        "stayed": {"blocks.1.fc2.base_layer": "its bias is trainable"},
        "accuracy": {kind: stats["base_compute"]["accuracy"][kind]},  # (its figures: the test above)
    }
    acceleration.remove()


def test_the_first_training_call_of_a_class_compares_it_with_its_own_dtype_and_leaves_the_step_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The accuracy check (compile_accel.base_compute_probe): once per block class, at its first
    compiled training call (the second block's: the first block's first call runs eager,
    compile_accel.region_inputs), inside the blocks' own non-reentrant checkpoint; its figure is
    the block's own error; the step's gradients are those of the same step without it; a warning
    past the bar."""
    from compile_accel import base_compute_probe, regions

    torch.manual_seed(torch.seed())
    model, params = _peft_mlp(_CheckpointedMLPBlock)
    torch.nn.init.zeros_(model.blocks[1].fc2.lora_B.default.weight)  # as LoRA starts: fc2's A gets no gradient
    twin, twin_params = copy.deepcopy(model), None
    twin_params = [p for p in twin.parameters() if p.requires_grad]
    x = torch.randn(2, 24, 32)
    checked_block = model.blocks[1]
    with torch.no_grad():
        checked_input = model.blocks[0](x)
        expected = checked_block(checked_input)
    monkeypatch.setitem(base_compute_probe.MAX_OUTPUT_ERROR, "int8", 1e-9)  # every block past the bar
    config = CompileConfig(mode="blocks", base_compute="int8", backend="aot_eager")  # (as in the peft test)
    with monkeypatch.context() as unchecked:
        unchecked.setattr(regions, "compare_compute", lambda *args: {"skipped": "left out here"})
        twin_acceleration = compile_accel.apply(twin, config, blocks=["blocks"])
        _, unchecked_grads = lora_step(twin, twin_params, (x,))
        twin_acceleration.remove()
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    with pytest.warns(RuntimeWarning, match="_CheckpointedMLPBlock's output is .* leave the block out"):
        _, checked_grads = lora_step(model, params, (x,))
    assert all(torch.equal(a, b) for a, b in zip(checked_grads, unchecked_grads, strict=True))

    accuracy = acceleration.stats()["base_compute"]["accuracy"]
    assert list(accuracy) == ["_CheckpointedMLPBlock"]
    check = accuracy["_CheckpointedMLPBlock"]
    assert check["gradients"] == 3  # the second block's LoRA A and B of fc1 and of fc2, less fc2's A (zero)
    assert 0 < check["output_error"] <= MAX_ERROR and MIN_COSINE <= check["min_gradient_cosine"] <= 1
    with torch.enable_grad():
        compiled = checked_block(checked_input.clone().requires_grad_(True))
    assert check["output_error"] == pytest.approx(relative_error(compiled, expected), rel=1e-4)
    acceleration.remove()


def test_the_accuracy_check_runs_for_each_input_shape_of_a_class_and_keeps_the_worst(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A class's calls of other sizes run other graphs, where other Linears may stay in their dtype
    (on CUDA, Lumina 2's text refiners, of its main blocks' class, have too few rows for any): the
    check runs at the first compiled call of each input shape, up to ACCURACY_CHECKS_PER_CLASS
    shapes, and the class keeps the worst figures; a skipped check counts only where none ran."""
    from compile_accel import regions

    results = iter(
        [
            {"skipped": "out of GPU memory"},
            {"output_error": 0.001, "min_gradient_cosine": 0.98, "gradients": 2},
            {"output_error": 0.01, "min_gradient_cosine": 0.999, "gradients": 3},
            {"skipped": "out of GPU memory"},
        ]
    )
    checked = []

    def check(compute: str, name: str, compiled, eager, args: tuple, kwargs: dict) -> dict:
        checked.append(tuple(args[0].shape))
        return next(results)

    monkeypatch.setattr(regions, "compare_compute", check)
    model, params = _peft_mlp(_MLPBlock)
    config = CompileConfig(mode="blocks", base_compute="int8", backend="aot_eager")  # (as in the peft test)
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    shapes = [(2, 24, 32), (1, 40, 32), (3, 8, 32), (4, 4, 32), (2, 8, 32)]
    for shape in [shape for shape in shapes for _ in range(2)]:
        lora_step(model, params, (torch.randn(shape),))
    assert checked == shapes[: regions.ACCURACY_CHECKS_PER_CLASS]
    expected = {"output_error": 0.01, "min_gradient_cosine": 0.98, "gradients": 5, "checks": 2}
    assert acceleration.stats()["base_compute"]["accuracy"] == {"_MLPBlock": expected}
    acceleration.remove()


def test_a_nan_check_is_the_worst_whichever_came_first() -> None:
    nan, fine = float("nan"), {"output_error": 0.01, "min_gradient_cosine": 0.999, "gradients": 1}
    for results in ([fine, {**fine, "output_error": nan}], [{**fine, "min_gradient_cosine": nan}, fine]):
        linears = base_compute.BaseLinears("int8")
        for result in results:
            linears.add_accuracy("Block", result)
        kept = linears.accuracy["Block"]
        assert math.isnan(kept["output_error"]) or math.isnan(kept["min_gradient_cosine"]), kept
        assert kept["checks"] == 2


class _NormedBlock(nn.Module):
    """GroupNorm (which saves two of its outputs for backward) before a conv, and a LoRA after it
    or none: a LoRA's gradients need no backward through the norm."""

    def __init__(self, lora: bool) -> None:
        super().__init__()
        self.norm, self.conv = nn.GroupNorm(4, 16), nn.Conv2d(16, 16, 3, padding=1)
        self.requires_grad_(False)
        self.lora = nn.Linear(32, 32, bias=False) if lora else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(F.silu(self.norm(x))) + x
        return out if self.lora is None else out + self.lora(out)


def _live_tensor_bytes() -> int:
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in gc.get_objects()
        if type(t) is torch.Tensor and t.device.type == "cpu"  # (not parameters, nor other tests' fakes)
    }
    return sum(storages.values())


@pytest.mark.parametrize("lora", [False, True], ids=["no-lora", "lora"])
def test_the_accuracy_check_keeps_no_tensor_of_its_runs(lora: bool) -> None:
    # Its runs' graphs are dropped with parts never run backward (all of it without a LoRA): a saved
    # output kept as itself would hold its graph for good (SDXL: 0.39 GiB over the whole run).
    block, x = _NormedBlock(lora), torch.randn(2, 16, 32, 32, requires_grad=True)
    gc.collect()
    before = _live_tensor_bytes()
    result = compare_compute("int8", "Block", block, block, (x,), {})
    gc.collect()
    assert result["gradients"] == (1 if lora else 0)
    assert _live_tensor_bytes() == before


class _MaskedMLPBlock(_MLPBlock):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x))) * mask


class _MaskedMLP(_MLP):
    """Three blocks given a broadcast mask of stride 0, as compile_accel.region_inputs keeps masks."""

    def __init__(self, block: type[_MLPBlock]) -> None:
        super().__init__(block, count=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(1, 1, 32, dtype=torch.bool).expand(*x.shape)
        for block in self.blocks:
            x = block(x, mask)
        return x


def test_the_accuracy_check_compiles_no_graph_of_its_own() -> None:
    """The check's compiled run gets copies of the call's inputs as the call got them (requiring
    grad where they did: the conditioning does not; a mask of stride 0 stays so), so it takes the
    graph the call took: one per block class. (Copies that all required grad, or were dense,
    compiled one more graph per class.)"""
    torch.manual_seed(torch.seed())
    model, _ = build("kohya", None)
    masked, _ = _peft_mlp(_MaskedMLPBlock, _MaskedMLP)
    config = CompileConfig(mode="blocks", base_compute="int8", backend="aot_eager")  # (as in the peft test)
    for network, inputs, classes in [
        (model, inputs_for(model), ["DoubleStreamBlock", "SingleStreamBlock"]),
        (masked, (torch.randn(2, 24, 32),), ["_MaskedMLPBlock"]),
    ]:
        acceleration = compile_accel.apply(network, config, blocks=None if network is model else ["blocks"])
        for _ in range(2):
            lora_step(network, [p for p in network.parameters() if p.requires_grad], inputs)
        stats = acceleration.stats()
        assert sorted(stats["base_compute"]["accuracy"]) == classes
        assert (stats["unique_graphs"], stats["recompiles"]) == (len(classes), 0)
        acceleration.remove()


class _WideMLPBlock(_MLPBlock):
    """_MLPBlock at sizes 8-bit matmuls gain on, for the GPU."""

    def __init__(self) -> None:
        super().__init__(width=256, hidden=1024)


def _needs(device: str, compute: str) -> list[pytest.MarkDecorator]:
    """The marks of a test on `device` with `compute`: on CUDA, a GPU that runs it."""
    if device == "cpu":
        return []
    minimum = base_compute.MIN_CUDA_CAPABILITY[compute]
    runs = torch.cuda.is_available() and torch.cuda.get_device_capability() >= minimum
    return [pytest.mark.gpu, pytest.mark.skipif(not runs, reason=f"needs a CUDA GPU of capability {minimum} or newer")]


# (device, compute, the block, target noise): on the CPU int8 on the small block. fp8's products are
# ~3.5% off; on the small block its own noise, near that toy's floor, ended it 21% above its own
# dtype: the issue asks fp8's bar on the GPU.
TEACHER_CASES = [
    pytest.param("cpu", "int8", _MLPBlock, 0.05, id="cpu-int8"),
    *(pytest.param("cuda", c, _WideMLPBlock, 0.1, id=f"cuda-{c}", marks=_needs("cuda", c)) for c in ("int8", "fp8")),
]


@pytest.mark.parametrize("device, compute, block, noise", TEACHER_CASES)
def test_a_lora_trained_in_8_bits_reaches_the_loss_it_reaches_in_its_own_dtype(
    device: str, compute: str, block: type[_MLPBlock], noise: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Teacher-student (the issue's bar: final loss within 10% of the model's own dtype's): the
    teacher is the frozen base plus a known rank-4 delta on every Linear, the targets carry noise
    as a diffusion loss does (its variance is the floor a perfect student reaches), each step a
    fresh batch. Both students must learn the delta (from over 10x the floor to under 1.2x) and
    end within 10% of each other. On CUDA under bf16 autocast, compiled with inductor, every call
    in 8 bits (no row or width threshold)."""
    monkeypatch.setattr(base_compute, "CUDA_MIN_ROWS", 0)
    monkeypatch.setattr(base_compute, "CUDA_MIN_WIDTH", 0)
    torch.manual_seed(torch.seed())
    teacher, _ = _peft_mlp(block)
    teacher.to(device)
    width = teacher.blocks[0].fc1.in_features
    with torch.no_grad():
        for layer in (m for m in teacher.modules() if isinstance(m, nn.Linear) and m.weight.shape[0] > 4):
            rows, columns = layer.weight.shape
            # (an output moved by ~0.28 of its input's scale, at any width)
            delta = torch.randn(rows, 4, device=device) @ torch.randn(4, columns, device=device)
            layer.weight += delta * 0.14 / columns**0.5

    def final_loss(compute: str | None) -> tuple[float, float]:
        torch.manual_seed(1)  # the same student, data and noise for both
        student, params = _peft_mlp(block)
        student.to(device)
        student.load_state_dict({k: v for k, v in teacher.state_dict().items() if "lora" not in k}, strict=False)
        for name, p in student.named_parameters():
            if "lora_B" in name:
                nn.init.zeros_(p)  # the student starts at the base
        if compute is not None:
            backend = "aot_eager" if device == "cpu" else "inductor"  # (the CPU: as in the peft test)
            config = CompileConfig(mode="blocks", base_compute=compute, backend=backend)
            compile_accel.apply(student, config, blocks=["blocks"])
        steps = 500
        optimizer = torch.optim.Adam(params, lr=2e-2)
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
        losses = []
        for _ in range(steps):
            x = torch.randn(64, width, device=device)
            with torch.no_grad():
                target = teacher(x) + noise * torch.randn(64, width, device=device)
            with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
                loss = (student(x).float() - target).square().mean()
            loss.backward()
            optimizer.step()
            decay.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return sum(losses[:5]) / 5, sum(losses[-30:]) / 30

    floor = noise**2
    start, own = final_loss(None)
    _, in_8_bits = final_loss(compute)
    assert start > 10 * floor
    assert own < 1.2 * floor and in_8_bits < 1.2 * floor, (own, in_8_bits, floor)
    assert abs(in_8_bits - own) <= 0.1 * own, (in_8_bits, own)


def test_the_accuracy_check_leaves_cuda_graph_trees_waiting_for_the_steps_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check's backward marks the trees' backward done; after the check they wait for the
    step's again, as before it (a tree that was not waiting is left as the check leaves it; a GPU
    without a tree is not given one). The GPU test below shows what it guards."""
    from torch._inductor import cudagraph_trees

    from compile_accel import base_compute_probe

    class Tree:
        running_forwards_with_pending_backwards = True

    trees = {0: Tree(), 1: Tree()}
    trees[1].running_forwards_with_pending_backwards = False
    asked = []

    def get_manager(index: int, create_if_none_exists: bool = True) -> Tree | None:
        asked.append((index, create_if_none_exists))
        return trees.get(index)

    monkeypatch.setattr(cudagraph_trees, "get_manager", get_manager)
    devices = {torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2), torch.device("cpu")}
    with base_compute_probe._step_backward_still_pending(devices):
        for tree in trees.values():
            tree.running_forwards_with_pending_backwards = False  # the check's backward
    assert trees[0].running_forwards_with_pending_backwards
    assert not trees[1].running_forwards_with_pending_backwards
    assert sorted(asked) == [(0, False), (1, False), (2, False)]


def _test_dit_on(device: str, checkpointing: str | None) -> tuple[nn.Module, list[nn.Parameter]]:
    model, params = build("kohya", checkpointing, dim=256, heads=4, text_dim=64)
    model.to(device)
    for network in getattr(model, "_test_network", []):
        network.to(device)
    return model, params


@pytest.mark.parametrize("mode, budget", [("blocks", 0.5), ("selective", None)])
@pytest.mark.parametrize("compute", [pytest.param(c, marks=_needs("cuda", c)) for c in base_compute.LINEARS])
def test_cuda_graphs_train_as_the_same_graphs_without_them(
    compute: str, mode: str, budget: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_mode="reduce-overhead" with 8-bit compute (every product): five steps of fresh inputs, LoRA weights
    updated in place and, after the third, a base weight changed in place, against the same config
    without CUDA graphs (fp32; tolerance 1e-2: where the two compilations' sums differ in the last
    bit, a quantization may round a value to the next int8 step, 0.25% of the LoRA gradients seen
    on an H200; a recorded tensor overwritten or a stale weight is off by far more). The accuracy check's
    forward and backward at the first step, inside the step's forward, must not free what the
    blocks before it recorded for the step's backward (CUDA graph trees took its backward for the
    step's end)."""
    monkeypatch.setattr(base_compute, "CUDA_MIN_ROWS", 0)
    monkeypatch.setattr(base_compute, "CUDA_MIN_WIDTH", 0)
    skips_before = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    checkpointing = "reentrant" if mode == "selective" else None
    torch.manual_seed(0)
    model, params = _test_dit_on("cuda", checkpointing)
    torch.manual_seed(0)
    twin, twin_params = _test_dit_on("cuda", checkpointing)
    config = CompileConfig(mode=mode, activation_memory_budget=budget, base_compute=compute)
    acceleration = compile_accel.apply(model, dataclasses.replace(config, compile_mode="reduce-overhead"))
    compile_accel.apply(twin, config)
    base = next(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "blocks" in n and "lora" not in n)

    def change_a_base_weight(step: int) -> None:
        if step == 2:
            for network in (model, twin):
                with torch.no_grad():
                    network.get_submodule(base).weight.mul_(-0.5)

    train_beside(model, params, twin, twin_params, steps=5, after_step=change_a_base_weight, tolerance=1e-2)
    stats = acceleration.stats()
    assert stats["recompiles"] == 0 and stats["fallbacks"] == [] and stats["cuda_graph_graphs"] > 0
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips_before  # CUDA graphs did run
    assert stats["base_compute"]["in_8_bits"] == stats["base_compute"]["base_linears"] > 0
    checks = stats["base_compute"]["accuracy"].values()
    assert checks and all(check.get("checks", 0) >= 1 for check in checks)


@pytest.mark.parametrize(
    "weights, autocast", [(torch.bfloat16, False), (torch.float32, True)], ids=["bf16", "autocast"]
)
def test_bf16_weights_and_bf16_autocast_against_bf16_compute(weights: torch.dtype, autocast: bool) -> None:
    """Against eager bf16 compute: the model in bf16, or in fp32 under bf16 autocast (the int8
    op's output takes the dtype F.linear gave)."""
    torch.manual_seed(torch.seed())
    model, params = _peft_mlp(_MLPBlock)
    model.to(weights)
    x = torch.randn(2, 24, 32, dtype=weights)

    def step() -> tuple[torch.Tensor, list[torch.Tensor]]:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().mean().backward()
        grads = [p.grad.float() for p in params]
        for p in params:
            p.grad = None
        return out.detach(), grads

    expected_out, expected_grads = step()
    config = CompileConfig(mode="blocks", base_compute="int8", backend="aot_eager")  # (as in the peft test)
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    out, grads = step()
    assert out.dtype == expected_out.dtype
    assert relative_error(out.float(), expected_out.float()) <= MAX_ERROR
    cosines = [_cosine(grad, expected) for grad, expected in zip(grads, expected_grads, strict=True)]
    assert min(cosines) >= MIN_COSINE, cosines
    assert acceleration.stats()["base_compute"]["in_8_bits"] == 4


def test_a_compile_worker_compiles_the_int8_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewritten graph, handed to a compile worker (which has the op: it imports compile_accel),
    runs uncompiled in int8 until it is back, then compiled."""
    from torch._inductor.utils import clear_caches

    from compile_accel import compile_workers

    # A cache of its own: the graph, compiled by the tests above, would load here from the shared one.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    clear_caches()
    torch.manual_seed(torch.seed())
    model, params = _peft_mlp(_MLPBlock)
    x = torch.randn(2, 24, 32)
    expected_loss, expected_grads = lora_step(model, params, (x,))
    config = CompileConfig(mode="blocks", base_compute="int8", compile_workers=1)
    acceleration = compile_accel.apply(model, config, blocks=["blocks"])
    try:
        steps = [lora_step(model, params, (x,))]  # uncompiled while the worker compiles
        compile_workers.first_step_done()
        assert compile_workers.wait_and_load() == 1
        steps.append(lora_step(model, params, (x,)))
    finally:
        compile_workers.stop()
        clear_caches()
    for loss, grads in steps:
        assert 0 < relative_error(loss, expected_loss) <= MAX_ERROR
        assert min(_cosine(grad, expected) for grad, expected in zip(grads, expected_grads, strict=True)) >= MIN_COSINE
    stats = acceleration.stats()
    assert (stats["worker_graphs_compiled"], stats["worker_failures"], stats["fallbacks"]) == (1, [], [])
    assert stats["base_compute"]["in_8_bits"] == 4


def test_a_precompiled_graph_finds_the_int8_kernel_again_by_its_module_and_name() -> None:
    """torch's precompiled graphs (compile_accel.precompile) name the Triton kernels they launch by
    module and name, and the next start imports them: a kernel made inside a function was not
    found there, and every int8 graph compiled again (on an H200)."""
    pytest.importorskip("triton")
    aot_types = pytest.importorskip("torch._dynamo.aot_compile_types")
    kernel = int8_matmul.scaled_int8_mm_kernel
    assert aot_types._deserialize_triton_kernel(aot_types._serialize_triton_kernel(kernel)) is kernel
