"""Per-expert report numbers and plots on one process: global expert indices, the errors' meaning, PNGs written."""

import warnings

import pytest
import torch
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.numerics import fake_quant
from modelopt_moe.quantization.nn import GroupedLinear
from modelopt_moe.report import gather_expert_stats
from modelopt_moe.report.outcome import qad_outcome

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
        plots.loss_curves({"bf16": [(0, 3.0), (1, 2.5)], "QAD": [(2, 2e-4), (3, 1e-4)]}, tmp_path / "loss.png",
                          references={"QAD": {"held-out KL after PTQ": 2e-4, "held-out KL after QAD": 1.5e-4}},
                          held_out={"PTQ": (1e-3, 4e-4), "QAD": (5e-4, 3e-4)}, held_out_baseline="bf16 teacher",
                          log_panels=["QAD"]),
        plots.expert_amax_heatmap(["layer 0 fc1", "layer 0 fc2"], [stats.weight_amax["experts"]] * 2,
                                  tmp_path / "amax.png"),
        plots.expert_weight_errors(stats.weight_error_shared["experts"], stats.weight_error_own["experts"],
                                   tmp_path / "errors.png", note="why the two are close"),
        plots.expert_input_amax({"layer 0 fc1": (stats.input_amax["experts"], stats.input_seen["experts"])},
                                tmp_path / "inputs.png"),
    ]
    for p in paths:
        assert p.is_file()
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# Held-out losses of 4 batches: batch-to-batch spread (0.1) far above the differences between models, as on real data.
BF16 = [3.5, 3.4, 3.6, 3.5]


def _outcome(ptq_gap, qad_change, kl=(2e-4, 1e-4)):
    ptq = [b + g for b, g in zip(BF16, ptq_gap, strict=True)]
    qad = [p + c for p, c in zip(ptq, qad_change, strict=True)]
    return qad_outcome(BF16, ptq, qad, [kl[0] * f for f in (1, 0.9, 1.1, 1.05)], [kl[1] * f for f in (1, 1.1, 1.2, 1)])


def test_qad_that_made_the_held_out_loss_worse_is_said_plainly():
    out = _outcome([0.0010, 0.0012, 0.0011, 0.0013], [0.005, 0.006, 0.007, 0.0065])
    assert out["verdict"] == "worse"
    assert out["share_closed"] is None
    assert "QAD made the held-out loss WORSE: up by 0.0061" in out["text"]
    assert "held-out KL to the teacher 0.000203 -> 0.000107 (down 47%" in out["text"]
    assert "% of the PTQ loss gap" not in out["text"]  # no negative share of a gap


def test_a_share_of_the_gap_only_where_the_gap_exceeds_its_noise():
    clear = _outcome([0.10, 0.12, 0.11, 0.13], [-0.05, -0.06, -0.055, -0.065])
    assert clear["verdict"] == "better"
    assert clear["share_closed"] == pytest.approx(0.5, abs=1e-9)
    assert "50% ± " in clear["text"]
    assert "of the PTQ loss gap (+0.11 ± 0.0065) closed" in clear["text"]
    noisy = _outcome([0.004, -0.003, 0.002, -0.001], [-0.001, 0.002, -0.002, 0.0005])
    assert noisy["verdict"] == "within noise"
    assert noisy["share_closed"] is None
    assert "is not larger than twice its noise, so no share of it closed is reported" in noisy["text"]
    below = _outcome([-0.0011, -0.0014, -0.0009, -0.0012], [0.0023, 0.0029, 0.0019, 0.0025])
    assert below["verdict"] == "worse"
    assert below["share_closed"] is None
    assert "PTQ's held-out loss was below the teacher's (-0.0011 ± 0.0001): no loss gap to close" in below["text"]
    one = qad_outcome([3.5], [3.6], [3.55], [2e-2], [1e-2])
    assert one["verdict"] == "unknown"
    assert one["gap_noise"] is None
    assert "no noise estimate" in one["text"]


def test_the_report_shows_the_noise_and_significant_digits(tmp_path):
    pytest.importorskip("matplotlib")
    from modelopt_moe.report.writer import write_report

    ptq = [b + 0.001 for b in BF16]
    qad = [p + 0.0061 for p in ptq]
    run = {"stages": ["s"], "losses": {"KL to teacher after PTQ": 2.04e-4, "KL to teacher after QAD": 1.2e-5},
           "curves": {"bf16 teacher training": [[0, 3.0], [1, 2.5]], "QAD (KL to the teacher)": [[2, 2e-4], [3, 1e-5]]},
           "eval": {"bf16 teacher": {"loss": BF16, "kl": None}, "PTQ": {"loss": ptq, "kl": [2e-4] * 4},
                    "QAD": {"loss": qad, "kl": [1.2e-5] * 4}},
           "outcome": qad_outcome(BF16, ptq, qad, [2e-4] * 4, [1.2e-5] * 4),
           "stats": {"weight_error_own": {"g": [0.01, 0.02]}, "weight_error_shared": {"g": [0.011, 0.02]},
                     "weight_format": {"g": "nvfp4"}, "weight_block_size": {"g": 16}}}
    write_report(run, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| KL to teacher after QAD | 1.2e-05 |" in md  # not 0.0000
    assert "| QAD | 3.5071 ± 0.041 | +0.0071 ± " in md  # minus the teacher's loss, paired by batch
    assert "**What QAD did:** held-out KL to the teacher" in md
    assert "WORSE" in md
    assert (tmp_path / "loss_curve.png").is_file()
    assert (tmp_path / "expert_weight_error.png").is_file()


def test_the_report_shows_top1_agreement_and_greedy_generation_beside_the_kl(tmp_path):
    from modelopt_moe.report.writer import write_report

    run = {"stages": ["s"], "eval": {"bf16 teacher": {"loss": BF16}, "PTQ": {"loss": BF16, "kl": [0.1] * 4,
                                                                              "top1": [0.9, 0.92, 0.94, 0.96]}},
           "generation": {"prompts": 8, "prompt tokens": 16, "new tokens": 16, "end token": 10,
                          "models": {"bf16 teacher": {"same tokens as the reference": 1.0, "end rate": 0.5,
                                                      "mean length": 12.5},
                                     "PTQ": {"same tokens as the reference": 0.75, "end rate": 0.25,
                                             "mean length": 15.0}}}}
    write_report(run, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| KL to the teacher | the teacher's top-1 token (% of positions) |" in md
    assert "| 0.1 ± 0 | 93.0 ± 1.3 |" in md
    assert "| - | - |" in md  # the teacher: no KL, no agreement with itself
    assert "## Greedy generation (8 held-out prompts of 16 tokens, up to 16 new tokens, end token 10)" in md
    assert "| PTQ | 75.0% | 25% | 15.0 |" in md
    assert "| bf16 teacher | 100.0% | 50% | 12.5 |" in md
    del run["generation"], run["eval"]["PTQ"]["top1"]  # a run that measured neither: the table as before
    write_report(run, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "top-1" not in md
    assert "Greedy generation" not in md
