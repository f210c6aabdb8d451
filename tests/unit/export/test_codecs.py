"""Export codecs (modelopt_moe/export/codecs.py): the stored codes and scales are exactly training's.

The contract: decoding the exported codes and block scales with the training scales gives ``fake_quant`` bit for bit
(every element, bf16 / fp16 / fp32, edge amax and edge values); Model Optimizer's NVFP4 formula is that decode. The
reciprocal conventions (FP8 ``weight_scale``, compressed-tensors' ``weight_global_scale``) store the correctly rounded
reciprocal and their formula stays within one fp32 ulp. Packing and the formula agree with compressed-tensors' own
code.
"""

import pytest
import torch

from modelopt_moe.export import codecs
from modelopt_moe.numerics import fake_quant

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b)), f"{(a != b).sum().item()} elements differ"


def _weights(rows=8, cols=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows).unsqueeze(1)  # a magnitude per row
    return w.to(dtype)


EDGE_AMAX = [0.0, 2.0**-30, float("nan"), float("inf"), -1.0, 3.0e-3, 17.25]


def test_e2m1_codes_cover_all_sixteen_and_keep_negative_zero():
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = codecs.e2m1_codes(values)
    assert codes.tolist() == list(range(16))
    back = codecs.e2m1_values(codes)
    assert torch.equal(back, values)
    assert torch.equal(torch.signbit(back), torch.signbit(values))


@pytest.mark.parametrize("bad", [float("nan"), 0.75, 7.0])
def test_e2m1_codes_refuse_values_off_the_grid(bad):
    with pytest.raises(ValueError, match="not E2M1 values"):
        codecs.e2m1_codes(torch.tensor([1.0, bad]))


def test_pack_puts_the_even_column_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = codecs.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(codecs.unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even"):
        codecs.pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))


def test_packing_matches_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (6, 32), generator=g, dtype=torch.uint8)
    values = codecs.e2m1_values(codes)
    packed = codecs.pack_fp4(codes)
    assert torch.equal(pack_fp4_to_uint8(values), packed)
    assert torch.equal(unpack_fp4_from_uint8(packed, 6, 32, dtype=torch.float32), values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("amax", [None, *EDGE_AMAX])
def test_fp8_decode_is_fake_quant_bit_for_bit(dtype, amax):
    w = _weights(dtype=dtype)
    w[0, :4] = torch.tensor([float("inf"), -float("inf"), 1e6, -0.0])
    a = w.float().nan_to_num(posinf=0, neginf=0).abs().amax() * 0.5 if amax is None else torch.tensor(amax)
    codes, s = codecs.encode_fp8(w, a)
    assert codes.dtype == torch.float8_e4m3fn
    _assert_bits_equal(codecs.decode_fp8(codes, s, dtype), fake_quant(w, "e4m3", a))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_per_channel_decode_is_fake_quant_bit_for_bit(dtype):
    w = _weights(dtype=dtype)
    a = w.float().abs().amax(dim=1, keepdim=True) * torch.linspace(0.3, 1.0, w.shape[0]).unsqueeze(1)
    a[2] = 0.0  # an invalid channel amax: scale 1
    codes, s = codecs.encode_fp8(w, a)
    assert s.shape == (w.shape[0], 1)
    _assert_bits_equal(codecs.decode_fp8(codes, s, dtype), fake_quant(w, "e4m3", a))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("amax", [None, *EDGE_AMAX])
def test_nvfp4_decode_is_fake_quant_bit_for_bit(dtype, amax):
    w = _weights(dtype=dtype)
    w[1, :16] = 0.0  # an all-zero block
    w[2, 16:32] = 1e-9  # a block whose scale underflows E4M3
    w[3, 5] = float("inf")  # saturates its block
    w[4, 7] = -0.0
    a = w.float().nan_to_num(posinf=0).abs().amax() if amax is None else torch.tensor(amax)
    packed, block, sg = codecs.encode_nvfp4(w, a)
    assert packed.shape == (8, 32)
    assert packed.dtype == torch.uint8
    assert block.shape == (8, 4)
    assert block.dtype == torch.float8_e4m3fn
    assert sg.shape == ()
    expected = fake_quant(w, "nvfp4", a)
    _assert_bits_equal(codecs.decode_nvfp4(packed, block, sg, dtype), expected)
    _assert_bits_equal(codecs.decode_nvfp4_modelopt(packed, block, sg, dtype), expected)


def test_encoders_refuse_nan_weights_naming_the_tensor():
    w = _weights()
    w[3, 3] = float("nan")
    with pytest.raises(ValueError, match="experts.5.up_proj.weight: the weight holds NaN"):
        codecs.encode_nvfp4(w, torch.tensor(1.0), "experts.5.up_proj.weight")
    with pytest.raises(ValueError, match="holds NaN"):
        codecs.encode_fp8(w, torch.tensor(1.0))


def test_scale_conventions():
    amax = torch.tensor([1e-3, 0.37, 5.0, 448.0 * 6, 0.0])
    s = torch.stack([codecs.fp8_scale(a) for a in amax])
    sg = torch.stack([codecs.nvfp4_global_scale(a) for a in amax])
    assert torch.equal(s[:4], torch.div(torch.full((4,), 448.0), amax[:4]))
    assert s[4] == 1.0
    assert torch.equal(sg[:4], torch.div(amax[:4], torch.full((4,), 2688.0)))
    assert sg[4] == 1.0
    # compressed-tensors' global scale is the reciprocal of ours: 448 * 6 / amax, up to one rounding
    ct = codecs.reciprocal(sg[:4])
    ulps = (ct.view(torch.int32) - torch.div(torch.full((4,), 2688.0), amax[:4]).view(torch.int32)).abs()
    assert ulps.max() <= 1


def test_reciprocal_formulas_stay_within_an_fp32_ulp_or_two_of_training():
    """FP8's ``codes * weight_scale`` and compressed-tensors' ``value * (weight_scale / global_scale)`` hold the
    correctly rounded reciprocal of the training scale: no fp32 number is the exact reciprocal (unless the scale is a
    power of two), so FP8 may differ from training by one fp32 ulp and compressed-tensors' NVFP4 (two roundings:
    the scale division, then the product) by two, never more."""
    worst_fp8 = worst_nvfp4 = 0
    for seed in range(20):
        w = _weights(seed=seed)
        a = w.abs().amax() * (0.25 + seed / 20)
        codes, s = codecs.encode_fp8(w, a)
        got = codecs.decode_fp8_file(codes, codecs.reciprocal(s), torch.float32)
        worst_fp8 = max(worst_fp8, (got.view(torch.int32) - fake_quant(w, "e4m3", a).view(torch.int32)).abs().max())
        packed, block, sg = codecs.encode_nvfp4(w, a)
        got = codecs.decode_nvfp4_ct(packed, block, codecs.reciprocal(sg), torch.float32)
        worst_nvfp4 = max(worst_nvfp4,
                          (got.view(torch.int32) - fake_quant(w, "nvfp4", a).view(torch.int32)).abs().max())
    assert worst_fp8 <= 1
    assert worst_nvfp4 <= 2


def test_compressed_tensors_nvfp4_decoder_computes_the_documented_formula():
    """compressed-tensors' own decompress of our tensors == our decode_nvfp4_ct, rounded to bf16 (its output)."""
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    w = _weights(seed=3)
    packed, block, sg = codecs.encode_nvfp4(w, w.abs().amax())
    gs = codecs.reciprocal(sg).reshape(1)
    theirs = NVFP4PackedCompressor.decompress(
        {"weight_packed": packed, "weight_scale": block, "weight_global_scale": gs}, scheme)["weight"]
    _assert_bits_equal(theirs, codecs.decode_nvfp4_ct(packed, block, gs, torch.bfloat16))
