"""`QuantizedLinear` and its methods' maths against plain torch: the stored tensors, each forward against the
dequantized weight, row independence (what batching relies on), and the shapes tensor parallel cuts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffuserve.quant.apply import quantize_module
from diffuserve.quant.linear import QuantizedLinear
from diffuserve.quant.methods import dequantize_weight, kernel_for, linear_weight_only

METHODS = ("fp8", "int8", "int8-dynamic")


def _linear(seed: int = 0, n_in: int = 48, n_out: int = 40) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out)


@pytest.mark.parametrize("method", METHODS)
def test_a_quantized_linear_is_a_linear_of_plain_tensors(method: str) -> None:
    base = _linear()
    layer = QuantizedLinear(base, method, torch.device("cpu"))
    assert isinstance(layer, torch.nn.Linear) and (layer.in_features, layer.out_features) == (48, 40)
    assert layer.weight.dtype == (torch.float8_e4m3fn if method == "fp8" else torch.int8)
    assert type(layer.weight) is torch.nn.Parameter and not layer.weight.requires_grad
    assert layer.weight_scale.shape == (40,) and layer.weight_scale.dtype == torch.float32
    assert layer.bias is base.bias
    assert {n for n, _ in layer.named_parameters()} == {"weight", "weight_scale", "bias"}
    # Per-output-row scales: the dequantized weight is the original within the method's step.
    err = (dequantize_weight(layer.weight, layer.weight_scale, torch.float32) - base.weight).abs().max(dim=1).values
    step = base.weight.abs().amax(dim=1) / (127 if method != "fp8" else 8)
    assert bool((err <= step).all())


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_forward_matches_the_dequantized_weight_and_rows_are_independent(method: str) -> None:
    base = _linear(1)
    layer = QuantizedLinear(base, method, torch.device("cpu"))
    x = torch.randn(3, 7, 48)
    y = layer(x)
    exact = F.linear(x, dequantize_weight(layer.weight, layer.weight_scale, torch.float32), base.bias)
    tol = 1e-5 if method != "int8-dynamic" else 0.02 * float(exact.abs().max())  # + the activations' rounding
    assert y.shape == (3, 7, 40) and y.dtype == torch.float32
    assert float((y - exact).abs().max()) <= tol
    for row in range(3):  # a row's numbers never depend on its batch neighbours (per-token activation scales)
        assert torch.equal(layer(x[row : row + 1]), y[row : row + 1])


@pytest.mark.parametrize("method", METHODS)
def test_an_all_zero_row_quantizes_to_zeros(method: str) -> None:
    """Zero-initialised layers exist (adapters, some modulation heads): a zero row must not become 0 / 0."""
    base = _linear(4)
    with torch.no_grad():
        base.weight[3] = 0
    layer = QuantizedLinear(base, method, torch.device("cpu"))
    weight = dequantize_weight(layer.weight, layer.weight_scale, torch.float32)
    assert not weight.isnan().any() and not weight[3].any()
    with torch.no_grad():
        assert torch.isfinite(layer(torch.zeros(2, 48))).all()


def test_bf16_compute_dtype_and_the_kernel_choice() -> None:
    layer = QuantizedLinear(_linear(2).to(torch.bfloat16), "int8", torch.device("cpu"))
    assert layer(torch.randn(2, 48, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert kernel_for("fp8", torch.device("cpu"), 64, 64) == "weight-only"  # no FP8 GEMM on a CPU
    assert kernel_for("fp8", torch.device("cpu"), 64, 64, torch.float32) == "weight-only"
    assert kernel_for("int8-dynamic", torch.device("cpu"), 64, 64) == "int8-dynamic"


def test_tensor_parallel_shards_keep_their_scales() -> None:
    """Column-wise: a slice of output rows with its slice of scales computes that slice of the output. Row-wise: a
    slice of input columns with the whole scale gives partial sums that add up to the output."""
    layer = QuantizedLinear(_linear(3), "int8", torch.device("cpu"))
    x = torch.randn(5, 48)
    full = layer(x) - layer.bias
    w, s = layer.weight, layer.weight_scale
    cols = linear_weight_only(x, w[10:30], s[10:30], None)
    assert torch.allclose(cols, full[:, 10:30], atol=1e-5)
    parts = linear_weight_only(x[:, :24], w[:, :24], s, None) + linear_weight_only(x[:, 24:], w[:, 24:], s, None)
    assert torch.allclose(parts, full, atol=1e-5)


def test_quantize_module_keeps_what_the_patterns_name_and_shared_modules_once() -> None:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"x_embedder": torch.nn.Linear(8, 8), "blocks": torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])}
    )
    model["tied"] = model["blocks"][0]  # one module under two names stays one module
    report = quantize_module(model, "int8", ("x_embedder",), torch.device("cpu"))
    assert (report.quantized, report.kept) == (2, 1)
    assert type(model["x_embedder"]) is torch.nn.Linear and model["tied"] is model["blocks"][0]
    assert isinstance(model["blocks"][1], QuantizedLinear) and report.bytes_after < report.bytes_before
