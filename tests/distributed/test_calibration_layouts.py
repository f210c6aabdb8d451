"""Calibration algorithms on a Megatron MoE GPT split over ranks give what one rank gives: the weight MSE search's
amaxes (dense linears per tensor, split over TP; every expert by its global index, per tensor and per channel, in
every expert layout; SequentialMLP and grouped experts) and the activation amaxes of histogram calibration
(percentile and mse; dense inputs, and every expert's input by its global index) are the same at TP=1 x EP=1,
TP=2 x EP=2 and TP=1 x EP=4, bit for bit (4 gloo ranks, one spawn, the same weights at every layout); so are the
experts' weights after ``smooth_expert_inputs`` rescaled their fc2 inputs (bf16 SwiGLU experts, by global index; at
TP=2 all but a few channels, whose scale sits at a rounding boundary of the slightly different activations)."""

import pytest
import torch
import torch.nn.functional as F
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

LAYOUTS = ((1, 1), (2, 2), (1, 4))
CASES = {  # name: (expert kind, expert weight layout, expert weight axis)
    "sequential_per_expert": ("sequential", "per_expert", None),
    "grouped_shared_per_channel": ("grouped", "shared", 0),
    "sequential_vectorized_per_channel": ("sequential", "vectorized", 0),
}


def _config(layout: str, axis, method: str) -> dict:
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                          {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}},
                          {"quantizer_name": "*experts*weight_quantizer", "cfg": {"num_bits": (4, 3), "axis": axis}},
                          {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}],
            "algorithm": method, "experts": {"weight_amax": layout}, "weight_amax_update": "static"}


HISTOGRAMS = {  # name: (expert kind, algorithm)
    "sequential_percentile": ("sequential", {"method": "histogram", "percentile": 99.0, "num_bins": 1024}),
    "grouped_mse": ("grouped", {"method": "histogram", "histogram_method": "mse", "num_bins": 256, "start_bin": 16}),
}


def _histogram_config(algorithm: dict) -> dict:
    return {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                          {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}],
            "algorithm": algorithm, "experts": {"input_amax": "per_expert"}}


def _weight_amaxes(model, ep_rank: int, kind: str = "weight_quantizer") -> dict:
    """Weight (or ``kind``) amaxes by name (dense: per tensor, the same on every rank) and by (name, global
    expert)."""
    from modelopt_moe.quantization import ExpertQuantizer, named_quantizers

    out = {}
    for name, q, _ in named_quantizers(model):
        if not name.endswith(kind) or not q.is_enabled:
            continue
        if isinstance(q, ExpertQuantizer):
            for i in range(q.num_experts):
                out[(name, ep_rank * q.num_experts + i)] = q.amax[i].clone()
        else:
            out[name] = q.amax.clone()
    return out


SMOOTH_CONFIG = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                {"quantizer_name": "*experts*input_quantizer",
                                 "cfg": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic",
                                                                             "scale_bits": (4, 3)}}}],
                  "smooth_expert_inputs": {"alpha": 0.5}}


def _rescaled_expert_weights(mm, mtq, kind: str, ep_rank: int) -> dict:
    """A bf16 SwiGLU model quantized with ``smooth_expert_inputs``: every expert's (fc1, fc2) weights by (layer,
    global expert), and whether its fc2 changed. Each data-parallel rank calibrates on its share of four batches (the
    same four at every layout), so experts held by several ranks agree only through the reduction."""
    from megatron.core import parallel_state

    from modelopt_moe.plugins.megatron.smooth_experts import megatron_expert_mlps

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    calib = [mm.text_batches(2, 32, 1, offset=2 * k)[0] for k in range(4)][dp_rank * 4 // dp:(dp_rank + 1) * 4 // dp]

    model = mm.build_moe_gpt(num_experts=4, seed=3, experts=kind, params_dtype=torch.bfloat16, gated_linear_unit=True,
                             activation_func=F.silu).eval()
    before = [[w.detach().clone() for w in layer.fc2_weights] for layer in megatron_expert_mlps(model)]
    mtq.quantize(model, SMOOTH_CONFIG, lambda m: [mm.lm_loss(m, b) for b in calib])
    out = {}
    for layer, fc2_before in zip(megatron_expert_mlps(model), before, strict=True):
        n = len(layer.fc2_weights)
        for i in range(n):
            out[(layer.name, ep_rank * n + i)] = (layer.fc1_weights[i].detach().clone(),
                                                 layer.fc2_weights[i].detach().clone(),
                                                 not torch.equal(layer.fc2_weights[i], fc2_before[i]))
    return out


def _worker(rank, world_size):
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

    calib = mm.text_batches(2, 32, 2)
    results = {}
    for tp, ep in LAYOUTS:
        mm.init_model_parallel(tp, ep, seed=1)
        ep_rank = mm.parallel_layout()["ep_rank"]
        for case, (kind, layout, axis) in CASES.items():
            for method in ("max", "mse"):
                model = mm.build_moe_gpt(num_experts=4, seed=3, experts=kind).eval()
                mtq.quantize(model, _config(layout, axis, method), lambda m: [mm.lm_loss(m, b) for b in calib])
                results[(tp, ep, case, method)] = _weight_amaxes(model, ep_rank)
        for case, (kind, algorithm) in HISTOGRAMS.items():
            for method in ("max", algorithm):
                model = mm.build_moe_gpt(num_experts=4, seed=3, experts=kind).eval()
                mtq.quantize(model, _histogram_config(method), lambda m: [mm.lm_loss(m, b) for b in calib])
                label = "max" if method == "max" else "histogram"
                results[(tp, ep, case, label)] = _weight_amaxes(model, ep_rank, "input_quantizer")
        for kind in ("sequential", "grouped"):
            results[(tp, ep, kind, "smooth")] = _rescaled_expert_weights(mm, mtq, kind, ep_rank)
        mm.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn(_worker, 4, timeout=seconds(900))


def test_mse_weight_and_histogram_input_amaxes_are_the_same_at_every_layout_and_differ_from_max(ranks):
    for case, method in [*((c, "mse") for c in CASES), *((c, "histogram") for c in HISTOGRAMS)]:
        by_layout = {}
        for tp, ep in LAYOUTS:
            merged = {}
            for result in ranks:
                for key, value in result[(tp, ep, case, method)].items():
                    if key in merged:  # dense amaxes and experts held by several ranks: equal on all of them
                        assert torch.equal(merged[key], value), (case, tp, ep, key)
                    merged[key] = value
            by_layout[(tp, ep)] = merged
        one = by_layout[(1, 1)]
        assert len([k for k in one if isinstance(k, tuple)]) == 2 * 2 * 4, sorted(one)  # layers x GEMMs x experts
        for layout, amaxes in by_layout.items():
            assert sorted(amaxes, key=str) == sorted(one, key=str), (case, layout)
            for key in one:
                if method == "mse":
                    assert torch.equal(amaxes[key], one[key]), (case, layout, key, amaxes[key], one[key])
                else:  # activations: TP sums partial products in another order, so inputs differ in the last bits
                    assert torch.allclose(amaxes[key], one[key], rtol=1e-6, atol=0), (case, layout, key,
                                                                                      amaxes[key] - one[key])
        maxed = ranks[0][(1, 1, case, "max")]
        assert any(not torch.equal(one[k], maxed[k]) for k in one), case  # the search moved some amax
        if method == "histogram":  # every expert's input moved below its max
            assert all(one[k] < maxed[k] for k in one if isinstance(k, tuple)), case


def test_smooth_expert_inputs_rescales_every_expert_the_same_at_every_layout(ranks):
    """The fc2 input statistics are max-reduced over the ranks that hold the same experts (expert-data-parallel), so
    TP=1 x EP=1 (every expert on 4 ranks, each with its own data) and TP=1 x EP=4 choose the same power-of-two scales:
    the same weights by global expert, bit for bit; TP=2 x EP=2 all but a few channels at a rounding boundary."""
    for kind in ("sequential", "grouped"):
        by_layout = {}
        for tp, ep in LAYOUTS:
            merged = {}
            for result in ranks:
                for key, (fc1, fc2, _) in result[(tp, ep, kind, "smooth")].items():
                    if key in merged:  # replicas of an expert (expert-data-parallel ranks) hold the same weights
                        assert torch.equal(merged[key][0], fc1), (kind, tp, ep, key)
                        assert torch.equal(merged[key][1], fc2), (kind, tp, ep, key)
                    merged[key] = (fc1, fc2)
            by_layout[(tp, ep)] = merged
        one = by_layout[(1, 1)]
        assert len(one) == 2 * 4, sorted(one)  # layers x experts
        moved = [key for key, (_, _, changed) in ranks[0][(1, 1, kind, "smooth")].items() if changed]
        assert len(moved) >= 6, moved  # the rescale moved (almost) every expert
        flipped = 0
        for layout, weights in by_layout.items():
            assert sorted(weights) == sorted(one), (kind, layout)
            for key, (fc1, fc2) in one.items():
                if layout[0] == 1:
                    assert torch.equal(weights[key][0], fc1), (kind, layout, key)
                    assert torch.equal(weights[key][1], fc2), (kind, layout, key)
                    continue
                # TP > 1: attention sums its partial products in another order, so the experts' inputs differ in
                # their last bits, and a channel whose scale lies at a rounding boundary takes the neighbouring power
                # of two, on both of its weights (the model stays exact)
                ratio = (weights[key][1].double() / fc2.double())[0]
                assert torch.equal(weights[key][1].double(), fc2.double() * ratio[None, :]), (kind, layout, key)
                f = fc2.shape[1]
                assert torch.equal(weights[key][0].double()[f:] * ratio[:, None], fc1.double()[f:]), (kind, key)
                assert set(ratio.tolist()) <= {0.5, 1.0, 2.0}, (kind, layout, key, ratio)
                flipped += int((ratio != 1).sum())
        assert flipped <= 4, (kind, flipped)  # of 2 x 4 x 128 channels
