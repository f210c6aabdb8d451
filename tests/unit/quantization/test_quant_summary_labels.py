"""The quantizer summary names each expert amax layout as the config wrote it."""

import torch

import modelopt_moe.quantization as mtq
from modelopt_moe.quantization.nn import GroupedLinear


def test_summary_shows_input_amax_per_expert_as_configured():
    cfg = mtq.load_config("fp8_default.yaml")
    cfg.experts.input_amax = "per_expert"
    experts = GroupedLinear(num_gemms=4, in_features=16, out_features=8)
    tokens = torch.randn(20, 16)
    mtq.quantize(experts, cfg, lambda model: model(tokens, [5, 5, 5, 5]))
    summary = mtq.print_quant_summary(experts, file=False).splitlines()
    lines = {line.split()[0]: line for line in summary if not line.startswith(" ")}  # not the amax table
    assert lines["input_quantizer"].split()[1] == "per_expert,", lines["input_quantizer"]
    assert lines["weight_quantizer"].split()[1] == "vectorized,", lines["weight_quantizer"]
