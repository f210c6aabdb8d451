"""The exact power-of-two rescaling of the experts' fc2 inputs without a framework: its scales, the clamp that keeps
every scaled weight finite and normal (so the rescale is exact and undoes itself bit for bit), and the config key
``smooth_expert_inputs`` validated like every other key (dict and YAML)."""

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.config import ConfigError, to_config
from modelopt_moe.quantization.nn import GroupedLinear
from modelopt_moe.quantization.smooth_experts import (
    ExpertMLP,
    exact_exponents,
    power_of_two_exponents,
    scale_channels,
    smooth_expert_inputs,
)


def test_exact_ties_round_to_even_so_the_rule_finds_nothing_more_to_do_on_rescaled_statistics():
    x, w = torch.tensor([2.0, 8.0, 3.0, 0.75]), torch.ones(4)
    e = power_of_two_exponents(x, w, 0.5)  # log2 sqrt(x): 0.5 and 1.5 are exact ties (to even: 0 and 2)
    assert e.tolist() == [0.0, 2.0, 1.0, 0.0]
    s = torch.exp2(e)
    assert power_of_two_exponents(x / s, w * s, 0.5).tolist() == [0.0] * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_rescale_is_exact_and_undoes_itself_bit_for_bit(dtype):
    torch.manual_seed(0)
    up, fc2 = torch.randn(32, 16).to(dtype), torch.randn(24, 32).to(dtype)
    bias = torch.randn(32).to(dtype)
    s = torch.exp2(torch.randint(-6, 7, (32,)).float())
    e = exact_exponents(torch.log2(s), up, bias, fc2)
    assert torch.equal(e, torch.log2(s).long())  # far from the dtype's limits: nothing clamped
    before = (up.clone(), bias.clone(), fc2.clone())
    scale_channels(up, bias, fc2, e)
    assert torch.equal(up.double() * s.double()[:, None], before[0].double())  # exact: no rounding anywhere
    assert torch.equal(fc2.double(), before[2].double() * s.double()[None, :])
    scale_channels(up, bias, fc2, -e)
    for got, want in zip((up, bias, fc2), before, strict=True):
        assert torch.equal(got, want)


def test_exponents_are_clamped_so_that_every_scaled_weight_stays_finite_and_normal():
    f16 = torch.float16  # max 65504, smallest normal 2**-14
    up = torch.tensor([[1.0, 2.0], [1.0, 2.0], [2.0**-12, 1.0], [2.0**-15, 1.0]], dtype=f16)
    fc2 = torch.tensor([[20000.0, 1.0, 1.0, 2.0**-20], [1.0, 1.0, 1.0, 1.0]], dtype=f16)
    e = exact_exponents(torch.tensor([3.0, -20.0, 3.0, 1.0]), up, None, fc2)
    # channel 0: fc2 * 2**e <= 65504 allows e <= 1; channel 1: up / 2**e <= 65504 allows e >= -14 (2 * 2**14 is the
    # largest power-of-two multiple below the max); channel 2: up's 2**-12 / 2**e stays normal for e <= 2; channel 3:
    # subnormal weights on both sides (2**-15 in up, 2**-20 in fc2) leave no exact exponent but 0 there: s = 1
    assert e.tolist() == [1, -14, 2, 0]
    before = (up.clone(), fc2.clone())
    scale_channels(up, None, fc2, e)
    assert torch.isfinite(up).all()
    assert torch.isfinite(fc2).all()
    scale_channels(up, None, fc2, -e)
    assert torch.equal(up, before[0])
    assert torch.equal(fc2, before[1])


def test_the_config_key_is_validated_naming_the_key_the_value_and_what_is_expected(tmp_path):
    assert to_config({}).smooth_expert_inputs is None  # off by default
    assert to_config({"smooth_expert_inputs": {}}).smooth_expert_inputs.alpha == 0.5
    with pytest.raises(ConfigError, match=r"key 'smooth_expert_inputs.alpha': Input should be less than or equal to "
                                          r"1 \(got 1.5\)"):
        to_config({"smooth_expert_inputs": {"alpha": 1.5}})
    with pytest.raises(ConfigError, match=r"unknown key 'alpah' \(did you mean 'alpha'\?\); allowed keys: alpha"):
        to_config({"smooth_expert_inputs": {"alpah": 0.5}})
    path = tmp_path / "smooth.yaml"
    path.write_text("$import: nvfp4_default.yaml\nsmooth_expert_inputs: {alpha: -0.25}\n")
    with pytest.raises(ConfigError, match=rf"{path}: key 'smooth_expert_inputs.alpha': Input should be greater than "
                                          r"or equal to 0 \(got -0.25\)"):
        mtq.load_config(path)
    path.write_text("$import: nvfp4_default.yaml\nsmooth_expert_inputs: {alpha: 0.25}\n")
    assert mtq.load_config(path).smooth_expert_inputs.alpha == 0.25


def test_quantize_refuses_the_rescale_without_calibration_data_and_changes_nothing():
    experts = GroupedLinear(num_gemms=2, in_features=16, out_features=8)
    cfg = {**mtq.FP8_DEFAULT_CFG, "smooth_expert_inputs": {"alpha": 0.5}}
    with pytest.raises(ValueError, match=r"smooth_expert_inputs=\{'alpha': 0.5\} rescales the experts' fc2 inputs "
                                         r"from calibration data .*\(forward_loop=None"):
        mtq.quantize(experts, cfg)
    assert not any(hasattr(m, "weight_quantizer") for m in experts.modules())


def test_a_model_without_expert_layers_warns_and_is_quantized_as_without_the_key():
    tokens = torch.randn(12, 16)
    chunks = [GroupedLinear(num_gemms=2, in_features=16, out_features=8) for _ in range(2)]
    weights = [c.weight0.detach().clone() for c in chunks]
    cfg = {**mtq.FP8_DEFAULT_CFG, "smooth_expert_inputs": {"alpha": 0.5}}
    with pytest.warns(UserWarning, match="smooth_expert_inputs rescales the experts' fc2 inputs, but the model has "
                                         "no expert layer"):
        mtq.quantize(chunks, cfg, lambda model: [c(tokens, [6, 6]) for c in model])  # the chunk list
    assert all(torch.equal(c.weight0, w) for c, w in zip(chunks, weights, strict=True))
    assert all(c.input_quantizer.amax is not None for c in chunks)


def test_a_channel_whose_fc2_inputs_held_an_inf_keeps_scale_one_and_nan_is_left_out():
    torch.manual_seed(0)
    hidden, ffn = 8, 4
    fc1 = torch.nn.Linear(hidden, 2 * ffn, bias=False)
    fc2 = torch.nn.Linear(ffn, hidden, bias=False)
    layer = ExpertMLP("expert", [fc1.weight], [None], [fc2.weight], [fc2], groups=())
    h = torch.full((3, ffn), 64.0)  # large inputs on every channel: SmoothQuant moves range into fc2 (s > 1)
    h[0, 0] = float("inf")  # channel 0 saw an Inf
    h[1, 1] = float("nan")  # channel 1 a NaN, left out: its scale comes from the 64s
    rescale = smooth_expert_inputs(fc2, lambda model: model(h), 0.5, mlps=[layer], groups={})
    e = rescale.exponents[0][0]
    assert e[0] == 0
    assert torch.equal(e[1:], e[2:3].expand(3))
    assert e[2] > 0
