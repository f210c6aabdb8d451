"""Per-expert report numbers and plots on one process: global expert indices, the errors' meaning, PNGs written."""

import warnings

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization.nn import GroupedLinear
from modelopt_moe.report import gather_expert_stats

N = 4
SPLITS = [6, 0, 5, 9]  # expert 1 sees no token


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.experts = GroupedLinear(N, 32, 16)
        with torch.no_grad():
            for i, w in enumerate(self.experts.expert_weights()):
                w.mul_(1 + i)  # distinct magnitudes: a shared amax hurts the small experts

    def forward(self, x):
        return self.experts(x, SPLITS)


def _quantized(input_amax="per_expert", preset="fp8_default.yaml"):
    cfg = mtq.load_config(preset)
    cfg.experts.input_amax = input_amax
    x = torch.randn(sum(SPLITS), 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mtq.quantize(Tiny(), cfg, lambda m: m(x))


def test_expert_stats_hold_each_global_expert():
    model = _quantized()
    stats = gather_expert_stats(model)
    q = model.experts.weight_quantizer
    assert stats.num_experts == {"experts": N}
    assert stats.weight_amax["experts"] == q.amax.tolist()
    assert stats.input_seen["experts"] == [True, False, True, True]
    w = model.experts.weight0.detach()
    own = ((fake_quant(w, "e4m3", q.amax[0]) - w).square().sum() / w.square().sum()).item()
    assert stats.weight_error_own["experts"][0] == pytest.approx(own, rel=1e-6)


def test_a_shared_amax_costs_the_small_experts_on_a_uniform_grid():
    err = gather_expert_stats(_quantized(preset="int8_default.yaml"))
    own, shared = err.weight_error_own["experts"], err.weight_error_shared["experts"]
    assert shared[0] > 4 * own[0]  # expert 0 is 4x smaller than the largest: its INT8 steps get 4x coarser
    assert shared[0] > shared[1] > shared[2] > shared[3]


def test_a_shared_input_amax_counts_no_tokens_per_expert():
    assert gather_expert_stats(_quantized("shared")).input_seen["experts"] is None


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from modelopt_moe.report import plots

    stats = gather_expert_stats(_quantized())
    paths = [
        plots.loss_curves({"bf16": [(0, 3.0), (1, 2.5)], "QAD": [(2, 2.6), (3, 2.4)]}, tmp_path / "loss.png",
                          references={"bf16 eval": 2.45}),
        plots.expert_amax_heatmap(["layer 0 fc1", "layer 0 fc2"], [stats.weight_amax["experts"]] * 2,
                                  tmp_path / "amax.png"),
        plots.expert_weight_errors(stats.weight_error_shared["experts"], stats.weight_error_own["experts"],
                                   tmp_path / "errors.png"),
        plots.expert_input_amax({"layer 0 fc1": (stats.input_amax["experts"], stats.input_seen["experts"])},
                                tmp_path / "inputs.png"),
    ]
    for p in paths:
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
