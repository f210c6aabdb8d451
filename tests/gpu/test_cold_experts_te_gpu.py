"""``moe_calib_experts_ratio`` on Transformer Engine grouped experts (one GPU): a ``TEGroupedMLP`` MoE layer whose
router is biased away from two experts leaves them without calibration tokens under its own routing; with the ratio
the experts calibrate on the tokens the wider routing sends them (at ratio 1, every token reaches every expert),
with the same token counts and input amaxes as the ``SequentialMLP`` layer of the same weights, while the outputs
the forward loop sees stay the layer's own, bit for bit.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``.
"""

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformer_engine.pytorch")


import megatron_harness.models as mm  # noqa: E402
from te_moe_layers import hidden_states  # noqa: E402

import modelopt_moe.quantization as mtq  # noqa: E402

EXPERTS, TOPK, HIDDEN, FFN, COLD = 8, 2, 256, 512, (2, 5)
BATCHES, TOKENS = 2, 512  # tokens per calibration batch


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _hidden(seed):
    return hidden_states(seed, TOKENS, HIDDEN)


def _layer(transformer_engine: bool):
    layer = mm.build_moe_layer(transformer_engine=transformer_engine, num_experts=EXPERTS, hidden=HIDDEN,
                               ffn_hidden=FFN, moe_router_topk=TOPK, moe_router_enable_expert_bias=True,
                               moe_router_score_function="sigmoid")
    with torch.no_grad():
        for e in COLD:
            layer.router.expert_bias[e] = -1e4  # the router never picks them
    return layer


def _hook_count(layer) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in layer.modules())


def _calibrate(layer, preset, ratio):
    """Calibrates ``layer`` (``preset``, per-expert input amaxes); returns the outputs the forward loop saw, the input
    quantizers' ``{gemm: (token counts, amaxes)}`` and the warnings about experts without tokens."""
    cfg = mtq.load_config(preset)
    cfg.experts.input_amax = "per_expert"
    algorithm = {"method": "max"} if ratio is None else {"method": "max", "moe_calib_experts_ratio": ratio}
    outputs = []

    def forward_loop(m):
        outputs.extend(m(_hidden(s))[0].detach().clone() for s in range(BATCHES))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mtq.quantize(layer, {**cfg.model_dump(), "algorithm": algorithm}, forward_loop)
    inputs = {}
    for gemm in ("linear_fc1", "linear_fc2"):
        q = getattr(layer.experts, gemm).input_quantizer
        inputs[gemm] = (q.calibrated_rows.clone(), torch.stack([q.expert_amax(i) for i in range(EXPERTS)]))
    return outputs, inputs, [str(w.message) for w in caught if "saw no calibration tokens" in str(w.message)]


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml"])
@pytest.mark.parametrize("ratio", [0.875, 1.0])  # 7 of 8 experts per token (6 hot + 1 cold), all 8
def test_te_grouped_experts_calibrate_every_expert_on_the_wider_routing(preset, ratio):
    results = {}
    for kind, te in (("grouped", True), ("sequential", False)):
        for r in (None, ratio):
            layer = _layer(te)
            hooks = _hook_count(layer)
            results[(kind, r)] = _calibrate(layer, preset, r)
            if te:
                assert type(layer.experts.linear_fc1).__name__ == "QuantTEColumnParallelGroupedLinear"
            # the router's top-k and the hooks are as before once calibration ends; the layer still runs
            assert (layer.router.topk, layer.config.moe_router_topk) == (TOPK, TOPK), (kind, r)
            assert _hook_count(layer) == hooks
            assert torch.isfinite(layer(_hidden(9))[0]).all(), (kind, r)
    k = max(TOPK, round(ratio * EXPERTS))
    for kind in ("grouped", "sequential"):
        plain_out, plain, _ = results[(kind, None)]
        wide_out, wide, warned = results[(kind, ratio)]
        assert not warned, (kind, warned)
        for a, b in zip(plain_out, wide_out, strict=True):
            assert torch.equal(a, b), kind  # the next layers see the layer's own top-k output
        for gemm, (rows, _) in plain.items():
            assert all(int(rows[e]) == 0 for e in COLD), (kind, gemm, rows)  # cold under the model's routing
            assert int(rows.sum()) == BATCHES * TOKENS * TOPK, (kind, gemm, rows)
        for gemm, (rows, amax) in wide.items():
            assert int(rows.sum()) == BATCHES * TOKENS * k, (kind, gemm, rows)  # each token reached k experts
            # past the hot experts, the wider routing's other k - 6 picks per token are cold experts
            cold_tokens = BATCHES * TOKENS * (k - (EXPERTS - len(COLD)))
            assert sum(int(rows[e]) for e in COLD) == cold_tokens, (kind, gemm, rows)
            assert torch.isfinite(amax).all() and (amax > 0).all(), (kind, gemm, amax)  # noqa: PT018
            if k == EXPERTS:
                assert (rows == BATCHES * TOKENS).all(), (kind, gemm, rows)  # every token reached every expert
        # the cold experts that received tokens have fc2 input amaxes of their own (their own activations)
        for e in COLD:
            if int(wide["linear_fc2"][0][e]) > 0:
                assert not torch.equal(wide["linear_fc2"][1][e], plain["linear_fc2"][1][e]), (kind, e)
        assert any(int(wide["linear_fc2"][0][e]) > 0 for e in COLD), kind
    for gemm in ("linear_fc1", "linear_fc2"):  # TE grouped experts calibrate as the sequential ones, bit for bit
        g_rows, g_amax = results[("grouped", ratio)][1][gemm]
        s_rows, s_amax = results[("sequential", ratio)][1][gemm]
        assert torch.equal(g_rows, s_rows), (gemm, g_rows, s_rows)
        assert torch.equal(g_amax, s_amax), gemm
