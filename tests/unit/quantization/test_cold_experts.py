"""Cold experts without a framework: the summary shows how many calibration tokens each expert's input quantizer
saw (and which saw none), ``moe_calib_experts_ratio`` is validated, and a ratio that widens no MoE layer says so."""

import warnings

import pytest
import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.config import ConfigError, to_config
from modelopt_moe.quantization.nn import GroupedLinear


def _experts(algorithm="max"):
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.input_amax = "per_expert"
    experts = GroupedLinear(num_gemms=4, in_features=16, out_features=8)
    tokens = torch.randn(20, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mtq.quantize(experts, {**cfg.model_dump(), "algorithm": algorithm}, lambda m: m(tokens, [5, 0, 10, 5]))
    return experts, [str(w.message) for w in caught]


def test_the_summary_shows_each_experts_calibration_tokens_and_the_cold_ones():
    experts, _ = _experts()
    lines = {line.split()[0]: line for line in mtq.print_quant_summary(experts, file=False).splitlines()
             if not line.startswith(" ")}
    assert lines["input_quantizer"].endswith("tokens 0..10 (none: local experts [1])"), lines["input_quantizer"]
    assert "tokens" not in lines["weight_quantizer"]  # weights calibrate from themselves, on no tokens
    assert experts.input_quantizer.calibrated_rows.tolist() == [5, 0, 10, 5]


def test_a_ratio_that_widens_no_moe_layer_warns_and_changes_nothing():
    plain, _ = _experts()
    wide, messages = _experts({"method": "max", "moe_calib_experts_ratio": 1.0})
    assert any("moe_calib_experts_ratio=1.0 widens no MoE layer" in m for m in messages), messages
    assert wide.input_quantizer.calibrated_rows.tolist() == [5, 0, 10, 5]


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5])
def test_a_ratio_outside_0_1_is_refused(ratio):
    with pytest.raises(ConfigError, match="moe_calib_experts_ratio"):
        to_config({"algorithm": {"method": "max", "moe_calib_experts_ratio": ratio}})


def test_a_ratio_is_kept_by_the_config():
    cfg = to_config({"algorithm": {"method": "max", "moe_calib_experts_ratio": 0.5}})
    assert cfg.max_calib.moe_calib_experts_ratio == 0.5
    assert to_config(cfg.model_dump()).max_calib.moe_calib_experts_ratio == 0.5
