"""The MX references (modelopt_moe/numerics/mx.py: MXFP4, MXFP8) against values checked by hand, Model Optimizer
0.47's rules (the E8M0 exponent ``clamp(ceil(log2(amax / m)), -127, 127)``, an all-zero block giving scale 1, Inf
counted as the largest finite fp32 in the block maximum, padded blocks), and its CPU exporters where both round the
same way."""

import math

import pytest
import torch

from modelopt_moe.numerics.mx import MXFP4, MXFP8, e8m0_exponent, encode_mx

NAN, INF = float("nan"), float("inf")


def _block(*head: float, k: int = 32) -> torch.Tensor:
    """One row of ``k`` elements starting with ``head``, zeros after."""
    return torch.tensor([[*head] + [0.0] * (k - len(head))], dtype=torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                                              b.view(torch.int32 if b.dtype == torch.float32 else torch.int16))


@pytest.mark.parametrize(("amax", "e"), [
    (6.0, 0),  # amax / 6 = 1 exactly: log2 is an integer
    (5.0, 0),  # 5 / 6 = 0.83: ceil(-0.26)
    (7.0, 1),  # 7 / 6 = 1.17: ceil(0.22)
    (12.0, 1),
    (6.0000005, 1),  # the next fp32 above 6: a quotient just above 1 rounds the exponent up
    (3.0, -1),
    (1.0, -2),  # 1 / 6 = 0.17: ceil(-2.58)
    (448.0, 7),  # 74.7: ceil(6.22)
    (3.4e38, 126),  # the fp32 range ends before the clamp at 127
    (6 * 2.0**-127, -127),  # a quotient of exactly 2**-127 (an fp32 subnormal)
    (9 * 2.0**-127, -126),  # a quotient of 1.5 * 2**-127: ceil(-126.4)
    (2.0**-149, -127),  # the quotient underflows to 0: the clamp
    (0.0, 0), (INF, 0), (NAN, 0),  # Model Optimizer's invalid amax: scale 1
])
def test_e8m0_exponent_is_model_optimizers_ceil_of_log2_of_amax_over_6(amax, e):
    assert e8m0_exponent(torch.tensor([amax]), 6.0).tolist() == [e]


def test_the_exponent_differs_from_the_ocp_rule_exactly_where_the_block_max_significand_exceeds_1_5():
    amax = torch.tensor([4.0, 5.0, 6.0, 6.5, 7.0, 7.9, 0.375, 0.4, 100.0])
    ocp = torch.tensor([math.floor(math.log2(a)) - 2 for a in amax.tolist()], dtype=torch.int32)
    significand = torch.tensor([a / 2 ** math.floor(math.log2(a)) for a in amax.tolist()])
    ours = e8m0_exponent(amax, 6.0)
    assert torch.equal(ours != ocp, significand > 1.5)
    assert torch.equal(ours[ours != ocp], ocp[ours != ocp] + 1)


def test_fake_quant_of_one_block_checked_by_hand():
    # amax 7 -> e = 1, scale 1/2 (x -> x/2 -> E2M1 -> times 2): 7 -> 3.5 (tie, even) -> 4 -> 8; 2.5 -> 1.25 (tie)
    # -> 1 -> 2; 0.9 -> 0.45 -> 0.5 -> 1; 0.5 -> 0.25 (tie) -> 0; 0.51 -> 0.255 -> 0.5 -> 1; -3 -> -1.5 -> -3;
    # 1.5 -> 0.75 (tie) -> 1 -> 2; 5.5 -> 2.75 -> 3 -> 6.
    x = _block(7.0, 2.5, 0.9, 0.5, 0.51, -3.0, 1.5, 5.5, -0.0)
    out = MXFP4.fake_quant(x)
    assert out[0, :9].tolist() == [8.0, 2.0, 1.0, 0.0, 1.0, -3.0, 2.0, 6.0, -0.0]
    assert math.copysign(1.0, out[0, 8].item()) == -1.0  # -0.0 keeps its sign
    # amax 6 -> e = 0: values round on the E2M1 grid itself, never clipped (amax * 2**-e <= 6).
    assert MXFP4.fake_quant(_block(6.0, 5.0, 3.5, 0.25, 0.75))[0, :5].tolist() == [6.0, 4.0, 4.0, 0.0, 1.0]


def test_edge_blocks_zero_nan_inf():
    zero = MXFP4.fake_quant(_block())
    assert torch.equal(zero, torch.zeros_like(zero))
    # NaN is ignored by the block max and stays in its own element.
    out = MXFP4.fake_quant(_block(NAN, 3.0, 0.7))
    assert math.isnan(out[0, 0].item())
    assert out[0, 1:3].tolist() == [3.0, 0.75]  # amax 3 -> e = -1: 0.7 -> 1.4 -> 1.5 -> 0.75
    assert not torch.isnan(out[0, 1:]).any()
    nan_only = MXFP4.fake_quant(_block(NAN, NAN, k=32))
    assert torch.isnan(nan_only[0, :2]).all()
    assert torch.equal(nan_only[0, 2:], torch.zeros(30))
    # Inf counts as the largest finite fp32 in the block max (Model Optimizer clamps |x| to FLT_MAX before its
    # reduction): e = 126, Inf saturates to 6 and 6 * 2**126 overflows back to Inf; the rest rounds at 2**126 (to 0).
    assert MXFP4.fake_quant(_block(INF, -INF, 0.3, 7.0, 1e-3))[0, :5].tolist() == [INF, -INF, 0.0, 0.0, 0.0]
    assert MXFP4.quantize(_block(INF)).scale.flatten().tolist() == [2.0**-126]


def test_each_block_of_a_row_gets_its_own_exponent_and_a_partial_last_block_is_padded():
    x = torch.cat([_block(96.0, 5.0), _block(0.09375, 0.03)], dim=1)  # K = 64: blocks of 32
    x = torch.cat([x, torch.tensor([[0.7, -0.2]])], dim=1)  # K = 66: a last block of 2
    out = MXFP4.fake_quant(x)
    # 96 -> e = 4: 5 / 16 = 0.3125 -> 0.5 -> 8; 0.09375 -> e = -6: 0.03 * 64 = 1.92 -> 2 -> 0.03125;
    # last block amax 0.7 -> e = -3: -0.2 * 8 = -1.6 -> -1.5 -> -0.1875.
    assert out[0, [0, 1, 32, 33, 64, 65]].tolist() == [96.0, 8.0, 0.09375, 0.03125, 0.75, -0.1875]
    assert out.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_same_dtype_out_and_quantize_dequantize_equal_fake_quant(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 80, generator=g) * torch.logspace(-3, 3, 8).unsqueeze(-1)).to(dtype)
    out = MXFP4.fake_quant(x)
    assert out.dtype == dtype
    assert _same_bits(out, MXFP4.dequantize(MXFP4.quantize(x)).to(dtype))


def test_blocks_are_32_and_no_amax_is_needed():
    assert not MXFP4.needs_amax(None)
    assert MXFP4.fake_quant(_block(1.0), block_size=32).shape == (1, 32)
    with pytest.raises(ValueError, match="mxfp4 uses blocks of 32, got block_size=16"):
        MXFP4.fake_quant(_block(1.0), block_size=16)


def test_model_optimizers_cpu_exporter_gives_the_same_exponents_and_values_away_from_ties():
    mxfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.mxfp4_tensor")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64).unsqueeze(-1)
    packed, e8m0 = mxfp4_tensor.MXFP4QTensor.quantize(x, 32)
    theirs = packed.dequantize(torch.float32, scale=e8m0, block_sizes={-1: 32}).reshape(x.shape)
    qx = MXFP4.quantize(x)
    assert torch.equal(e8m0.reshape(-1).to(torch.int32) - 127, (-torch.log2(qx.scale)).reshape(-1).to(torch.int32))
    assert _same_bits(MXFP4.fake_quant(x), theirs)
    # Ties: its exporter rounds toward zero, its fake quant (and ours) to even.
    tie = _block(6.0, 0.75)
    packed, e8m0 = mxfp4_tensor.MXFP4QTensor.quantize(tie, 32)
    assert packed.dequantize(torch.float32, scale=e8m0, block_sizes={-1: 32})[0, 1].item() == 0.5
    assert MXFP4.fake_quant(tie)[0, 1].item() == 1.0


# ------------------------------------------------------------------------------------------------------------ MXFP8


def test_mxfp8_of_one_block_checked_by_hand():
    # amax 500 -> 500 / 448 = 1.12: e = 1, scale 1/2: 500 -> 250 -> E4M3 256 (3 mantissa bits: 240, 256) -> 512;
    # 3 -> 1.5 -> 3; 0.01 -> 0.005 -> an E4M3 subnormal (steps of 2**-9): 2.56 steps -> 3 * 2**-9 -> 0.01171875;
    # -7.3 -> -3.65 -> (steps of 0.25 in [2, 4)) -3.75 -> -7.5.
    x = _block(500.0, 3.0, 0.01, -7.3)
    assert MXFP8.fake_quant(x)[0, :4].tolist() == [512.0, 3.0, 0.01171875, -7.5]
    # amax 448 exactly: e = 0 (no clip: amax * 2**-e <= 448), values round on the E4M3 grid itself.
    assert MXFP8.fake_quant(_block(448.0, 449.0 / 2))[0, :2].tolist() == [448.0, 224.0]
    assert e8m0_exponent(torch.tensor([448.0, 448.5, 224.0, 0.0]), 448.0).tolist() == [0, 1, -1, 0]
    # Inf: the block max counts FLT_MAX, e = 120; Inf -> 448 * 2**120 overflows back to Inf.
    inf = MXFP8.fake_quant(_block(INF, 1.0))
    assert inf[0, :2].tolist() == [INF, 0.0]
    assert MXFP8.quantize(_block(INF)).scale.flatten().tolist() == [2.0**-120]
    # NaN stays in its element (Model Optimizer's MXFP8 keeps it too).
    nan = MXFP8.fake_quant(_block(NAN, 5.0))
    assert math.isnan(nan[0, 0].item())
    assert nan[0, 1].item() == 5.0


@pytest.mark.parametrize("fmt", [MXFP4, MXFP8], ids=lambda f: f.name)
def test_encode_gives_compressed_tensors_what_training_rounded_to(fmt):
    """compressed-tensors' own MX decoders, given our codes and E8M0 scales, return the fake-quantized weight; an
    E2M1 tie is stored as the fake quant rounded it (to even), not as Model Optimizer's exporter rounds (to zero)."""
    compressors = pytest.importorskip("compressed_tensors.compressors")
    from compressed_tensors.quantization import preset_name_to_scheme

    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 96, generator=g) * torch.logspace(-8, 8, 16).unsqueeze(-1)
    w[0, :3] = torch.tensor([6.0, 0.75, -2.5])  # E2M1 ties at scale 1
    codes, e8m0 = encode_mx(w, fmt)
    assert e8m0.dtype == torch.uint8
    assert e8m0.shape == (16, 3)
    scheme = preset_name_to_scheme(fmt.label, ["Linear"])
    if fmt is MXFP4:
        theirs = compressors.MXFP4PackedCompressor.decompress({"weight_packed": codes, "weight_scale": e8m0}, scheme)
    else:
        theirs = compressors.MXFP8QuantizationCompressor.decompress({"weight": codes, "weight_scale": e8m0}, scheme)
    want = fmt.fake_quant(w)
    assert torch.equal(theirs["weight"].float(), want)  # exact: few significant bits times a power of two
    assert want[0, 1].item() == (1.0 if fmt is MXFP4 else 0.75)
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_mx(w[:, :40], fmt, "layer.weight")
