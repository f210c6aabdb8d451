"""``mtq.NVFP4_4OVER6_CFG``: NVFP4 whose block scales are chosen by the 4-over-6 rule at every forward, through the
public API the way a training script uses it."""

import torch
import torch.nn.functional as F

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics.formats import fake_quant


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


def test_the_preset_quantizes_weights_and_inputs_with_four_over_six_block_scales():
    x = torch.randn(8, 64)
    model = mtq.quantize(_model(), mtq.NVFP4_4OVER6_CFG, lambda m: m(x))
    l0, l2 = model[0], model[2]
    # each GEMM's weight and input, fake-quantized by the 4-over-6 reference with the calibrated amaxes
    h = torch.relu(F.linear(fake_quant(x, "nvfp4_four_over_six", l0.input_quantizer.amax),
                            fake_quant(l0.weight, "nvfp4_four_over_six", l0.weight_quantizer.amax), l0.bias))
    want = F.linear(fake_quant(h, "nvfp4_four_over_six", l2.input_quantizer.amax),
                    fake_quant(l2.weight, "nvfp4_four_over_six", l2.weight_quantizer.amax), l2.bias)
    with torch.no_grad():
        got = model(x)
        assert torch.equal(got, want.detach())
        plain = mtq.quantize(_model(), mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))(x)
    assert not torch.equal(got, plain)  # the rule is not plain NVFP4's
