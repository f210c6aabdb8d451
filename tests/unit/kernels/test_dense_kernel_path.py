"""Dense quantizers (``nn.Linear`` weights and inputs, a lone ``TensorQuantizer``) on the experts' one-launch kernels
(``kernel: triton``, here under the Triton interpreter) give the reference path's bits (``kernel: torch``): outputs,
input, weight and learned-amax gradients; and the kernel path is the one taken, read from the autograd graph."""

import warnings

import pytest
import torch
from autograd_paths import KERNEL_NODES, assert_kernel_path, assert_reference_path, graph_nodes
from torch import nn

import modelopt_moe.quantization as mtq
from modelopt_moe.kernels import dense_layout, kernels_available
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

pytestmark = pytest.mark.skipif(not kernels_available("cpu"), reason="needs the Triton interpreter on CPU")


def _linear(preset, kernel, ste, *, dtype=torch.float32, in_features=48, edit=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, 16, bias=True)).to(dtype)
    with torch.no_grad():
        model[0].weight[3].mul_(9.0)  # one large row: per-channel amaxes differ
    cfg = mtq.load_config(preset)
    cfg.backward.ste, cfg.kernel = ste, kernel
    if edit is not None:
        edit(cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, in_features, generator=g).to(dtype)  # 3-D: leading dims flattened into tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: m(x))
    x = (x * 1.5).requires_grad_(True)  # past the calibrated amax: the clipped STE clips some
    y = model(x)
    y.backward(torch.randn(y.shape, generator=g).to(dtype))
    grads = [p.grad for p in model.parameters()]
    return y.detach(), x.grad, grads, graph_nodes(y)


def _assert_same(fast, ref):
    assert torch.equal(fast[0], ref[0])
    assert torch.equal(fast[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(fast[2], ref[2], strict=True))


@pytest.mark.parametrize(("preset", "ste", "dtype"), [
    ("fp8_default.yaml", "clipped", torch.bfloat16),
    ("fp8_default.yaml", "pass_through", torch.float32),
    ("nvfp4_default.yaml", "clipped", torch.float32),
    ("nvfp4_default.yaml", "pass_through", torch.bfloat16),
    ("nvfp4_4over6.yaml", "clipped", torch.bfloat16),  # 4-over-6 block scales from the data
    ("int8_default.yaml", "clipped", torch.float32),  # per-channel weights: the weight op, one expert
    ("mxfp8_default.yaml", "pass_through", torch.bfloat16),
    ("fp8_block_w8a8.yaml", "pass_through", torch.float32),  # 128 x 128 weight blocks, 1 x 128 input groups
])
def test_quantized_linear_on_the_kernels_matches_the_reference_bit_for_bit(preset, ste, dtype):
    ref = _linear(preset, "torch", ste, dtype=dtype)
    fast = _linear(preset, "triton", ste, dtype=dtype)
    _assert_same(fast, ref)
    assert_reference_path(ref[3])
    assert_kernel_path(fast[3])


@pytest.mark.parametrize("preset", ["int4_blockwise_weight_only.yaml", "mxfp4_default.yaml"])
def test_padded_blocks_on_a_last_dim_that_is_no_multiple_take_the_kernels_bit_for_bit(preset):
    # 40 features: int4's blocks of 128 and MX's blocks of 32 are zero-padded.
    ref = _linear(preset, "torch", "clipped", in_features=40)
    fast = _linear(preset, "triton", "clipped", in_features=40)
    _assert_same(fast, ref)
    assert_kernel_path(fast[3])


def _learned(cfg):
    cfg.weight_amax_update, cfg.input_amax_update = "learned", "learned"


def _refreshed(cfg):
    cfg.weight_amax_update = "dynamic"


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "nvfp4_default.yaml"])
def test_learned_amaxes_get_the_same_values_and_gradients_on_the_kernels(preset):
    ref = _linear(preset, "torch", "clipped", edit=_learned)
    fast = _linear(preset, "triton", "clipped", edit=_learned)
    _assert_same(fast, ref)  # the parameters include both learned amaxes: their gradients match too


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "int8_default.yaml"])
def test_refreshed_weight_amax_takes_the_kernels_bit_for_bit(preset):
    ref = _linear(preset, "torch", "clipped", edit=_refreshed)
    fast = _linear(preset, "triton", "clipped", edit=_refreshed)
    _assert_same(fast, ref)
    assert KERNEL_NODES & fast[3]


def _edge_values(k: int, dtype) -> torch.Tensor:
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2)) * 3
    x[0] = 0.0
    x[1, 0], x[1, 1], x[1, 2] = float("nan"), float("inf"), -float("inf")
    x[2, :4] = torch.tensor([1e6, -1e6, 2.0**-30, -(2.0**-30)])  # saturating and tiny
    x[3] = x[3] * 1e-3
    return x.to(dtype)


def _quantize_twice(cfg: dict, x: torch.Tensor, amax, ste: str):
    out = []
    for kernel in ("torch", "triton"):
        q = TensorQuantizer(cfg, amax=amax)
        q.ste, q.kernel = ste, kernel
        xi = x.clone().requires_grad_(True)
        y = q(xi)
        grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
        grad[0, 0] = float("nan")
        y.backward(grad)
        out.append((y.detach(), xi.grad, graph_nodes(y)))
    return out


@pytest.mark.parametrize(("cfg", "amax", "k"), [
    ({"num_bits": (4, 3)}, 2.0, 40),
    ({"num_bits": (4, 3)}, 0.0, 40),  # a zero amax: the format's bound
    ({"num_bits": (4, 3)}, float("nan"), 40),
    ({"num_bits": (5, 2)}, 1e-30, 40),  # tiny
    ({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}, 3.0, 48),
    ({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3), "four_over_six": True}},
     3.0, 48),  # NVFP4 with 4-over-6 block scales from the data
    ({"num_bits": 8}, 2.0, 40),
    ({"num_bits": 4, "block_sizes": {-1: 16, "type": "dynamic"}}, None, 40),  # int blocks from the data, padded
])
@pytest.mark.parametrize("ste", ["clipped", "pass_through"])
def test_edge_values_take_the_kernels_with_the_reference_bits(cfg, amax, k, ste):
    x = _edge_values(k, torch.bfloat16)
    ref, fast = _quantize_twice(cfg, x, amax, ste)
    assert torch.equal(fast[0].isnan(), ref[0].isnan())
    assert torch.equal(fast[0].nan_to_num(), ref[0].nan_to_num())
    assert torch.equal(fast[1].isnan(), ref[1].isnan())
    assert torch.equal(fast[1].nan_to_num(), ref[1].nan_to_num())
    assert_kernel_path(fast[2])
    assert_reference_path(ref[2])


def test_layouts_the_grouped_ops_do_not_take_stay_on_the_reference():
    x = torch.randn(4, 40)
    per_token = TensorQuantizer({"num_bits": (4, 3), "type": "dynamic", "block_sizes": {-1: None}})
    nvfp4_ragged = TensorQuantizer({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic",
                                                                       "scale_bits": (4, 3)}}, amax=1.0)
    unsigned = TensorQuantizer({"num_bits": 8, "unsigned": True}, amax=1.0)
    per_tensor_dynamic = TensorQuantizer({"num_bits": (4, 3), "type": "dynamic"})  # an amax from each tensor
    for q in (per_token, per_tensor_dynamic, unsigned):
        q.kernel = "triton"
        y = q(x.clone().requires_grad_(True))
        assert graph_nodes(y) & KERNEL_NODES == set()
    assert dense_layout(x, torch.tensor(1.0), "nvfp4", None) is None  # 40 is no multiple of NVFP4's 16
    static = TensorQuantizer({"num_bits": (4, 3)}, amax=1.0)
    static.kernel = "triton"
    permuted = torch.randn(40, 4).t().requires_grad_(True)  # a permuted view: the reference keeps its layout
    y = static(permuted)
    assert graph_nodes(y) & KERNEL_NODES == set()
    assert y.stride() == permuted.stride()
    nvfp4_ragged.kernel = "triton"
    with pytest.raises(ValueError, match="16"):  # the reference's own error, unchanged
        nvfp4_ragged(x)


@pytest.mark.parametrize("preset", ["fp8_default.yaml", "int8_default.yaml"])
def test_quantized_linear_on_the_kernels_traces_with_fullgraph_and_matches_eager(preset):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16))
    cfg = mtq.load_config(preset)
    cfg.backward.ste, cfg.kernel = "clipped", "triton"
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: m(x))

    def run(fn):
        model.zero_grad(set_to_none=True)
        xx = (x * 1.5).requires_grad_(True)
        y = fn(xx)
        y.square().sum().backward()
        return y.detach(), xx.grad, [p.grad.clone() for p in model.parameters()]

    eager = run(model)
    torch._dynamo.reset()
    compiled = run(torch.compile(model, fullgraph=True, backend="aot_eager"))
    _assert_same(compiled, eager)
