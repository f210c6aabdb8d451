"""Static NVFP4 block scales of N experts in one launch, natively on CUDA: bit-exact against
``NVFP4.fake_quant_static`` per expert (on the GPU and on the CPU) for realistic expert shapes, with the hardware
rounding options on, edge values, the clipped straight-through backward, CUDA graph replay, and a quantized
``GroupedLinear`` whose static block scales come from the FP8 scale sweep.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_static_blocks_gpu.py``. TRITON_INTERPRET must not be
set.
"""

import copy
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_kernel_checks import _compiled_triton, assert_bits_equal  # noqa: E402, F401  (autouse)

from modelopt_moe.kernels import static_blocks_fake_quant as sb  # noqa: E402
from modelopt_moe.numerics.nvfp4 import NVFP4  # noqa: E402
from modelopt_moe.quantization.tensor_quantizer import StaticBlocksSTE  # noqa: E402

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (N, rows, K): a 128-expert MoE's fc1 and fc2 shards, and a few large experts.
SHAPES = [(128, 256, 512), (32, 768, 2048), (4, 1536, 4096 + 32)]


def make_experts(n, rows, k, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [(torch.randn(rows, k, generator=g, device=DEV) * 2.0 ** (i % 13 - 6)).to(dtype) for i in range(n)]


def block_amaxes(weights, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    out = []
    for w in weights:
        bmax = w.float().abs().unflatten(-1, (-1, 16)).amax(-1)
        out.append(bmax * (0.5 + torch.rand(bmax.shape, generator=g, device=DEV)))
    return torch.stack(out)


def reference(weights, amax, blocks, scale_max, device=DEV):
    return [NVFP4.fake_quant_static(w.to(device), amax[i].to(device), blocks[i].to(device), scale_max)
            for i, w in enumerate(weights)]


@pytest.mark.parametrize("scale_max", [448.0, 256.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "rows", "k"), SHAPES)
def test_static_blocks_bit_exact_per_expert_on_cuda(n, rows, k, dtype, scale_max):
    weights = make_experts(n, rows, k, dtype, seed=n)
    amax = torch.stack([w.float().abs().amax() * (0.8 + 0.01 * (i % 17)) for i, w in enumerate(weights)])
    blocks = block_amaxes(weights, seed=n)
    outs = sb.grouped_static_blocks_fake_quant(weights, amax, blocks, "nvfp4", scale_max)
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, blocks, scale_max), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")
    cpu = reference(weights[:2], amax[:2], blocks[:2], scale_max, device="cpu")  # the CPU reference too
    for i in range(2):
        assert_bits_equal(outs[i], cpu[i], f"expert {i} (CPU reference)")


def test_static_blocks_edge_values_on_cuda():
    weights = make_experts(3, 64, 256, torch.bfloat16, seed=1)
    weights[0][0, :16] = 0.0
    weights[1][1, 3] = float("nan")
    weights[1][2, 17] = float("inf")
    weights[2][0, 16:32] = -0.0
    blocks = block_amaxes(weights, seed=2)
    for j, v in enumerate([0.0, -0.0, -1.0, float("nan"), float("inf"), 1e-30, 3e38, 2.0**-24]):
        blocks[0, j, j] = v
        blocks[1, 2, j] = v
    for amax in (torch.tensor([1.0, 2.0, 3.0], device=DEV), torch.tensor([0.0, float("nan"), float("inf")],
                                                                          device=DEV)):
        outs = sb.grouped_static_blocks_fake_quant(weights, amax, blocks, "nvfp4", 448.0)
        for i, (o, r) in enumerate(zip(outs, reference(weights, amax, blocks, 448.0), strict=True)):
            assert_bits_equal(o, r, f"expert {i}")


def test_static_blocks_clipped_backward_on_cuda():
    weights = make_experts(8, 128, 512, torch.bfloat16, seed=3)
    amax = torch.stack([w.float().abs().amax() for w in weights])
    blocks = block_amaxes(weights, seed=3) * 0.7
    grads = [torch.randn_like(w) for w in weights]
    leaves = [w.clone().requires_grad_() for w in weights]
    torch.autograd.backward(sb.grouped_static_blocks_fake_quant_ste(leaves, amax, blocks, "nvfp4", 448.0, "clipped"),
                            grads)
    for i, w in enumerate(weights):
        ref = w.clone().requires_grad_()
        StaticBlocksSTE.apply(ref, amax[i], blocks[i], "nvfp4", 448.0, True).backward(grads[i])
        assert_bits_equal(leaves[i].grad, ref.grad, f"expert {i}")


def test_static_blocks_cuda_graph_replay():
    weights = make_experts(16, 256, 512, torch.bfloat16, seed=4)
    amax = torch.stack([w.float().abs().amax() for w in weights])
    blocks = block_amaxes(weights, seed=4)
    sb.grouped_static_blocks_fake_quant(weights, amax, blocks, "nvfp4", 448.0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = sb.grouped_static_blocks_fake_quant(weights, amax, blocks, "nvfp4", 448.0)
    with torch.no_grad():
        for w in weights:
            w.mul_(1.5)
        blocks.mul_(1.25)
    graph.replay()
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, blocks, 448.0), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@pytest.mark.parametrize("update", ["static", "learned"])
def test_grouped_linear_with_swept_block_scales_runs_the_kernel_with_the_references_bits(update):
    import modelopt_moe.quantization as mtq
    from modelopt_moe.quantization.nn import GroupedLinear

    torch.manual_seed(0)
    experts = GroupedLinear(num_gemms=8, in_features=512, out_features=256).to(DEV)
    data = torch.randn(64, 512, device=DEV)
    splits = [8] * 8
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                         {"quantizer_name": "*weight_quantizer", "cfg": {
                             "num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}}],
           "algorithm": {"method": "mse", "fp8_scale_sweep": True}, "weight_amax_update": update,
           "backward": {"ste": "clipped"}}
    reference_model = copy.deepcopy(experts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(experts, {**cfg, "kernel": "triton"}, lambda m: m(data, splits))
        mtq.quantize(reference_model, {**cfg, "kernel": "torch"}, lambda m: m(data, splits))
    launches = []
    real = sb._launch_fake_quant
    sb._launch_fake_quant = lambda *a, **k: launches.append(1) or real(*a, **k)
    try:
        out = experts(data, splits)
    finally:
        sb._launch_fake_quant = real
    assert launches == [1]
    ref = reference_model(data, splits)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for w, r in zip(experts.expert_weights(), reference_model.expert_weights(), strict=True):
        assert_bits_equal(w.grad, r.grad)
    if update == "learned":
        assert_bits_equal(experts.weight_quantizer.block_amax.grad, reference_model.weight_quantizer.block_amax.grad)
