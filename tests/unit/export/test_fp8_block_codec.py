"""The FP8 block codec half (numerics/fp8.py: encode_fp8_blocks): the E4M3 codes training rounded to and one scale
per 128 x 128 block (partial blocks included), read back by compressed-tensors' own ``FP8_BLOCK`` decoder."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize

from modelopt_moe.numerics import fake_quant
from modelopt_moe.numerics.format import reciprocal
from modelopt_moe.numerics.fp8 import encode_fp8_blocks

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weight(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * torch.logspace(-3, 2, 300).unsqueeze(1)
    w[130:140, 0:128] = 0.0
    w[0, 0] = float("inf")
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_over_the_block_divisors_are_fake_quant_bit_for_bit(dtype):
    w = _weight(dtype)
    codes, s = encode_fp8_blocks(w)
    assert codes.dtype == torch.float8_e4m3fn
    assert codes.shape == w.shape
    assert s.shape == (3, 3)
    per_element = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    decoded = torch.div(codes.float(), per_element).to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(decoded.view(bits), fake_quant(w, "e4m3", None, (128, 128)).view(bits))


def test_compressed_tensors_reads_the_codes_and_scales_within_one_ulp():
    w = _weight(torch.float32)
    codes, s = encode_fp8_blocks(w)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128],
                            dynamic=False)
    got = dequantize(codes, reciprocal(s), None, args, torch.float32)
    want = fake_quant(w, "e4m3", None, (128, 128))
    # The file's multiplicative scale 1 / s is one rounding away from training's divisor (as per tensor).
    assert int((got.view(torch.int32).long() - want.view(torch.int32).long()).abs().max()) <= 1


def test_a_nan_or_3d_weight_is_refused_naming_it():
    w = _weight(torch.float32)
    w[5, 5] = float("nan")
    with pytest.raises(ValueError, match="layers.0.mlp.weight: the weight holds NaN"):
        encode_fp8_blocks(w, name="layers.0.mlp.weight")
    with pytest.raises(ValueError, match="2-D weight"):
        encode_fp8_blocks(torch.ones(2, 3, 4))
