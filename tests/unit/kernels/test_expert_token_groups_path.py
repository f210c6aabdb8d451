"""Expert inputs in FP8 1x128 token groups (``configs/fp8_block_w8a8.yaml``: ``type: dynamic``, every scale from the
row's own groups) through the grouped expert linear: ``kernel: triton`` runs the whole token matrix through the
token-groups kernel in one launch, with the output and the input gradient of ``kernel: torch`` bit for bit.

The expert weights are diagonal (a distinct diagonal per expert): every output and input-gradient element is one
product plus exact zeros, so the comparison sees the fake-quantized tokens' bits, not how a CPU GEMM orders its sums
(which follows the operands' memory alignment)."""

import warnings

import pytest
import torch
from autograd_paths import REFERENCE_NODE, assert_kernel_path, assert_reference_path, graph_nodes

import modelopt_moe.quantization as mtq
from modelopt_moe.kernels import kernels_available
from modelopt_moe.quantization.nn import GroupedLinear
from modelopt_moe.quantization.nn.row_scale import down_proj_row_scale

pytestmark = pytest.mark.skipif(not kernels_available("cpu"), reason="needs the Triton interpreter on CPU")

N = 3
SCALED_NODE = "GroupedScaledInputFakeQuantBackward"


def _tokens(splits, k, dtype, seed=1, edge=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(splits), k, generator=g) * torch.logspace(-2, 2, k)
    if edge and x.shape[0] >= 4:
        x[0] = 0.0  # an all-zero row: every group's amax is zero
        x[1, :k // 2] = -0.0
        x[1, k // 2:] = 1e-40 if dtype == torch.float32 else 1e-7  # subnormal groups
        x[2, ::3] = 448.0  # the E4M3 maximum, exactly
        x[2, 1::3] = -448.0 * (1 + 2 ** -6)  # just past it: the group's scale moves
        x[3] = torch.linspace(-1e4, 1e4, k)
        x[3, -1] = 1e15 if dtype == torch.float32 else 1e4  # one large value in the last (partial) group
    return x.to(dtype)


def _run(kernel, splits, *, k=200, dtype=torch.float32, ste="pass_through", edge=False, row_scale=False):
    torch.manual_seed(0)
    layer = GroupedLinear(N, k, k, bias=not row_scale).to(dtype)  # a router-scaled input takes no GEMM bias
    with torch.no_grad():
        for i, w in enumerate(layer.expert_weights()):
            w.copy_(torch.diag(torch.linspace(0.5, 2.0, k) * 3.0 ** i))
    cfg = mtq.load_config("fp8_block_w8a8.yaml")
    cfg.kernel, cfg.backward.ste = kernel, ste
    calib = _tokens([3, 2, 4], k, dtype, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(calib, [3, 2, 4]))
    x = _tokens(splits, k, dtype, edge=edge).requires_grad_(True)
    if row_scale:
        p = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(2)).to(dtype)
        with down_proj_row_scale(layer, p):
            y = layer(x, splits)
    else:
        y = layer(x, splits)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype))
    return y.detach(), x.grad, graph_nodes(y)


def _assert_same(fast, ref):
    torch.testing.assert_close(fast[0], ref[0], atol=0, rtol=0)
    torch.testing.assert_close(fast[1], ref[1], atol=0, rtol=0)


@pytest.mark.parametrize(("splits", "k", "dtype", "ste", "edge"), [
    ([4, 0, 5], 200, torch.float32, "pass_through", False),  # an empty expert; K no multiple of 128
    ([5, 3, 0], 256, torch.bfloat16, "clipped", False),  # whole groups; nothing to clip at: every gradient passes
    ([4, 1, 2], 130, torch.float32, "pass_through", True),  # edge values; a 2-wide last group
    ([6, 0, 1], 72, torch.bfloat16, "clipped", True),  # one partial group per row
])
def test_expert_token_groups_take_the_kernel_with_the_reference_bits(splits, k, dtype, ste, edge):
    ref = _run("torch", splits, k=k, dtype=dtype, ste=ste, edge=edge)
    fast = _run("triton", splits, k=k, dtype=dtype, ste=ste, edge=edge)
    _assert_same(fast, ref)
    assert_reference_path(ref[2])
    assert_kernel_path(fast[2])


def test_zero_tokens_take_the_kernel_and_give_empty_results():
    ref = _run("torch", [0, 0, 0])
    fast = _run("triton", [0, 0, 0])
    assert fast[0].shape == (0, 200)
    assert fast[1].shape == (0, 200)
    _assert_same(fast, ref)
    assert_kernel_path(fast[2])


def test_router_scaled_expert_token_groups_take_the_scaled_kernel_with_the_reference_bits():
    ref = _run("torch", [4, 0, 5], row_scale=True)
    fast = _run("triton", [4, 0, 5], row_scale=True)
    _assert_same(fast, ref)
    assert REFERENCE_NODE in ref[2]
    assert SCALED_NODE not in ref[2]
    assert SCALED_NODE in fast[2]
    assert REFERENCE_NODE not in fast[2]
