"""FP8 block-wise on Transformer Engine experts on one GPU: Megatron ``TEGroupedMLP`` quantized with
``fp8_block_w8a8.yaml`` in every weight layout gives the ``SequentialMLP`` layer's output with the same weights (only
the bf16 GEMM implementations differ), on the Triton FP8 block kernels, and gradients reach every expert.

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

EXPERTS, HIDDEN, FFN, TOKENS = 8, 256, 512, 512
LAYOUTS = ("shared", "vectorized", "per_expert")


@pytest.fixture(scope="module", autouse=True)
def _megatron(megatron_one_gpu):
    return


def _hidden(seed):
    return hidden_states(seed, TOKENS, HIDDEN)


def _quantize(layer, layout):
    cfg = mtq.load_config("fp8_block_w8a8.yaml")
    cfg.experts.weight_amax = layout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: [m(_hidden(s)) for s in range(2)])
    return layer


@pytest.mark.parametrize("layout", LAYOUTS)
def test_te_grouped_experts_match_sequential_experts_with_fp8_blocks(layout):
    grouped = mm.build_moe_layer(transformer_engine=True, num_experts=EXPERTS, hidden=HIDDEN, ffn_hidden=FFN)
    sequential = mm.build_moe_layer(transformer_engine=False, num_experts=EXPERTS, hidden=HIDDEN, ffn_hidden=FFN)
    float_out = grouped(_hidden(5))[0]
    grouped, sequential = _quantize(grouped, layout), _quantize(sequential, layout)
    q = grouped.experts.linear_fc1
    assert (q.weight_quantizer.block_size, q.input_quantizer.block_size) == ((128, 128), 128)
    x = _hidden(5)
    out_g, out_s = grouped(x)[0], sequential(x)[0]
    assert torch.isfinite(out_g).all()
    rel = ((out_g.float() - out_s.float()).norm() / out_s.float().norm()).item()
    assert rel < 1e-2, rel
    assert ((out_g.float() - float_out.float()).norm() / float_out.float().norm()).item() > 1e-3


def test_te_grouped_backward_reaches_every_expert_weight_with_fp8_blocks():
    grouped = _quantize(mm.build_moe_layer(transformer_engine=True, num_experts=EXPERTS, hidden=HIDDEN,
                                           ffn_hidden=FFN), "vectorized")
    x = _hidden(6).requires_grad_(True)
    grouped(x)[0].float().square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for gemm in ("linear_fc1", "linear_fc2"):
        for i in range(EXPERTS):
            grad = getattr(getattr(grouped.experts, gemm), f"weight{i}").grad
            assert grad is not None, (gemm, i)
            assert torch.isfinite(grad).all(), (gemm, i)
            assert grad.abs().sum() > 0, (gemm, i)
