"""Static NVFP4 block scales on Transformer Engine grouped experts (one GPU): a Megatron ``TEGroupedMLP`` layer and a
``SequentialMLP`` layer with the same weights, quantized with the FP8 scale sweep
(``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG``) or 4-over-6 (``NVFP4_FOUR_OVER_SIX_CFG``), choose bit-identical block amaxes
and second-level amaxes per expert and give bit-identical fake-quantized expert weights; every expert's
fake-quantized weight has a squared error no larger than max calibration's (the search's promise: max calibration's
block scale is among its candidates); and the TE grouped GEMM runs on exactly those weights (the layer's output
equals that of the same layer with the fake-quantized weights written into it), not on dynamic block scales.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu``.
"""

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")


import megatron_harness.models as mm  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from te_moe_layers import hidden_states  # noqa: E402

import modelopt_moe.quantization as mtq  # noqa: E402

EXPERTS, HIDDEN, FFN, TOKENS = 8, 256, 512, 512
PRESETS = {"fp8_sweep": mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, "four_over_six": mtq.NVFP4_FOUR_OVER_SIX_CFG}
GEMMS = ("linear_fc1", "linear_fc2")


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _layer(transformer_engine: bool):
    """An MoE layer with gated (SwiGLU) experts: fc1 holds both GLU halves, as the study models' experts."""
    return mm.build_moe_layer(transformer_engine=transformer_engine, num_experts=EXPERTS, hidden=HIDDEN,
                              ffn_hidden=FFN, gated_linear_unit=True, activation_func=F.silu)


def _hidden(seed):
    return hidden_states(seed, TOKENS, HIDDEN)


def _quantize(layer, config: dict, layout: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, {**config, "experts": {**config["experts"], "weight_amax": layout}},
                     lambda m: [m(_hidden(s)) for s in range(2)])
    return layer


def _expert_weights(layer, gemm: str) -> list[torch.Tensor]:
    experts = layer.experts  # after quantization TEGroupedMLP is QuantTEGroupedMLP: tell the kinds apart by layout
    if hasattr(experts, "local_experts"):
        return [getattr(e, gemm).weight for e in experts.local_experts]
    return [getattr(getattr(experts, gemm), f"weight{i}") for i in range(EXPERTS)]


def _squared_error(q, i: int, w: torch.Tensor) -> float:
    w = w.detach().float()
    return float((w - q.fake_quant_expert(i, w)).square().sum())


@pytest.mark.parametrize("layout", ["vectorized", "per_expert"])
@pytest.mark.parametrize("calibration", sorted(PRESETS))
def test_te_grouped_and_sequential_experts_choose_the_same_static_block_scales(calibration, layout):
    config = PRESETS[calibration]
    grouped, sequential, maxed = _layer(True), _layer(False), _layer(True)
    assert type(grouped.experts).__name__ == "TEGroupedMLP"
    assert type(sequential.experts).__name__ == "SequentialMLP"
    _quantize(grouped, config, layout)
    _quantize(sequential, config, layout)
    _quantize(maxed, {**config, "algorithm": "max"}, layout)
    assert type(grouped.experts.linear_fc1).__name__ == "QuantTEColumnParallelGroupedLinear"
    searched = 0
    for gemm in GEMMS:
        a, b, m = (getattr(layer.experts, gemm).weight_quantizer for layer in (grouped, sequential, maxed))
        assert a.block_amax is not None, gemm
        assert a.block_amax.shape == b.block_amax.shape, gemm
        ws_a, ws_b, ws_m = (_expert_weights(layer, gemm) for layer in (grouped, sequential, maxed))
        for i in range(EXPERTS):
            assert torch.equal(ws_a[i], ws_b[i]), (gemm, i)
            assert torch.equal(ws_a[i], ws_m[i]), (gemm, i)
            assert torch.equal(a.expert_amax(i), b.expert_amax(i)), (gemm, i)
            assert torch.equal(a.expert_amax(i), m.expert_amax(i)), (gemm, i)  # the second level stays at max
            assert torch.equal(a.block_amax[i], b.block_amax[i]), (gemm, i)
            # max calibration's block amaxes are the blocks' own maxima, expert by expert (not another expert's)
            blocks = ws_m[i].detach().float().abs().unflatten(-1, (-1, 16)).amax(-1)
            assert torch.equal(m.block_amax[i], blocks), (gemm, i)
            assert torch.equal(a.fake_quant_expert(i, ws_a[i]), b.fake_quant_expert(i, ws_b[i])), (gemm, i)
            err, err_max = _squared_error(a, i, ws_a[i]), _squared_error(m, i, ws_m[i])
            assert err <= err_max, (gemm, i, err, err_max)
            searched += not torch.equal(a.block_amax[i], m.block_amax[i])
    assert searched > 0  # the search changed some block scales


@pytest.mark.parametrize("calibration", sorted(PRESETS))
def test_te_grouped_gemm_runs_on_the_static_block_fake_quantized_weights(calibration):
    grouped, sequential = _quantize(_layer(True), PRESETS[calibration], "vectorized"), \
        _quantize(_layer(False), PRESETS[calibration], "vectorized")
    for layer in (grouped, sequential):
        mtq.disable_quantizer(layer, "*input_quantizer")  # weights alone
    x = _hidden(7)
    with torch.no_grad():
        out, out_seq = grouped(x)[0], sequential(x)[0]
        rel = ((out.float() - out_seq.float()).norm() / out_seq.float().norm()).item()
        assert rel < 1e-2, rel  # only the bf16 GEMM implementations differ
        mtq.fold_weight(grouped)  # the fake-quantized weights written into the layer, its weight quantizers off
        assert torch.equal(grouped(x)[0], out)


def _dynamic_blocks(config: dict) -> dict:
    """``config`` with the weights' block scales from the weights (``block_sizes.type: dynamic``), max calibration
    and ``weight_amax_update: dynamic``: the max-calibrated NVFP4 the searched static block scales are compared with."""
    entries = [{**e, "cfg": {**e["cfg"], "block_sizes": {**e["cfg"]["block_sizes"], "type": "dynamic"}}}
               if e["quantizer_name"] == "*weight_quantizer" else e for e in config["quant_cfg"]]
    return {**config, "quant_cfg": entries, "algorithm": "max", "weight_amax_update": "dynamic"}


def test_te_max_calibrated_dynamic_block_scales_equal_static_block_scales_at_max():
    """The baseline the search is measured against: dynamic block scales (each block's own max; the one-launch
    kernel on the GPU) give the TE layer the output of static block scales calibrated by max (the torch reference),
    bit for bit."""
    sweep = mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG
    dynamic = _quantize(_layer(True), _dynamic_blocks(sweep), "vectorized")
    static = _quantize(_layer(True), {**sweep, "algorithm": "max"}, "vectorized")
    assert getattr(dynamic.experts.linear_fc1.weight_quantizer, "block_amax", None) is None
    for layer in (dynamic, static):
        mtq.disable_quantizer(layer, "*input_quantizer")  # weights alone
    x = _hidden(8)
    with torch.no_grad():
        assert torch.equal(dynamic(x)[0], static(x)[0])
