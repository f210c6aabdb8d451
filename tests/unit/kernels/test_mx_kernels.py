"""MXFP4 and MXFP8 in the one-launch grouped kernels (weights of N experts, tokens split by ``m_splits``, the scaled
down-projection operand, the straight-through backward), bit-exact with the reference ``numerics.mx`` per expert:
ragged experts, a last dim that is not a multiple of 32 (zero-padded blocks), every input dtype, and the edge values
(all-zero and all-NaN blocks, NaN and Inf, -0.0, an amax that underflows the quotient, E4M3 subnormals).

Runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1); tests/gpu/test_mx_gpu.py runs the same
comparisons natively.
"""

import pytest
import torch
from test_grouped_fake_quant import assert_bits_equal, input_reference, make_experts, make_tokens  # noqa: E402

from modelopt_moe import kernels as K
from modelopt_moe.numerics import fake_quant, scale_rows

needs_triton = pytest.mark.skipif(
    not K.kernels_available("cpu"), reason="Triton interpreter not active (needs triton and TRITON_INTERPRET=1)"
)
MX = ["mxfp4", "mxfp8"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
RAGGED = [(7, 64), (1, 70), (13, 32), (3, 100)]  # 70 and 100: partial last blocks


def with_edges(w: torch.Tensor) -> torch.Tensor:
    """``w`` (2-D, at least 4 x 64) with edge values in its first blocks."""
    w = w.clone()
    w[0, 3] = float("nan")  # NaN inside a block: ignored by its max, stays NaN
    w[1, 5], w[1, 9] = float("inf"), float("-inf")  # Inf: the block max counts FLT_MAX
    w[2, :32] = 0.0  # an all-zero block: scale 1
    w[2, 7] = -0.0
    w[3, :32] = float("nan")  # an all-NaN block
    if w.dtype != torch.float16:
        w[3, 32:64] = 1e-38  # tiny: an exponent near the bottom of E8M0 (values round to subnormal E4M3 or 0)
        w[3, 33] = 3e-38
    return w


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_weights_of_ragged_experts_are_bit_exact_with_the_reference(fmt, dtype):
    weights = make_experts(RAGGED, dtype, seed=3)
    weights[0] = with_edges(weights[0])
    outs = K.grouped_weight_fake_quant(weights, None, fmt)
    for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
        assert_bits_equal(o, fake_quant(w, fmt), f"{fmt} expert {i}")
    assert outs[0][1, 5] == float("inf")  # 6 (or 448) * 2**e overflows back to +-Inf
    assert outs[0][1, 9] == float("-inf")
    assert torch.isnan(outs[0][0, 3])


@needs_triton
@pytest.mark.parametrize("fmt", MX)
def test_one_expert_of_one_shape_takes_the_uniform_path_and_an_amax_is_never_read(fmt):
    weights = make_experts([(16, 64)] * 3, torch.bfloat16, seed=5)
    ref = [fake_quant(w, fmt) for w in weights]
    for amax in (None, torch.tensor([0.0, float("nan"), 1e-3])):  # whatever calibration recorded
        for o, r in zip(K.grouped_weight_fake_quant(weights, amax, fmt), ref, strict=True):
            assert_bits_equal(o, r, fmt)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_tokens_of_n_experts_are_bit_exact_with_the_reference_at_a_padded_width(fmt, dtype):
    m_splits = [3, 0, 5, 2]
    x = with_edges(make_tokens(m_splits, 80, dtype, seed=2))  # 80: two blocks and a padded one
    y = K.grouped_input_fake_quant(x, m_splits, None, fmt)
    assert_bits_equal(y, input_reference(x, m_splits, None, fmt, None), fmt)
    p = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(4))
    ys = K.grouped_input_fake_quant_scaled(x, m_splits, None, fmt, p)
    assert_bits_equal(ys, scale_rows(input_reference(x, m_splits, None, fmt, None), p), fmt)


@needs_triton
@pytest.mark.parametrize("fmt", MX)
def test_straight_through_backward_passes_the_gradients_unchanged(fmt):
    weights = [w.requires_grad_(True) for w in make_experts([(8, 64), (4, 96)], torch.float32, seed=6)]
    for ste in ("pass_through", "clipped"):  # no amax: nothing to clip at, as Model Optimizer's MX
        outs = K.grouped_weight_fake_quant_ste(weights, None, fmt, ste=ste)
        grads = [torch.randn_like(o) for o in outs]
        got = torch.autograd.grad(outs, weights, grads)
        assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))
    x = make_tokens([2, 3], 64, torch.float32, seed=7).requires_grad_(True)
    y = K.grouped_input_fake_quant_ste(x, [2, 3], None, fmt, ste="clipped")
    g = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], g)


@needs_triton
@pytest.mark.parametrize("options", [{"tile": 1024, "warps": 2}, {"tile": 8192, "lean": False},
                                     {"uniform": False, "even": False}], ids=str)
@pytest.mark.parametrize("fmt", MX)
def test_every_launch_option_gives_the_reference_bits(fmt, options):
    from modelopt_moe.kernels import tuning

    try:
        tuning.set_weight_kernel_config(fmt, **options)
        for shapes in ([(8, 64)] * 3, RAGGED[:3]):
            weights = make_experts(shapes, torch.bfloat16, seed=8)
            for o, w in zip(K.grouped_weight_fake_quant(weights, None, fmt), weights, strict=True):
                assert_bits_equal(o, fake_quant(w, fmt), f"{fmt} {options} {shapes}")
    finally:
        tuning.reset_weight_kernel_config()
        K.clear_table_cache()


@needs_triton
@pytest.mark.parametrize("fmt", MX)
def test_mx_grouped_linear_traces_with_fullgraph_and_matches_eager(fmt):
    import warnings

    import modelopt_moe.quantization as mtq
    from modelopt_moe.quantization.nn import GroupedLinear

    splits = [3, 0, 5]
    torch.manual_seed(0)
    layer = GroupedLinear(len(splits), 48, 16, bias=True)  # 48: a padded last block
    cfg = mtq.load_config(f"{fmt}_default.yaml")
    cfg.kernel = "triton"
    x = torch.randn(sum(splits), 48, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(layer, cfg, lambda m: m(x, splits))

    def run(fn):
        for w in layer.parameters():
            w.grad = None
        xx = x.clone().requires_grad_(True)
        y = fn(xx)
        y.square().sum().backward()
        return y.detach(), xx.grad, [w.grad.clone() for w in layer.expert_weights()]

    eager = run(lambda t: layer(t, splits))
    torch._dynamo.reset()
    compiled = run(torch.compile(lambda t: layer(t, splits), fullgraph=True, backend="aot_eager"))
    assert torch.equal(compiled[0], eager[0])
    assert torch.equal(compiled[1], eager[1])
    assert all(torch.equal(a, b) for a, b in zip(compiled[2], eager[2], strict=True))
