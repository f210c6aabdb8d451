"""FP8 block-wise against what NVIDIA Model Optimizer 0.47 itself produced (tests/fixtures/modelopt_0_47/
fp8_block_cases.pt.xz, made by tools/make_modelopt_fp8_block_fixtures.py; Model Optimizer is not needed here): its
``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG`` and ``{"num_bits": (4, 3), "type": "dynamic", "block_sizes": {-1: 128}}`` inputs on
an ``nn.Linear(200, 160)`` (partial blocks at both ends of both dims), in fp32 and bf16.

bf16: bit-exact. fp32: Model Optimizer's FP8 block path computes ``448 / amax`` as a reciprocal times 448 and
multiplies by ``1 / scale``; this package divides (IEEE, the per-tensor convention: docs/modelopt_compat.md). Its
arithmetic written out reproduces its fixture bit for bit, which proves the difference is exactly that convention;
ours differs from it by at most 3 ulps, with no value on another FP8 level.
"""

import copy
import io
import lzma
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.checkpoint.modelopt_format import load_plain

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "modelopt_0_47" / "fp8_block_cases.pt.xz"
CASES = [f"{c}_{d}" for c in ("fp8_2d_weight_only", "fp8_2d_w8a8") for d in ("float32", "bfloat16")]


@pytest.fixture(scope="module")
def fixture():
    return load_plain(io.BytesIO(lzma.decompress(FIXTURE.read_bytes())))


def _ours(fixture, name):
    case = fixture["cases"][name]
    dtype = getattr(torch, case["dtype"])
    model = nn.Linear(200, 160)
    with torch.no_grad():
        model.weight.copy_(fixture["weight"])
        model.bias.copy_(fixture["bias"])
    model = model.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, copy.deepcopy(case["config"]), lambda m: m(fixture["calib"].to(dtype)))
    return model, case, dtype


def modelopt_block_fp8(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """Model Optimizer's CPU FP8 block arithmetic, written out: zero-pad to whole blocks, the block amax (an amax <=
    2**-24 taken as 1), ``scale = 448.0 / amax`` as torch computes a float over a tensor (a reciprocal times 448), and
    a multiply by ``1 / scale``."""
    xf = x.float()
    if len(block) == 1:
        pad = -xf.shape[-1] % block[0]
        view = nn.functional.pad(xf, (0, pad)).reshape(-1, block[0])
        amax = view.abs().amax(dim=-1, keepdim=True)
    else:
        pr, pc = -xf.shape[0] % block[0], -xf.shape[1] % block[1]
        view = nn.functional.pad(xf, (0, pc, 0, pr)).unflatten(1, (-1, block[1])).unflatten(0, (-1, block[0]))
        amax = view.abs().amax(dim=(1, 3), keepdim=True)
    amax = torch.where(amax <= 2.0 ** -24, torch.ones_like(amax), amax)
    scale = 448.0 / amax
    q = (view * scale).clamp(min=-448.0, max=448.0).to(torch.float8_e4m3fn).float() * (1 / scale)
    if len(block) == 1:
        out = q.reshape(*x.shape[:-1], -1)[..., : x.shape[-1]]
    else:
        out = q.flatten(2).flatten(0, 1)[: x.shape[0], : x.shape[1]]
    return out.to(x.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def test_fixture_was_made_by_model_optimizer_0_47(fixture):
    assert fixture["modelopt_version"] == "0.47.0"
    assert sorted(fixture["cases"]) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_model_optimizers_arithmetic_written_out_is_its_fixture(fixture, name):
    case = fixture["cases"][name]
    dtype = getattr(torch, case["dtype"])
    assert torch.equal(modelopt_block_fp8(fixture["weight"].to(dtype), (128, 128)), case["weight_q"])
    if case["input_q"] is not None:
        assert torch.equal(modelopt_block_fp8(fixture["test"].to(dtype), (128,)), case["input_q"])


@pytest.mark.parametrize("name", CASES)
def test_outputs_are_model_optimizers_bit_exact_in_bf16_within_3_ulps_in_fp32(fixture, name):
    model, case, dtype = _ours(fixture, name)
    with torch.no_grad():
        pairs = [(model.weight_quantizer(model.weight), case["weight_q"])]
        if case["input_q"] is not None:
            pairs.append((model.input_quantizer(fixture["test"].to(dtype)), case["input_q"]))
    for ours, theirs in pairs:
        if dtype == torch.bfloat16:
            assert torch.equal(ours, theirs)
        else:
            assert _ulps(ours, theirs) <= 3


def test_ours_quantizes_another_token_count_where_model_optimizers_1x128_inputs_refuse(fixture):
    model, case, dtype = _ours(fixture, "fp8_2d_w8a8_float32")
    assert case["fewer_tokens"].startswith("ValueError: Input shape has changed")
    with torch.no_grad():
        assert model(fixture["test"][:5]).shape == (5, 160)


def test_calibration_records_a_weight_max_where_model_optimizer_records_block_amaxes(fixture):
    model, case, _ = _ours(fixture, "fp8_2d_w8a8_float32")
    assert tuple(case["amax"]["weight_quantizer._amax"].shape) == (2, 1, 2, 1)  # its static per-block amax
    # Its block amaxes are the weight's block maxima: the numbers ours takes from the weights at every call.
    w = fixture["weight"].abs()
    assert case["amax"]["weight_quantizer._amax"][1, 0, 1, 0] == w[128:, 128:].max()
    assert sorted(k for k in model.state_dict() if k.endswith("_amax")) == ["weight_quantizer._amax"]
    assert model.weight_quantizer.amax == w.max()
