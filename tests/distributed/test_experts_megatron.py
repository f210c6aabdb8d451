"""Quantized SequentialMLP experts in a real Megatron MoE GPT on 4 gloo ranks (TP=2, EP=2).

One spawn runs every case (a spawn costs ~15 s of imports): FP8, NVFP4, MXFP4 and MXFP8 (every dense column- and
row-parallel linear quantized too), each expert weight-amax layout (shared / vectorized / per_expert) with per-expert
input amax, plus a routing that leaves experts without tokens.
"""

import math
import warnings

import pytest
import torch
from limits import seconds  # noqa: E402

from modelopt_moe.launch import spawn

WORLD, TP, EP, EXPERTS, SEED = 4, 2, 2, 4, 1234
LAYOUTS = ("shared", "vectorized", "per_expert")
PRESETS = {"fp8": "fp8_default.yaml", "nvfp4": "nvfp4_default.yaml", "mxfp4": "mxfp4_default.yaml",
           "mxfp8": "mxfp8_default.yaml"}
UNSEEN = (1, 3)  # global experts the biased router never picks


def _global_expert_state(model, mtq, mm):
    """Per global expert index: fc1/fc2 weight amax and input amax, and the weight grads; plus dense amaxes."""
    ep_rank = mm.parallel_layout()["ep_rank"]
    out = {}
    for layer_idx, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        n = experts.num_local_experts
        for gemm in ("linear_fc1", "linear_fc2"):
            q = getattr(experts, gemm)
            for i in range(n):
                g = ep_rank * n + i
                key = (layer_idx, gemm, g)
                w = getattr(experts.local_experts[i], gemm).weight
                out[key] = {
                    "weight_amax": q.weight_quantizer.expert_amax(i).clone(),
                    "input_amax": q.input_quantizer.expert_amax(i).clone(),
                    "grad": None if w.grad is None else w.grad.clone(),
                }
    return out


def _quantize(model, preset, layout, batches, mtq, mm, input_amax="per_expert"):
    cfg = mtq.load_config(preset)
    cfg.experts.weight_amax = layout
    cfg.experts.input_amax = input_amax
    model.eval()
    mtq.quantize(model, cfg, lambda m: [mm.lm_loss(m, b) for b in batches])
    return model


def _worker(rank, world_size):
    import megatron_harness.models as mm

    import modelopt_moe.quantization as mtq

    mm.init_model_parallel(TP, EP, seed=SEED)
    batches = mm.text_batches(2, 32, 3)
    out = {"layout": mm.parallel_layout()}

    base = mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED).eval()
    with torch.no_grad():
        out["float_logits"] = mm.gather_logits(base, batches[0])
    del base

    for fmt, preset in PRESETS.items():
        for layout in LAYOUTS:
            model = _quantize(mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED), preset, layout, batches[:2], mtq, mm)
            with torch.no_grad():
                logits = mm.gather_logits(model, batches[0])
            model.train()
            loss = mm.lm_loss(model, batches[2])
            loss.backward()
            mm.allreduce_sequence_parallel_grads(model)
            names = [n for n, m in model.named_modules() if n.rpartition(".")[0].endswith("_quantizer")
                     or n.endswith("_quantizer")]
            out[(fmt, layout)] = {
                "logits": logits,
                "loss": loss.item(),
                "experts": _global_expert_state(model, mtq, mm),
                "expert_quantizer_names": [n for n in names if ".experts." in n],
                "linear_slots": type(model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight_quantizer)
                .__name__,
            }

    # A router biased away from experts 1 and 3: they get no calibration tokens on any rank.
    model = mm.build_moe_gpt(num_experts=EXPERTS, seed=SEED, moe_router_enable_expert_bias=True,
                             moe_router_score_function="sigmoid")
    for layer in model.decoder.layers:
        for e in UNSEEN:
            layer.mlp.router.expert_bias[e] = -1e4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _quantize(model, "fp8_default.yaml", "vectorized", batches[:2], mtq, mm)
    out["unseen_warnings"] = [str(w.message) for w in caught if "saw no calibration tokens" in str(w.message)]
    out["unseen_state"] = _global_expert_state(model, mtq, mm)
    with torch.no_grad():
        out["unseen_logits_finite"] = bool(torch.isfinite(mm.gather_logits(model, batches[0])).all())
    mm.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, WORLD, timeout=seconds(900))


def _merged(results, case):
    """Global expert state from all ranks (each expert appears on its EP rank's TP ranks; they must agree)."""
    merged = {}
    for r in results:
        for key, state in r[case]["experts"].items() if case != "unseen_state" else r[case].items():
            if key in merged:
                assert torch.equal(merged[key]["weight_amax"], state["weight_amax"]), key
            merged[key] = state
    return merged


@pytest.mark.parametrize("fmt", list(PRESETS))
def test_every_expert_weight_has_a_finite_positive_amax(results, fmt):
    for layout in LAYOUTS:
        merged = _merged(results, (fmt, layout))
        assert len(merged) == 2 * 2 * EXPERTS  # layers x gemms x global experts
        for key, state in merged.items():
            a = state["weight_amax"]
            assert torch.isfinite(a).all(), (layout, key, a)
            assert (a > 0).all(), (layout, key, a)
            assert torch.isfinite(state["input_amax"]).all(), (layout, key)
            assert (state["input_amax"] > 0).all(), (layout, key)


@pytest.mark.parametrize("fmt", list(PRESETS))
def test_quantized_output_changes_by_a_plausible_amount(results, fmt):
    ref = results[0]["float_logits"]
    for layout in LAYOUTS:
        logits = results[0][(fmt, layout)]["logits"]
        rel = ((logits - ref).norm() / ref.norm()).item()
        # measured: fp8 0.08-0.10, nvfp4 0.13-0.2 on this random model
        bound = {"fp8": 0.15, "mxfp8": 0.15}.get(fmt, 0.4)
        assert 0 < rel < bound, (fmt, layout, rel)
        assert math.isfinite(results[0][(fmt, layout)]["loss"])


@pytest.mark.parametrize("fmt", list(PRESETS))
def test_vectorized_and_per_expert_give_identical_outputs_and_gradients(results, fmt):
    for r in results:
        vec, per = r[(fmt, "vectorized")], r[(fmt, "per_expert")]
        assert torch.equal(vec["logits"], per["logits"])
        assert vec["loss"] == per["loss"]
        for key in vec["experts"]:
            a, b = vec["experts"][key], per["experts"][key]
            assert torch.equal(a["weight_amax"], b["weight_amax"]), key
            assert a["grad"] is not None, key
            assert torch.equal(a["grad"], b["grad"]), key


@pytest.mark.parametrize("fmt", list(PRESETS))
def test_shared_amax_is_the_max_over_all_experts_on_all_ep_ranks(results, fmt):
    per = _merged(results, (fmt, "per_expert"))
    shared = _merged(results, (fmt, "shared"))
    for layer in range(2):
        for gemm in ("linear_fc1", "linear_fc2"):
            keys = [(layer, gemm, g) for g in range(EXPERTS)]
            expected = torch.stack([per[k]["weight_amax"] for k in keys]).max()
            for k in keys:
                assert torch.equal(shared[k]["weight_amax"], expected), k
    # ... and it really spans both EP ranks: the per-expert maxima differ between the two halves.
    halves = [torch.stack([per[(0, "linear_fc1", g)]["weight_amax"] for g in gs]).max() for gs in ((0, 1), (2, 3))]
    assert halves[0] != halves[1]


def test_nvfp4_changes_the_output_more_than_fp8(results):
    ref = results[0]["float_logits"]
    err = {f: (results[0][(f, "vectorized")]["logits"] - ref).norm() for f in PRESETS}
    assert err["nvfp4"] > err["fp8"]


def test_expert_quantizers_are_named_like_te_grouped_mlp(results):
    names = results[0][("fp8", "per_expert")]["expert_quantizer_names"]
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight_quantizer.0" in names
    assert "decoder.layers.0.mlp.experts.linear_fc2.input_quantizer" in names
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight_quantizer" in results[0][("fp8", "vectorized")][
        "expert_quantizer_names"]
    assert results[0][("fp8", "vectorized")]["linear_slots"] == "ExpertView"


def test_experts_without_tokens_get_the_shared_input_amax_and_one_rank0_warning(results):
    assert len(results[0]["unseen_warnings"]) == 1  # one warning listing every layer and gemm
    assert results[0]["unseen_warnings"][0].count(f"experts {list(UNSEEN)}") == 4  # 2 layers x (fc1, fc2)
    assert all(not r["unseen_warnings"] for r in results[1:])
    merged = _merged(results, "unseen_state")
    for layer in range(2):
        for gemm in ("linear_fc1", "linear_fc2"):
            seen = torch.stack([merged[(layer, gemm, g)]["input_amax"] for g in range(EXPERTS) if g not in UNSEEN])
            for g in UNSEEN:
                assert torch.equal(merged[(layer, gemm, g)]["input_amax"], seen.max()), (layer, gemm, g)
    assert all(r["unseen_logits_finite"] for r in results)
