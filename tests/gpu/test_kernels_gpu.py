"""Grouped fake-quant kernels natively on CUDA: bit-exact against formats.fake_quant per expert (on the GPU and on
the CPU), CUDA graph capture and replay, torch.compile(fullgraph=True), and no host synchronisation.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_kernels_gpu.py``. TRITON_INTERPRET must not be set.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from gpu_kernel_checks import _compiled_triton, assert_bits_equal  # noqa: E402, F401  (autouse)

from modelopt_moe import kernels as K  # noqa: E402
from modelopt_moe.kernels import launch  # noqa: E402
from modelopt_moe.numerics import fake_quant, round_to_e2m1, scale_rows  # noqa: E402

FORMATS = [("e4m3", None), ("e5m2", None), ("nvfp4", None), ("nvfp4_four_over_six", None), ("int8", None),
           ("int4", None), ("int8", 16), ("int4", 128), ("int7", None), ("int2", None), ("int3", 16), ("int5", None),
           ("int6", 32)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEV = "cuda"


def expert_amax(amax, i):
    if amax is None or amax.dim() == 0:
        return amax
    return amax[i] if amax.dim() == 1 else amax[i].unsqueeze(-1)


def reference(weights, amax, fmt, block_size):
    return [fake_quant(w, fmt, expert_amax(amax, i), block_size) for i, w in enumerate(weights)]


def make_experts(shapes, dtype, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    # Expert magnitudes 2**(i % 13 - 6): distinct among neighbours, in range for every dtype.
    return [(torch.randn(s, generator=g, device=device) * 2.0 ** (i % 13 - 6)).to(dtype) for i, s in enumerate(shapes)]


def distinct_amax(weights, factor=0.8):
    return torch.stack([w.float().abs().amax() * (factor + 0.01 * (i % 17)) for i, w in enumerate(weights)])


# Realistic expert shapes (rows x K) per N, kept small enough for the per-expert reference loop.
SHAPES = {1: [(1536, 2048)], 3: [(768, 1024), (256, 1024), (512, 1024)], 32: [(384, 512)] * 32,
          128: [(128, 256)] * 128, 256: [(64 + 16 * (i % 5), 256) for i in range(256)]}


@pytest.mark.parametrize("n", sorted(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_weights_bit_exact_per_expert(fmt, block_size, dtype, n):
    weights = make_experts(SHAPES[n], dtype, seed=n)
    amax = distinct_amax(weights)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt, block_size)
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, fmt, block_size), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_gpu_kernel_matches_cpu_reference(fmt, block_size):
    """One contract across devices: the CUDA kernel gives the bits formats.fake_quant gives on the CPU."""
    weights = make_experts([(96, 256), (32, 256), (64, 512)], torch.bfloat16)
    amax = distinct_amax(weights)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt, block_size)
    refs = reference([w.cpu() for w in weights], amax.cpu(), fmt, block_size)
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_edge_amax_nan_inf_and_per_channel(fmt, block_size):
    weights = make_experts([(64, 256)] * 7, torch.bfloat16)
    weights[1][3, 5] = float("nan")
    weights[1][7, 200] = float("inf")
    weights[1][9, 17] = -float("inf")
    amax = torch.tensor([0.0, 2.0**-24, 2.0**-24 * (1 + 2.0**-23), float("nan"), float("inf"), 3.4e38, 1e-3],
                        device=DEV)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt, block_size)
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, fmt, block_size), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")
    assert torch.isnan(outs[1]).sum() == 1
    assert all(not torch.isnan(o).any() for j, o in enumerate(outs) if j != 1)
    if block_size is None:
        ch = torch.stack([w.float().nan_to_num(0, 0, 0).abs().amax(dim=1) * 0.7 for w in weights])
        ch[2, 3] = float("nan")
        outs = K.grouped_weight_fake_quant(weights, ch, fmt)
        for i, (o, r) in enumerate(zip(outs, reference(weights, ch, fmt, None), strict=True)):
            assert_bits_equal(o, r, f"per-channel expert {i}")


def _all_finite_bf16():
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x)).reshape(256, 256).contiguous().to(DEV)


@pytest.mark.parametrize(("fmt", "amax"), [("e4m3", 448.0), ("e4m3", 3.7), ("e5m2", 57344.0), ("e5m2", 5.1e3),
                                      ("nvfp4", 3.7), ("nvfp4", 2688.0), ("nvfp4_four_over_six", 3.7),
                                      ("nvfp4_four_over_six", 1536.0), ("int8", 0.3), ("int4", 7.0)])
def test_sweep_all_finite_bf16(fmt, amax):
    x = _all_finite_bf16()
    a = torch.tensor([amax], device=DEV)
    out = K.grouped_weight_fake_quant([x], a, fmt)[0]
    assert_bits_equal(out, fake_quant(x, fmt, a[0]))
    assert_bits_equal(out, fake_quant(x.cpu(), fmt, a[0].cpu()))
    # The input kernel rounds with the same hardware converter: every value again, split over two experts.
    halves = torch.tensor([128, 128], device=DEV)
    y = K.grouped_input_fake_quant(x, halves, a.expand(2).contiguous(), fmt)
    assert_bits_equal(y, out)
    if (fmt, amax) == ("e4m3", 448.0):
        assert_bits_equal(out, torch.clamp(x.float(), -448, 448).to(torch.float8_e4m3fn).float().to(x.dtype))


def test_e2m1_and_output_conversion_edges():
    import triton
    import triton.language as tl

    from modelopt_moe.kernels.tile_kernels import to_out_dtype

    @triton.jit
    def convert(x_ptr, y_ptr, n, BLOCK: tl.constexpr, BITWISE: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, to_out_dtype(x, y_ptr.dtype.element_ty, BITWISE), mask=offs < n)

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = ((torch.randint(0, 1 << 16, (1 << 16,), generator=g) << 16) | 0x8000).to(torch.int32)
    x = torch.cat([bits, ties, ties - 1, ties + 1]).view(torch.float32)
    x = torch.cat([x, torch.tensor([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-149])])
    for dtype in (torch.bfloat16, torch.float16):
        for bitwise in (False, True):  # hardware cvt.rn (used on GPU) and the interpreter's arithmetic, natively
            xd = x.to(DEV)
            y = torch.empty(xd.shape, dtype=dtype, device=DEV)
            convert[(triton.cdiv(x.numel(), 4096),)](xd, y, x.numel(), BLOCK=4096, BITWISE=bitwise)
            assert_bits_equal(y, x.to(dtype), f"{dtype} bitwise={bitwise}")
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.5, 5.9, 5.5, 6.0, 1.0, 2.0, 3.0])
    x = torch.cat([torch.full((2, 1), 6.0), torch.stack([vals, -vals])], dim=1).contiguous().to(DEV)
    out = K.grouped_weight_fake_quant([x], torch.tensor([2688.0], device=DEV), "nvfp4")[0]
    assert_bits_equal(out, round_to_e2m1(x))


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_four_over_six"])
def test_nvfp4_rounding_options_give_the_same_bits(fmt):
    """The GPU-only options (fp8 block scales by the hardware converter, the hardware NaN-ignoring block max, no
    redundant clamp) against the arithmetic the interpreter runs, on every finite bf16 value, NaN / Inf blocks and
    blocks at the 4-vs-6 tie (max 12 with sg = 1: candidates' scales 2 and 3; the second block ties)."""
    from modelopt_moe.kernels import tuning

    x = _all_finite_bf16()
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=DEV, dtype=x.dtype)
    x[1, :16] = 0.0
    x[1, :3] = torch.tensor([12.0, 1.5, 2.0], device=DEV, dtype=x.dtype)
    x[1, 16:32] = 0.0
    x[1, 16:18] = torch.tensor([12.0, 1.5], device=DEV, dtype=x.dtype)
    m = torch.tensor([100, 0, 156], device=DEV)
    outs = []
    for options in ({}, {"hw_cvt": False, "lean": False, "fast_max": False}):
        tuning.set_weight_kernel_config(**options)
        try:
            for amax in (3.7, 1536.0):
                a = torch.tensor([amax], device=DEV)
                w = K.grouped_weight_fake_quant([x], a, fmt)[0]
                assert_bits_equal(w, fake_quant(x.cpu(), fmt, a[0].cpu()), f"{fmt} {options} amax {amax}")
                y = K.grouped_input_fake_quant(x, m, a.expand(3).contiguous(), fmt)
                assert_bits_equal(y, w, f"{fmt} {options} amax {amax} tokens")
                outs.append(w)
        finally:
            tuning.reset_weight_kernel_config()
    assert_bits_equal(outs[0], outs[2])


def test_four_over_six_near_ties_follow_the_reference_error_sum():
    """Blocks whose two candidates' squared errors nearly tie (max 12 with sg = 1, a 1.5 and a 2.0 at random places,
    small values that round to 0 in both): their choice depends on the order of the error sum, and the kernels sum
    as the reference does (a fixed tree of adjacent pairs), whatever the warps' reduction order would be."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4096, 16, generator=g) * 0.45 * 2.0 ** -torch.randint(0, 6, (4096, 16), generator=g).float()
    for row in x:
        where = torch.randperm(15, generator=g)[:3] + 1
        row[0], row[where[0]], row[where[1]], row[where[2]] = 12.0, 1.5, 2.0, 0.0
    x = x.reshape(256, 256).to(DEV)
    a = torch.tensor([1536.0], device=DEV)
    ref = fake_quant(x.cpu(), "nvfp4_four_over_six", a[0].cpu())
    assert_bits_equal(K.grouped_weight_fake_quant([x], a, "nvfp4_four_over_six")[0], ref)
    m = torch.tensor([100, 0, 156], device=DEV)
    assert_bits_equal(K.grouped_input_fake_quant(x, m, a.expand(3).contiguous(), "nvfp4_four_over_six"), ref)


@pytest.mark.parametrize("per_channel", [False, True])
def test_clipped_backward(per_channel):
    weights = [w.requires_grad_() for w in make_experts([(256, 512)] * 32, torch.bfloat16)]
    if per_channel:
        amax = torch.stack([w.detach().float().abs().amax(dim=1) * 0.6 for w in weights])
    else:
        amax = distinct_amax([w.detach() for w in weights], 0.6)
    amax[3] = float("nan")
    outs = K.grouped_weight_fake_quant_ste(weights, amax, "e4m3", ste="clipped")
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    for i, (w, g) in enumerate(zip(weights, grads, strict=True)):
        a = expert_amax(amax, i)
        limit = torch.where(torch.isfinite(a) & (a > 2.0**-24), a, torch.full_like(a, float("inf")))
        assert_bits_equal(w.grad, g * (w.detach().float().abs() <= limit), f"expert {i}")


@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
@pytest.mark.parametrize("n", [1, 32, 128])
def test_input_per_expert(fmt, block_size, n):
    g = torch.Generator(device=DEV).manual_seed(n)
    m = torch.randint(0, 64, (n,), generator=g, device=DEV)
    m[0] = 0
    t = int(m.sum())
    x = (torch.randn(t, 1024, generator=g, device=DEV) * 3).to(torch.bfloat16)
    amax = torch.rand(n, generator=g, device=DEV) * 4 + 0.1
    y = K.grouped_input_fake_quant(x, m, amax, fmt, block_size)
    parts = x.split(m.tolist())
    ref = torch.cat([fake_quant(p, fmt, amax[i], block_size) for i, p in enumerate(parts)])
    assert_bits_equal(y, ref)
    gy = torch.randn_like(x)
    rows = torch.repeat_interleave(amax, m).unsqueeze(-1)
    assert_bits_equal(K.grouped_input_clip_grad(gy, x, m, amax), gy * (x.float().abs() <= rows))


@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_scaled_input_per_expert(fmt, block_size, dtype, p_dtype):
    """``prob * Q(act)`` in one launch (an expert down projection's operand): the reference on the GPU and on the CPU,
    bit for bit; the clipped gradient with the same scale too."""
    g = torch.Generator(device=DEV).manual_seed(11)
    n = 32
    m = torch.randint(0, 64, (n,), generator=g, device=DEV)
    m[0] = 0
    t = int(m.sum())
    x = (torch.randn(t, 1024, generator=g, device=DEV) * 3).to(dtype)
    amax = torch.rand(n, generator=g, device=DEV) * 4 + 0.1
    p = torch.rand(t, generator=g, device=DEV).to(p_dtype)
    p[:3] = torch.tensor([0.0, 1.0, 2.0**-30], device=DEV).to(p_dtype)
    y = K.grouped_input_fake_quant_scaled(x, m, amax, fmt, p, block_size)
    splits = m.tolist()
    for where in (DEV, "cpu"):
        xs, ams, ps = x.to(where), amax.to(where), p.to(where)
        ref = scale_rows(torch.cat([fake_quant(c, fmt, ams[i], block_size) for i, c in enumerate(xs.split(splits))]),
                         ps)
        assert_bits_equal(y, ref, f"reference on {where}")
    gy = torch.randn(x.shape, generator=g, device=DEV).to(dtype)
    rows = torch.repeat_interleave(amax, m).unsqueeze(-1)
    assert_bits_equal(K.grouped_input_scaled_clip_grad(gy, x, m, amax, p),
                      scale_rows(gy, p) * (x.float().abs() <= rows))


class _ReferenceSTE(torch.autograd.Function):
    """``apply(x, q, mask) -> q`` with the straight-through gradient to ``x`` (times ``mask`` unless None)."""

    @staticmethod
    def forward(ctx, x, q, mask):
        ctx.mask = mask
        return q.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.mask is None else grad * ctx.mask), None, None


@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_scaled_input_autograd_matches_the_reference(ste):
    """The gradients of the tokens and of the scale equal autograd through ``scale_rows(fake_quant(x))`` with the
    same straight-through estimator, bit for bit."""
    g = torch.Generator(device=DEV).manual_seed(12)
    m = torch.tensor([100, 0, 28, 64], device=DEV)
    x0 = (torch.randn(192, 512, generator=g, device=DEV) * 3).to(torch.bfloat16)
    p0 = torch.rand(192, generator=g, device=DEV)
    amax = torch.tensor([2.0, 1.0, 5.0, 0.5], device=DEV)
    gy = torch.randn(x0.shape, generator=g, device=DEV).to(torch.bfloat16)
    x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    K.grouped_input_fake_quant_scaled_ste(x, m, amax, "e4m3", p, ste=ste).backward(gy)
    rows = torch.repeat_interleave(amax, m).unsqueeze(-1)
    q = torch.cat([fake_quant(c, "e4m3", amax[i]) for i, c in enumerate(x0.split(m.tolist()))])
    xr, pr = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    mask = (x0.float().abs() <= rows) if ste == "clipped" else None
    scale_rows(_ReferenceSTE.apply(xr, q, mask), pr).backward(gy)
    assert_bits_equal(x.grad, xr.grad)
    assert_bits_equal(p.grad, pr.grad)


def _graph_inputs():
    weights = make_experts([(512, 1024)] * 16, torch.bfloat16)
    amax = distinct_amax(weights)
    m = torch.tensor([100, 0, 28] + [0] * 13, device=DEV)
    x = torch.randn(128, 1024, device=DEV, dtype=torch.bfloat16)
    return weights, amax, m, x


@pytest.mark.parametrize("warmup", [True, False])
def test_cuda_graph_capture_and_replay(warmup):
    weights, amax, m, x = _graph_inputs()
    launch.clear_table_cache()

    def step():
        outs = K.grouped_weight_fake_quant(weights, amax, "nvfp4")
        y = K.grouped_input_fake_quant(x, m, amax, "e4m3")
        return outs, y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if warmup:
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs, y = step()
    # New values in the same storage, then replay.
    with torch.no_grad():
        for i, w in enumerate(weights):
            w.copy_(torch.randn_like(w) * (i + 1))
        x.copy_(torch.randn_like(x))
        amax.mul_(1.5)
    torch.cuda.synchronize()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, r) in enumerate(zip(outs, reference(weights, amax, "nvfp4", None), strict=True)):
            assert_bits_equal(o, r, f"replayed expert {i}")
        parts = x.split([100, 0, 28] + [0] * 13)
        assert_bits_equal(y, torch.cat([fake_quant(p, "e4m3", amax[i]) for i, p in enumerate(parts)]))


def test_torch_compile_fullgraph():
    weights, amax, m, x = _graph_inputs()

    def fn(amax, x, m, *ws):
        outs = K.grouped_weight_fake_quant(list(ws), amax, "e4m3")
        y = K.grouped_input_fake_quant(x, m, amax, "nvfp4")
        return [o * 2 for o in outs], y + 1

    got_w, got_y = torch.compile(fn, fullgraph=True)(amax, x, m, *weights)
    ref_w = [r * 2 for r in reference(weights, amax, "e4m3", None)]
    for o, r in zip(got_w, ref_w, strict=True):
        assert_bits_equal(o, r)
    parts = x.split([100, 0, 28] + [0] * 13)
    assert_bits_equal(got_y, torch.cat([fake_quant(p, "nvfp4", amax[i]) for i, p in enumerate(parts)]) + 1)


def test_torch_compile_fullgraph_autograd():
    weights, amax, m, x = _graph_inputs()
    weights = [w.requires_grad_() for w in weights]
    x.requires_grad_()

    def fn(amax, x, m, *ws):
        outs = K.grouped_weight_fake_quant_ste(list(ws), amax, "e4m3", ste="clipped")
        y = K.grouped_input_fake_quant_ste(x, m, amax, "e4m3", ste="clipped")
        return sum(o.float().sum() for o in outs) + y.float().sum()

    torch.compile(fn, fullgraph=True)(amax, x, m, *weights).backward()
    for w, a in zip(weights, amax, strict=True):
        assert_bits_equal(w.grad, (w.detach().float().abs() <= a).to(w.dtype))


@pytest.mark.parametrize("cached", [True, False])
def test_no_host_sync(cached):
    weights, amax, m, x = _graph_inputs()
    launch.clear_table_cache()
    if cached:
        K.grouped_weight_fake_quant(weights, amax, "e4m3")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = K.grouped_weight_fake_quant(weights, amax, "e4m3")
        grads = K.grouped_weight_clip_grad([torch.ones_like(w) for w in weights], weights, amax)
        y = K.grouped_input_fake_quant(x, m, amax, "nvfp4")
        gx = K.grouped_input_clip_grad(torch.ones_like(x), x, m, amax)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_bits_equal(outs[5], fake_quant(weights[5], "e4m3", amax[5]))
    assert grads[0].shape == weights[0].shape
    assert y.shape == gx.shape == x.shape


@pytest.mark.parametrize("narrow_range", [True, False])
@pytest.mark.parametrize(("fmt", "block_size"), [("int8", None), ("int4", None), ("int8", 16), ("int4", 128)])
def test_int_weights_and_inputs_bit_exact_in_both_ranges_and_padded_blocks(fmt, block_size, narrow_range):
    # amax below each expert's max (clipping on both sides, so -B-1 is reached); 96-wide experts: a block of 128
    # overhangs and is zero-padded, as formats.fake_quant (and Model Optimizer) pad.
    shapes = [(64, 96), (16, 96), (48, 96)] if block_size == 128 else SHAPES[3]
    weights = make_experts(shapes, torch.bfloat16, seed=5)
    amax = distinct_amax(weights, factor=0.6)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=narrow_range)
    for i, (w, o) in enumerate(zip(weights, outs, strict=True)):
        r = fake_quant(w, fmt, expert_amax(amax, i), block_size, narrow_range=narrow_range)
        assert_bits_equal(o, r, f"expert {i}")
        assert_bits_equal(o, fake_quant(w.cpu(), fmt, expert_amax(amax, i).cpu(), block_size,
                                        narrow_range=narrow_range), f"expert {i} vs CPU")
    m = torch.tensor([5, 0, 7], device=DEV)
    x = make_experts([(12, 96)], torch.bfloat16, seed=6)[0]
    y = K.grouped_input_fake_quant(x, m, amax, fmt, block_size, narrow_range=narrow_range)
    rows = torch.repeat_interleave(amax, m).unsqueeze(-1)
    assert_bits_equal(y, fake_quant(x, fmt, None if block_size else rows, block_size, narrow_range=narrow_range))


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("shape", [(4096, 1536), (3, 1000, 24)])
def test_output_gradient_fake_quant_is_the_reference(fmt, shape):
    """``backward.mode: quantized``'s per-tensor gradient fake quant on the kernels (amax, then fake quant) against
    the torch reference on the GPU and on the CPU, NaN, zeros and subnormals included."""
    from modelopt_moe.quantization.nn.functional import fake_quant_grad
    from modelopt_moe.quantization.tensor_quantizer import nan_ignoring_abs_max

    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 1e-4
    g.view(-1)[:5] = torch.tensor([0.0, -0.0, float("nan"), 1e-9, -2e-3], device="cuda", dtype=torch.bfloat16)
    out = fake_quant_grad(g, fmt, "auto")
    assert_bits_equal(out, fake_quant(g, fmt, nan_ignoring_abs_max(g)))
    assert_bits_equal(out.cpu(), fake_quant(g.cpu(), fmt, nan_ignoring_abs_max(g.cpu())))
