"""Grouped input fake quant times a per-row scale (an expert down projection's ``prob * Q(act)``): one launch,
bit-exact against ``numerics.scale_rows`` of the reference fake quant; gradients bit-exact against autograd of the
reference.

Runs in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1); tests/gpu/test_kernels_gpu.py runs the same
comparisons natively.
"""

import pytest
import torch
from test_grouped_fake_quant import FORMATS, assert_bits_equal, input_reference, make_tokens  # noqa: E402

from modelopt_moe import kernels as K
from modelopt_moe.kernels import input_fake_quant
from modelopt_moe.numerics import fake_quant, scale_rows

needs_triton = pytest.mark.skipif(
    not K.kernels_available("cpu"), reason="Triton interpreter not active (needs triton and TRITON_INTERPRET=1)"
)

M_SPLITS = [3, 0, 5, 0, 2, 6]  # uneven, with experts of no rows
AMAX = [0.7, 5.0, 9.0, 0.0, 30.0, 200.0]  # expert 3 has no rows; the tokens of expert i are scaled by 4**i


def probs(n, dtype=torch.float32, seed=1):
    """Router-like probabilities in (0, 1], with an exact 1, an exact 0, a tiny value and a bf16 tie-maker."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g)
    p[: min(n, 4)] = torch.tensor([1.0, 0.0, 2.0**-30, 0.5 + 2.0**-9])[: min(n, 4)]
    return p.to(dtype)


def scaled_reference(x, m_splits, amax, fmt, block_size, p):
    return scale_rows(input_reference(x, m_splits, amax, fmt, block_size), p)


@needs_triton
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_scaled_input_per_expert_bit_exact(fmt, block_size, dtype, p_dtype):
    x = make_tokens(M_SPLITS, 32, dtype)
    amax = torch.tensor(AMAX)
    p = probs(x.shape[0], p_dtype)
    y = K.grouped_input_fake_quant_scaled(x, torch.tensor(M_SPLITS, dtype=torch.int32), amax, fmt, p, block_size)
    assert_bits_equal(y, scaled_reference(x, M_SPLITS, amax, fmt, block_size, p))


@needs_triton
@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "nvfp4_four_over_six", "int8"])
def test_scaled_input_shared_amax_and_single_expert(fmt):
    x = make_tokens([5, 4], 48, torch.bfloat16)
    p = probs(9)
    amax = torch.tensor(6.0)
    ref = scale_rows(fake_quant(x, fmt, amax), p)
    assert_bits_equal(K.grouped_input_fake_quant_scaled(x, torch.tensor([5, 4]), amax, fmt, p), ref)
    assert_bits_equal(K.grouped_input_fake_quant_scaled(x, torch.tensor([9]), torch.tensor([6.0]), fmt, p), ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "nvfp4_four_over_six"])
def test_edge_values_of_tokens_and_scales(fmt, dtype):
    """Signed zeros, NaN, Inf, subnormal and huge tokens; scales 0, -0, NaN, Inf, tiny (products that underflow),
    huge (products that overflow the output dtype) and values whose products round to a tie."""
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -3e-39, 1e30, -6.0, 448.0,
                            0.1, -0.3, 7.5, 1.0, -1.0, 2.0])
    x = torch.cat([special.repeat(2, 1), make_tokens([6], 16, torch.float32, seed=5) * 1e3]).to(dtype)
    scales = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 1e-38, 3e38, 1.0 + 2.0**-8, 0.75])
    m = [3, 0, 5]
    for amax in (torch.tensor([2.0, 1.0, 1e4]), torch.tensor([float("nan"), 0.0, 5.0])):
        y = K.grouped_input_fake_quant_scaled(x, torch.tensor(m), amax, fmt, scales)
        assert_bits_equal(y, scaled_reference(x, m, amax, fmt, None, scales), str(amax))


@needs_triton
def test_a_wrong_row_scale_or_expert_shows():
    """Every row gets its own scale and its own expert's amax: scaling rows of one expert by 4**i and shuffling the
    scales gives a different result."""
    x = make_tokens(M_SPLITS, 32, torch.bfloat16)
    p = torch.arange(1, x.shape[0] + 1, dtype=torch.float32) / 64
    m, amax = torch.tensor(M_SPLITS), torch.tensor(AMAX)
    y = K.grouped_input_fake_quant_scaled(x, m, amax, "e4m3", p)
    assert not torch.equal(y, K.grouped_input_fake_quant_scaled(x, m, amax, "e4m3", p.flip(0)))
    assert not torch.equal(y, K.grouped_input_fake_quant_scaled(x, m, amax.flip(0), "e4m3", p))


class _ReferenceSTE(torch.autograd.Function):
    """The reference fake quant with a pass-through or clipped straight-through gradient (``|x| <= amax`` per row)."""

    @staticmethod
    def forward(ctx, x, m_splits, amax, fmt, clipped):
        ctx.save_for_backward(x)
        ctx.m_splits, ctx.amax, ctx.clipped = m_splits, amax, clipped
        return input_reference(x, m_splits, amax, fmt, None)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if not ctx.clipped:
            return grad, None, None, None, None
        rows = torch.repeat_interleave(ctx.amax, torch.tensor(ctx.m_splits)).unsqueeze(-1)
        return grad * (x.abs() <= rows), None, None, None, None


@needs_triton
@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_gradients_equal_autograd_of_the_reference(ste, dtype, p_dtype):
    x0 = make_tokens(M_SPLITS, 32, dtype)
    p0 = probs(x0.shape[0], p_dtype)
    amax = torch.tensor([0.7, 5.0, 9.0, 0.0, 30.0, 200.0]) * 0.5  # some tokens clip
    g = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7)).to(dtype)

    x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    y = K.grouped_input_fake_quant_scaled_ste(x, torch.tensor(M_SPLITS), amax, "e4m3", p, ste=ste)
    y.backward(g)

    xr, pr = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    yr = scale_rows(_ReferenceSTE.apply(xr, M_SPLITS, amax, "e4m3", ste == "clipped"), pr)
    yr.backward(g)
    assert_bits_equal(y.detach(), yr.detach(), "forward")
    assert_bits_equal(x.grad, xr.grad, "token gradient")
    assert_bits_equal(p.grad, pr.grad, "scale gradient")


@needs_triton
def test_gradient_to_the_scale_only_and_to_the_tokens_only():
    x0, m, amax = make_tokens([4, 3], 16, torch.bfloat16), torch.tensor([4, 3]), torch.tensor([3.0, 40.0])
    p0, g = probs(7), torch.randn(7, 16).to(torch.bfloat16)
    p = p0.clone().requires_grad_()
    K.grouped_input_fake_quant_scaled_ste(x0, m, amax, "e4m3", p).backward(g)
    q = input_reference(x0, [4, 3], amax, "e4m3", None)
    assert_bits_equal(p.grad, (g.float() * q.float()).sum(-1))
    x = x0.clone().requires_grad_()
    K.grouped_input_fake_quant_scaled_ste(x, m, amax, "e4m3", p0, ste="clipped").backward(g)
    rows = torch.repeat_interleave(amax, m).unsqueeze(-1)
    assert_bits_equal(x.grad, scale_rows(g, p0) * (x0.abs() <= rows))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_scaled_clip_grad_kernel(dtype):
    x = make_tokens(M_SPLITS, 40, dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    g[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)
    p = probs(x.shape[0])
    amax = torch.tensor([0.7, 5.0, 9.0, 0.0, float("inf"), 200.0])
    got = K.grouped_input_scaled_clip_grad(g, x, torch.tensor(M_SPLITS), amax, p)
    rows = torch.repeat_interleave(torch.where(amax.isfinite() & (amax > 2.0**-24), amax, torch.inf),
                                   torch.tensor(M_SPLITS)).unsqueeze(-1)
    assert_bits_equal(got, scale_rows(g, p) * (x.abs() <= rows))


def test_torch_fallback_is_bit_exact(monkeypatch):
    """The pure-torch path (no triton, or CPU without the interpreter) gives the same bits and gradients."""
    monkeypatch.setattr(input_fake_quant, "kernels_available", lambda device: False)
    x0 = make_tokens(M_SPLITS, 32, torch.bfloat16)
    p0, amax = probs(x0.shape[0]), torch.tensor(AMAX)
    for fmt, bs in FORMATS:
        y = K.grouped_input_fake_quant_scaled(x0, torch.tensor(M_SPLITS), amax, fmt, p0, bs)
        assert_bits_equal(y, scaled_reference(x0, M_SPLITS, amax, fmt, bs, p0), fmt)
    g = torch.randn(x0.shape).to(torch.bfloat16)
    got = K.grouped_input_scaled_clip_grad(g, x0, torch.tensor(M_SPLITS), amax, p0)
    rows = torch.repeat_interleave(torch.where(amax > 2.0**-24, amax, torch.inf), torch.tensor(M_SPLITS))
    assert_bits_equal(got, scale_rows(g, p0) * (x0.abs() <= rows.unsqueeze(-1)))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: K.grouped_input_fake_quant_scaled(torch.ones(4, 16), [4], torch.ones(1), "e4m3", torch.ones(3)),
         r"row_scale must be a \[4\] tensor"),
        (lambda: K.grouped_input_fake_quant_scaled(torch.ones(4, 16), [4], torch.ones(1), "e4m3", torch.ones(4, 1)),
         r"row_scale must be a \[4\] tensor"),
        (lambda: K.grouped_input_fake_quant_scaled(torch.ones(4, 16), [4], torch.ones(1), "e4m3",
                                                   torch.ones(4, dtype=torch.int64)), "row_scale has dtype"),
        (lambda: K.grouped_input_fake_quant_scaled(torch.ones(4, 16), [4], torch.ones(1), "e4m3", None),
         "row_scale must be"),
        (lambda: K.grouped_input_scaled_clip_grad(torch.ones(4, 16), torch.ones(4, 16), [4], None, torch.ones(4)),
         "amax is required"),
        (lambda: K.grouped_input_scaled_clip_grad(torch.ones(4, 16).bfloat16(), torch.ones(4, 16), [4], torch.ones(1),
                                                  torch.ones(4)), "x's dtype"),
        (lambda: K.grouped_input_fake_quant_scaled_ste(torch.ones(4, 16), [4], torch.ones(1), "e4m3", torch.ones(4),
                                                       ste="clip"), "ste"),
    ],
)
def test_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@needs_triton
def test_torch_compile_fullgraph_traces_the_op():
    x, m, amax, p = make_tokens([3, 1], 32, torch.float32), torch.tensor([3, 1]), torch.tensor([2.0, 9.0]), probs(4)

    def fn(x, m, amax, p):
        return K.grouped_input_fake_quant_scaled(x, m, amax, "e4m3", p)

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, m, amax, p)
    assert_bits_equal(got, scaled_reference(x, [3, 1], amax, "e4m3", None, p))


def test_fake_tensors_give_fake_outputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, m, amax, p = torch.empty(6, 32), torch.tensor([4, 2]), torch.ones(2), torch.empty(6)
        assert K.grouped_input_fake_quant_scaled(x, m, amax, "e4m3", p).shape == (6, 32)
        assert K.grouped_input_scaled_clip_grad(torch.empty(6, 32), x, m, amax, p).shape == (6, 32)
