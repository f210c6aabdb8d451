"""Grouped (one launch for N experts) fake quant: bit-exact against formats.fake_quant applied per expert.

Runs the Triton kernels on CPU tensors in the Triton interpreter (conftest.py sets TRITON_INTERPRET=1); the same
checks run natively on CUDA in tests/gpu/test_kernels_gpu.py. "Bit-exact" means same dtype, NaN in the same
elements and identical bits (signed zeros included) everywhere else.
"""

import subprocess
import sys

import pytest
import torch

from modelopt_moe import kernels as K
from modelopt_moe.kernels import input_fake_quant, launch, weight_fake_quant
from modelopt_moe.numerics import fake_quant

needs_triton = pytest.mark.skipif(
    not K.kernels_available("cpu"), reason="Triton interpreter not active (needs triton and TRITON_INTERPRET=1)"
)

# (format, block_size): every format, with per-tensor and per-block int.
FORMATS = [("e4m3", None), ("e5m2", None), ("nvfp4", None), ("nvfp4_four_over_six", None), ("int8", None),
           ("int4", None), ("int8", 16), ("int4", 32), ("int7", None), ("int2", None), ("int3", 16), ("int5", None),
           ("int6", 32)]
AMAX_FORMATS = [f for f in FORMATS if f[1] is None]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, what
    an, en = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(an, en), f"{what}: NaN positions differ"
    a = torch.where(an, torch.zeros_like(actual), actual).contiguous().view(_INT_VIEW[actual.dtype])
    e = torch.where(en, torch.zeros_like(expected), expected).contiguous().view(_INT_VIEW[expected.dtype])
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}: "
        f"{actual[tuple(bad[0])].item()!r} vs {expected[tuple(bad[0])].item()!r}"
    )


def expert_amax(amax, i):
    if amax is None or amax.dim() == 0:
        return amax
    return amax[i] if amax.dim() == 1 else amax[i].unsqueeze(-1)


def reference(weights, amax, fmt, block_size):
    return [fake_quant(w, fmt, expert_amax(amax, i), block_size) for i, w in enumerate(weights)]


def make_experts(shapes, dtype, seed=0):
    """Expert i is scaled by 4**i (exact in every dtype) so that a wrong expert index cannot pass."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * 4.0**i).to(dtype) for i, s in enumerate(shapes)]


def distinct_amax(weights, factor=0.8):
    """Per-expert amax below each expert's max (so some values saturate), all different."""
    return torch.stack([w.float().abs().max() * (factor + 0.05 * i) for i, w in enumerate(weights)])


# ----------------------------------------------------------------------------------------------------------------
# Weights, forward
# ----------------------------------------------------------------------------------------------------------------
RAGGED = [(7, 64), (1, 64), (13, 32), (4, 64), (9, 96)]


@needs_triton
@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_weights_bit_exact_per_expert(fmt, block_size, dtype, n):
    weights = make_experts(RAGGED[:n], dtype, seed=n)
    amax = distinct_amax(weights)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt, block_size)
    assert len(outs) == n
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, fmt, block_size), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


INT_CASES = [("int8", None), ("int4", None), ("int8", 16), ("int4", 32)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("narrow_range", [True, False])
@pytest.mark.parametrize(("fmt", "block_size"), INT_CASES)
def test_int_weights_bit_exact_in_both_ranges(fmt, block_size, narrow_range, dtype):
    # amax at 0.6 of each expert's max: many elements clip, on both sides, so -B-1 and -B are both reached.
    weights = make_experts(RAGGED[:4], dtype, seed=7)
    amax = distinct_amax(weights, factor=0.6)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=narrow_range)
    for i, (w, o) in enumerate(zip(weights, outs, strict=True)):
        r = fake_quant(w, fmt, expert_amax(amax, i), block_size, narrow_range=narrow_range)
        assert_bits_equal(o, r, f"expert {i}")
    # The two ranges really differ somewhere (per tensor: the clipped negatives land on -B-1).
    if block_size is None:
        wide = K.grouped_weight_fake_quant(weights, amax, fmt, narrow_range=False)
        narrow = K.grouped_weight_fake_quant(weights, amax, fmt, narrow_range=True)
        assert any(not torch.equal(a, b) for a, b in zip(wide, narrow, strict=True))


@needs_triton
@pytest.mark.parametrize("narrow_range", [True, False])
@pytest.mark.parametrize(("shapes", "block"), [([(96, 64), (5, 64)], 128), ([(7, 40), (3, 40), (2, 40)], 32),
                                             ([(4, 16), (9, 24)], 16)])
def test_int_block_weights_pad_a_partial_last_block(shapes, block, narrow_range):
    # The shipped INT4 preset's blocks of 128 on the demo's 64-wide experts (Model Optimizer pads the same way).
    weights = make_experts(shapes, torch.bfloat16, seed=len(shapes))
    outs = K.grouped_weight_fake_quant(weights, None, "int4", block, narrow_range=narrow_range)
    for i, (w, o) in enumerate(zip(weights, outs, strict=True)):
        assert_bits_equal(o, fake_quant(w, "int4", None, block, narrow_range=narrow_range), f"expert {i}")


@needs_triton
def test_outputs_are_views_of_one_buffer():
    weights = make_experts(RAGGED, torch.bfloat16)
    outs = K.grouped_weight_fake_quant(weights, distinct_amax(weights), "e4m3")
    base = outs[0].untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() == base for o in outs)
    assert [o.shape for o in outs] == [w.shape for w in weights]
    assert all(o.is_contiguous() and o._base is not None for o in outs)
    assert outs[0].untyped_storage().nbytes() == sum(w.numel() for w in weights) * 2


@needs_triton
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_invalid_amax_entries_follow_the_reference(fmt, block_size, dtype):
    # 0, exactly 2**-24 (invalid), just above it (valid), NaN, Inf, negative, small valid, near fp32 max.
    amax = torch.tensor([0.0, 2.0**-24, 2.0**-24 * (1 + 2.0**-23), float("nan"), float("inf"), -1.0, 1e-3, 3.4e38])
    weights = make_experts([(3, 32)] * 8, dtype)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt, block_size)
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, fmt, block_size), strict=True)):
        assert_bits_equal(o, r, f"expert {i} amax {amax[i].item()}")
        assert not torch.isnan(o).any()
        assert torch.isfinite(o).all()


@needs_triton
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_nan_and_inf_stay_in_their_expert_element_and_block(fmt, block_size):
    clean = make_experts([(4, 64)] * 3, torch.bfloat16)
    amax = distinct_amax(clean)
    dirty = [w.clone() for w in clean]
    dirty[1][1, 5] = float("nan")
    dirty[1][2, 40] = float("inf")
    dirty[1][3, 17] = -float("inf")
    out_clean = K.grouped_weight_fake_quant(clean, amax, fmt, block_size)
    out_dirty = K.grouped_weight_fake_quant(dirty, amax, fmt, block_size)
    for i, (o, r) in enumerate(zip(out_dirty, reference(dirty, amax, fmt, block_size), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")
    assert_bits_equal(out_dirty[0], out_clean[0])
    assert_bits_equal(out_dirty[2], out_clean[2])
    nan = torch.isnan(out_dirty[1])
    assert nan.sum() == 1
    assert nan[1, 5]
    # Elsewhere only the Inf elements change, or (block formats) the blocks that hold them.
    block = 16 if fmt.startswith("nvfp4") else block_size
    changed = (out_dirty[1] != out_clean[1]) & ~nan
    allowed = torch.zeros_like(changed)
    for r, c in [(2, 40), (3, 17)]:
        if block is None:
            allowed[r, c] = True
        else:
            allowed[r, (c // block) * block : (c // block + 1) * block] = True
    assert not (changed & ~allowed).any()
    assert torch.isfinite(out_dirty[1][2, 40])
    assert out_dirty[1][2, 40] > 0
    assert out_dirty[1][3, 17] < 0


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4", "nvfp4_four_over_six", "int8", "int4"])
def test_per_channel_amax(fmt, dtype):
    # [N, C] amax over axis 0 of [C, K] experts; experts may differ in K. One NaN and one zero channel.
    weights = make_experts([(6, 32), (6, 64), (6, 16)], dtype)
    amax = torch.stack([w.float().abs().amax(dim=1) * 0.7 for w in weights])
    amax[1, 2] = float("nan")
    amax[2, 0] = 0.0
    outs = K.grouped_weight_fake_quant(weights, amax, fmt)
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, fmt, None), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@needs_triton
@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "nvfp4_four_over_six", "int4"])
def test_shared_scalar_amax_and_empty_expert(fmt):
    weights = make_experts([(5, 32), (0, 32), (3, 32)], torch.float16)
    amax = torch.tensor(3.5)
    outs = K.grouped_weight_fake_quant(weights, amax, fmt)
    assert outs[1].shape == (0, 32)
    for i, (o, r) in enumerate(zip(outs, reference(weights, amax, fmt, None), strict=True)):
        assert_bits_equal(o, r, f"expert {i}")


@needs_triton
def test_many_experts_binary_search():
    # 37 experts of 1..3 tiles each: every program must find its expert (distinct magnitudes and amax).
    shapes = [(1 + (i * 7) % 150, 32) for i in range(37)]
    g = torch.Generator().manual_seed(1)
    weights = [(torch.randn(s, generator=g) * (1.5**i)).to(torch.bfloat16) for i, s in enumerate(shapes)]
    amax = distinct_amax(weights, 0.5)
    for o, r in zip(K.grouped_weight_fake_quant(weights, amax, "e4m3"), reference(weights, amax, "e4m3", None),
                    strict=True):
        assert_bits_equal(o, r)


# ----------------------------------------------------------------------------------------------------------------
# Rounding edge values
# ----------------------------------------------------------------------------------------------------------------
def _fp8_grid(dtype):
    vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])


def _edge_values(grid: torch.Tensor, bound: float) -> torch.Tensor:
    """Every representable value, every midpoint (ties) and both fp32 neighbours of each midpoint, beyond the
    bound (saturation), and binade carries; both signs, and +-0."""
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    extra = torch.tensor([bound * 1.01, bound * 1.5, bound * 1e6, 3e38, float("inf"), 31.6, 15.7, 124.06, 247.9,
                          0.0087, 2.0**-12, 2.0**-20, 2.0**-126, 2.0**-149])
    v = torch.cat([grid, mids, up, down, extra])
    return torch.cat([v, -v, torch.tensor([0.0, -0.0])])


@needs_triton
@pytest.mark.parametrize(("fmt", "fp8"), [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("scale_kind", ["one", "binade_carry"])
def test_fp8_rounding_edges(fmt, fp8, scale_kind):
    bound = 448.0 if fmt == "e4m3" else 57344.0
    x = _edge_values(_fp8_grid(fp8), bound)
    x = torch.cat([x, torch.zeros((-x.numel()) % 16)]).reshape(-1, 16)
    # amax = bound: scale exactly 1, so x itself meets every tie; amax = bound / 1.0079 pushes values like
    # 124.06 * scale across a binade after scaling.
    amax = torch.tensor([bound if scale_kind == "one" else bound / 1.0079])
    out = K.grouped_weight_fake_quant([x], amax, fmt)[0]
    assert_bits_equal(out, fake_quant(x, fmt, amax[0]))
    if scale_kind == "one":  # independent check against torch's own fp8 cast
        expected = torch.clamp(x, -bound, bound).to(fp8).float()
        assert_bits_equal(out, expected)


@needs_triton
@pytest.mark.parametrize(("fmt", "bound"), [("int8", 127.0), ("int4", 7.0)])
def test_int_round_half_even_edges(fmt, bound):
    k = torch.arange(-bound - 4, bound + 5)
    x = torch.cat([k, k + 0.5, torch.nextafter(k + 0.5, k), torch.nextafter(k + 0.5, k + 1), k + 0.25,
                   torch.tensor([1e30, -1e30, float("inf"), -float("inf"), 0.0, -0.0, -0.3, 0.3])])
    x = torch.cat([x, torch.zeros((-x.numel()) % 16)]).reshape(-1, 16)
    out = K.grouped_weight_fake_quant([x], torch.tensor([bound]), fmt)[0]  # scale exactly 1
    assert_bits_equal(out, fake_quant(x, fmt, torch.tensor(bound)))
    assert_bits_equal(out, torch.clamp(torch.round(x), -bound, bound))


@needs_triton
def test_e2m1_rounding_edges():
    # amax = 2688 gives sg = 1; a 6.0 in each block gives block scale 1, so each value meets E2M1 rounding as is.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = []
    for t in ties:
        t = torch.tensor(t)
        vals += [t, torch.nextafter(t, torch.tensor(0.0)), torch.nextafter(t, torch.tensor(9.0))]
    vals = torch.stack(vals + [torch.tensor(v) for v in [0.0, 0.5, 6.0, 5.9, 5.5, 1e-30]])
    vals = torch.cat([vals, -vals, torch.tensor([-0.0])])
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 15)]).reshape(-1, 15)
    x = torch.cat([torch.full((vals.shape[0], 1), 6.0), vals], dim=1).contiguous()
    out = K.grouped_weight_fake_quant([x], torch.tensor([2688.0]), "nvfp4")[0]
    assert_bits_equal(out, fake_quant(x, "nvfp4", torch.tensor(2688.0)))
    from modelopt_moe.numerics import round_to_e2m1

    assert_bits_equal(out, round_to_e2m1(x))


def _all_finite_bf16() -> torch.Tensor:
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x)).reshape(256, 256).contiguous()


@needs_triton
@pytest.mark.parametrize(("fmt", "amax"), [("e4m3", 448.0), ("e4m3", 3.7), ("e4m3", 1e-30), ("e5m2", 5.1e3),
                                      ("nvfp4", 3.7), ("nvfp4_four_over_six", 3.7), ("int8", 0.3)])
def test_sweep_all_finite_bf16(fmt, amax):
    x = _all_finite_bf16()
    out = K.grouped_weight_fake_quant([x], torch.tensor([amax]), fmt)[0]
    assert_bits_equal(out, fake_quant(x, fmt, torch.tensor(amax)))


def _special_fp32_bits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(-(2**31), 2**31 - 1, (1 << 15,), generator=g, dtype=torch.int64).to(torch.int32)
    hi = torch.randint(0, 1 << 16, (4096,), generator=g, dtype=torch.int64)
    ties = ((hi << 16) | 0x8000).to(torch.int32)  # bf16 ties, both parities of the kept bit
    near = torch.cat([ties - 1, ties + 1])
    specials = torch.tensor([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF,
                             0x7F800000, 0x7FC00000, 0], dtype=torch.int64).to(torch.int32)
    bits = torch.cat([rand, ties, near, specials])
    f16 = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26,
                        2.0**-14, 2.0**-14 - 2.0**-25, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 6e-8])
    f16 = torch.cat([f16, torch.randn(4096, generator=g) * 2.0 ** torch.randint(-30, 20, (4096,), generator=g)])
    v = torch.cat([bits.view(torch.float32), f16])
    return torch.cat([v, -v])


if K.TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from modelopt_moe.kernels.tile_kernels import to_out_dtype

    @triton.jit
    def _convert_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, to_out_dtype(x, y_ptr.dtype.element_ty, True), mask=offs < n)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_clip_grad_passes_every_value_bit_exact(dtype):
    """Gradients go through fp32 and back unchanged: every bf16/fp16 bit pattern (subnormals, NaN, Inf)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    g = bits.view(dtype) if dtype != torch.float32 else bits.view(torch.bfloat16).float()
    g = g.reshape(256, 256).contiguous()
    out = K.grouped_weight_clip_grad([g], [torch.zeros_like(g)], torch.ones(1))[0]
    assert_bits_equal(out, g)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_to_output_dtype_rounding(dtype):
    """The RNE output conversion by arithmetic matches torch's .to() (ties, carries into Inf, subnormals, NaN)."""
    x = _special_fp32_bits()
    y = torch.empty(x.shape, dtype=dtype)
    _convert_kernel[(triton.cdiv(x.numel(), 1 << 14),)](x, y, x.numel(), BLOCK=1 << 14)
    assert_bits_equal(y, x.to(dtype))


# ----------------------------------------------------------------------------------------------------------------
# Weights, backward
# ----------------------------------------------------------------------------------------------------------------
def hand_clip(g, w, amax):
    a = amax.float()
    limit = torch.where(torch.isfinite(a) & (a > 2.0**-24), a, torch.full_like(a, float("inf")))
    return g * (w.float().abs() <= limit)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("per_channel", [False, True])
def test_weight_clipped_backward_matches_mask(dtype, per_channel):
    weights = make_experts([(6, 32), (6, 64), (6, 16)], dtype)
    weights[1][0, 0] = float("nan")
    if per_channel:
        amax = torch.stack([w.float().abs().amax(dim=1) * 0.6 for w in weights])
        amax[0, 1] = float("nan")  # invalid: that channel clips nothing
    else:
        amax = distinct_amax(weights, 0.6)
        amax[2] = 0.0
    grads = [torch.randn(w.shape).to(dtype) for w in weights]
    grads[0][0, 0] = float("nan")
    out = K.grouped_weight_clip_grad(grads, weights, amax)
    for i, (o, g, w) in enumerate(zip(out, grads, weights, strict=True)):
        a = expert_amax(amax, i)
        assert_bits_equal(o, hand_clip(g, w, a), f"expert {i}")
    assert (out[0] == 0).any()  # something is clipped


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_four_over_six"])
@pytest.mark.parametrize("ste", ["pass_through", "clipped"])
def test_weight_autograd(ste, fmt):
    weights = [w.requires_grad_() for w in make_experts([(4, 32), (2, 32), (3, 64)], torch.bfloat16)]
    amax = distinct_amax(weights, 0.5).detach()
    outs = K.grouped_weight_fake_quant_ste(weights, amax, fmt, ste=ste)
    for o, r in zip(outs, reference([w.detach() for w in weights], amax, fmt, None), strict=True):
        assert_bits_equal(o.detach(), r)
    grads = [torch.randn(w.shape).to(torch.bfloat16) for w in weights]
    torch.autograd.backward(outs[:2], grads[:2])  # expert 2 gets no gradient from the loss
    for i, w in enumerate(weights[:2]):
        expected = grads[i] if ste == "pass_through" else hand_clip(grads[i], w.detach(), amax[i])
        assert_bits_equal(w.grad, expected)
    if ste == "clipped":
        assert weights[2].grad is not None
        assert not weights[2].grad.any()


# ----------------------------------------------------------------------------------------------------------------
# Inputs: x [T, K] split by m_splits
# ----------------------------------------------------------------------------------------------------------------
M_SPLITS = [3, 0, 5, 0, 2, 6]


def make_tokens(m_splits, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(m, k, generator=g) * 4.0**i for i, m in enumerate(m_splits)]).to(dtype)


def input_reference(x, m_splits, amax, fmt, block_size):
    parts = x.split(m_splits)
    return torch.cat([fake_quant(p, fmt, amax if amax is None or amax.dim() == 0 else amax[i], block_size)
                      for i, p in enumerate(parts)])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("fmt", "block_size"), FORMATS)
def test_input_per_expert_bit_exact(fmt, block_size, dtype):
    x = make_tokens(M_SPLITS, 32, dtype)
    amax = torch.tensor([0.7, 5.0, 9.0, 0.0, 30.0, 200.0])  # expert 3 has no rows, expert 2's amax is large
    amax[0] = float("nan") if fmt == "e5m2" else amax[0]
    m = torch.tensor(M_SPLITS, dtype=torch.int32)
    y = K.grouped_input_fake_quant(x, m, amax, fmt, block_size)
    assert_bits_equal(y, input_reference(x, M_SPLITS, amax, fmt, block_size))


@needs_triton
@pytest.mark.parametrize("narrow_range", [True, False])
@pytest.mark.parametrize(("fmt", "block_size", "k"), [("int8", None, 32), ("int4", None, 32), ("int4", 128, 48),
                                                    ("int8", 16, 40)])
def test_int_input_bit_exact_in_both_ranges_and_padded_blocks(fmt, block_size, k, narrow_range):
    x = make_tokens(M_SPLITS, k, torch.bfloat16, seed=k)
    amax = torch.tensor([0.7, 5.0, 9.0, 0.0, 30.0, 200.0]) * 0.6
    m = torch.tensor(M_SPLITS, dtype=torch.int32)
    y = K.grouped_input_fake_quant(x, m, amax, fmt, block_size, narrow_range=narrow_range)
    parts = x.split(M_SPLITS)
    ref = torch.cat([fake_quant(p, fmt, None if block_size else amax[i], block_size, narrow_range=narrow_range)
                     for i, p in enumerate(parts)])
    assert_bits_equal(y, ref)


@needs_triton
@pytest.mark.parametrize("fmt", ["e4m3", "nvfp4", "nvfp4_four_over_six", "int8"])
def test_input_shared_amax_and_single_expert(fmt):
    x = make_tokens([5, 4], 48, torch.float16)
    amax = torch.tensor(6.0)
    y = K.grouped_input_fake_quant(x, torch.tensor([5, 4]), amax, fmt)
    assert_bits_equal(y, fake_quant(x, fmt, amax))
    y1 = K.grouped_input_fake_quant(x, torch.tensor([9]), torch.tensor([6.0]), fmt)
    assert_bits_equal(y1, fake_quant(x, fmt, amax))


@needs_triton
@pytest.mark.parametrize("shared", [False, True])
def test_input_clipped_backward_and_autograd(shared):
    x = make_tokens(M_SPLITS, 32, torch.bfloat16).requires_grad_()
    m = torch.tensor(M_SPLITS)
    amax = torch.tensor(2.0) if shared else torch.tensor([0.7, 5.0, 9.0, 0.0, float("inf"), 200.0])
    g = torch.randn(x.shape).to(torch.bfloat16)
    rows_amax = amax if shared else torch.repeat_interleave(amax, m).unsqueeze(-1)
    expected = hand_clip(g, x.detach(), rows_amax)
    assert_bits_equal(K.grouped_input_clip_grad(g, x.detach(), m, amax), expected)
    y = K.grouped_input_fake_quant_ste(x, m, amax, "e4m3", ste="clipped")
    y.backward(g)
    assert_bits_equal(x.grad, expected)
    x.grad = None
    K.grouped_input_fake_quant_ste(x, m, amax, "e4m3", ste="pass_through").backward(g)
    assert_bits_equal(x.grad, g)


# ----------------------------------------------------------------------------------------------------------------
# Validation, fallback, tracing, caching
# ----------------------------------------------------------------------------------------------------------------
def _w(*shape, dtype=torch.bfloat16):
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: K.grouped_weight_fake_quant([], torch.ones(0), "e4m3"), "empty"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)] * 513, torch.ones(513), "e4m3"), "at most 512"),
        (lambda: K.grouped_weight_fake_quant(_w(2, 16), torch.ones(2), "e4m3"), "list"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16), _w(2, 16, dtype=torch.float32)], torch.ones(2), "e4m3"),
         "dtype"),
        (lambda: K.grouped_weight_fake_quant([torch.ones(2, 16, dtype=torch.int32)], torch.ones(1), "e4m3"), "dtype"),
        (lambda: K.grouped_weight_fake_quant([_w(16, 2).t()], torch.ones(1), "e4m3"), "contiguous"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)] * 2, torch.ones(3), "e4m3"), "does not match 2 experts"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)] * 2, torch.ones(2, 3), "e4m3"), "per-channel"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)] * 2, torch.ones(2, 2, 1), "e4m3"), "scalar, \\[N\\]"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)], torch.ones(1, dtype=torch.int32), "e4m3"), "floating"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 24)], torch.ones(1), "nvfp4"), "multiple of the block size 16"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 24)], None, "int4", 12), "power of two"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)], torch.ones(1), "e4m3", (2, 2, 2)), "blocks of the last dim"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)], torch.ones(1), "nvfp4", 32), "blocks of 16"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)], torch.ones(1), "fp6"), "unknown format"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)], None, "e4m3"), "needs an amax"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16), _w(2, 16, dtype=torch.float32)], None, "int4", 16),
         "dtype"),
        (lambda: K.grouped_weight_clip_grad([_w(2, 16)], [_w(2, 16)] * 2, torch.ones(2)), "1 gradients for 2"),
        (lambda: K.grouped_weight_clip_grad([_w(3, 16)], [_w(2, 16)], torch.ones(1)), "shape"),
        (lambda: K.grouped_input_fake_quant(_w(2, 3, 16), torch.tensor([2]), torch.ones(1), "e4m3"), "2-D"),
        (lambda: K.grouped_input_fake_quant(_w(4, 16), torch.tensor([2.0, 2.0]), torch.ones(2), "e4m3"), "integer"),
        (lambda: K.grouped_input_fake_quant(_w(4, 16), torch.tensor([2, 2]), torch.ones(3), "e4m3"), "per expert"),
        (lambda: K.grouped_input_fake_quant(_w(4, 16), torch.ones(513, dtype=torch.int64), torch.ones(513), "e4m3"),
         "1..512"),
        (lambda: K.grouped_input_fake_quant(_w(4, 24), torch.tensor([4]), torch.ones(1), "nvfp4"), "multiple"),
        (lambda: K.grouped_input_fake_quant(_w(4, 24), torch.tensor([4]), torch.ones(1), "nvfp4_four_over_six"),
         "multiple of the block size 16"),
        (lambda: K.grouped_weight_fake_quant([_w(2, 16)], torch.ones(1), "nvfp4_four_over_six", 32), "blocks of 16"),
        (lambda: K.grouped_input_fake_quant(_w(16, 4).t(), torch.tensor([4]), torch.ones(1), "e4m3"), "contiguous"),
        (lambda: K.grouped_input_clip_grad(_w(3, 16), _w(4, 16), torch.tensor([4]), torch.ones(1)), "shaped like x"),
        (lambda: K.grouped_weight_fake_quant_ste([_w(2, 16)], torch.ones(1), "e4m3", ste="clip"), "ste"),
    ],
)
def test_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_torch_fallback_is_bit_exact(monkeypatch):
    """The pure-torch path (no triton, or CPU without the interpreter) gives the same bits as the reference."""
    monkeypatch.setattr(weight_fake_quant, "kernels_available", lambda device: False)
    monkeypatch.setattr(input_fake_quant, "kernels_available", lambda device: False)
    weights = make_experts(RAGGED[:3], torch.bfloat16)
    for fmt, bs in FORMATS:
        amax = distinct_amax(weights)
        for o, r in zip(K.grouped_weight_fake_quant(weights, amax, fmt, bs), reference(weights, amax, fmt, bs),
                        strict=True):
            assert_bits_equal(o, r, fmt)
        x = make_tokens(M_SPLITS, 32, torch.float32)
        amax_in = torch.tensor([0.7, 5.0, 9.0, 0.0, 30.0, 200.0])
        y = K.grouped_input_fake_quant(x, torch.tensor(M_SPLITS), amax_in, fmt, bs)
        assert_bits_equal(y, input_reference(x, M_SPLITS, amax_in, fmt, bs), fmt)
    grads = [torch.randn(w.shape).to(torch.bfloat16) for w in weights]
    for o, g, w, a in zip(K.grouped_weight_clip_grad(grads, weights, amax), grads, weights, amax, strict=True):
        assert_bits_equal(o, hand_clip(g, w, a))


def test_kernels_available():
    assert not K.kernels_available("meta")
    assert K.kernels_available("cpu") == (K.TRITON_AVAILABLE and launch._interpret_mode())


@pytest.mark.slow  # a fresh interpreter (or spawned ranks)
def test_imports_and_falls_back_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['megatron'] = None  # torch alone\n"
        "import torch\n"
        "import modelopt_moe.kernels as k\n"
        "assert not k.TRITON_AVAILABLE and not k.kernels_available('cpu')\n"
        "w = [torch.randn(4, 16)]\n"
        "from modelopt_moe.numerics import fake_quant\n"
        "assert torch.equal(k.grouped_weight_fake_quant(w, torch.ones(1), 'e4m3')[0], fake_quant(w[0], 'e4m3', "
        "torch.tensor(1.0)))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]


@needs_triton
def test_torch_compile_fullgraph_traces_the_ops():
    weights = make_experts([(4, 32), (2, 32)], torch.float32)
    amax = distinct_amax(weights)
    x = make_tokens([3, 1], 32, torch.float32)
    m = torch.tensor([3, 1])

    def fn(w0, w1, amax, x, m):
        a, b = K.grouped_weight_fake_quant([w0, w1], amax, "e4m3")
        return a, b, K.grouped_input_fake_quant(x, m, amax, "int8")

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*weights, amax, x, m)
    ref = reference(weights, amax, "e4m3", None) + [input_reference(x, [3, 1], amax, "int8", None)]
    for o, r in zip(got, ref, strict=True):
        assert_bits_equal(o, r)


@needs_triton
def test_pointer_table_cache_is_keyed_on_pointers():
    launch.clear_table_cache()
    weights = make_experts([(4, 32), (2, 32)], torch.bfloat16)
    amax = distinct_amax(weights)
    K.grouped_weight_fake_quant(weights, amax, "e4m3")
    K.grouped_weight_fake_quant(weights, amax, "e4m3")
    assert len(launch._plan_cache) == 1
    with torch.no_grad():
        weights[0].mul_(0.5)  # in place: same pointers, new values
    assert_bits_equal(K.grouped_weight_fake_quant(weights, amax, "e4m3")[0], fake_quant(weights[0], "e4m3", amax[0]))
    moved = [weights[0], weights[1].clone()]
    assert_bits_equal(K.grouped_weight_fake_quant(moved, amax, "e4m3")[1], fake_quant(moved[1], "e4m3", amax[1]))
    assert len(launch._plan_cache) == 2


def test_checked_lists_are_rechecked_when_a_tensor_changes_behind_the_same_objects():
    """The per-expert checks run once per signature (addresses, shapes, contiguity, dtypes, devices); a parameter whose
    ``.data`` is swapped (as Megatron's DDP and ``Float16Module`` do) is checked again, and the result follows it."""
    launch.clear_table_cache()
    weights = [torch.nn.Parameter(w) for w in make_experts([(4, 32), (4, 32)], torch.float32)]
    amax = distinct_amax(weights).detach()
    with torch.no_grad():
        for _ in range(2):
            out = K.grouped_weight_fake_quant(weights, amax, "e4m3")
        assert len(launch._checked) == 1
        # Same address, transposed: not contiguous any more.
        original = weights[0].data
        weights[0].data = original.t()
        with pytest.raises(ValueError, match="expert 0 .* is not contiguous"):
            K.grouped_weight_fake_quant(weights, amax, "e4m3")
        # Same address, another dtype.
        weights[0].data = original.view(torch.bfloat16)
        with pytest.raises(ValueError, match="expert 1 has dtype torch.float32 but expert 0 has torch.bfloat16"):
            K.grouped_weight_fake_quant(weights, amax, "e4m3")
        # New storage with new values: checked, and quantized from the new values.
        weights[0].data = torch.randn(4, 32) * 3
        out = K.grouped_weight_fake_quant(weights, amax, "e4m3")
        assert_bits_equal(out[0], fake_quant(weights[0].data, "e4m3", amax[0]))
        # A format with stricter shapes is checked on its own: e4m3 accepted [4, 24], nvfp4 needs a multiple of 16.
        odd = make_experts([(4, 24), (4, 24)], torch.float32)
        K.grouped_weight_fake_quant(odd, distinct_amax(odd), "e4m3")
        with pytest.raises(ValueError, match="multiple of the block size 16"):
            K.grouped_weight_fake_quant(odd, distinct_amax(odd), "nvfp4")


def test_a_square_expert_transposed_in_place_is_not_taken_for_the_checked_one():
    """Same address, same shape, same dtype, other strides: the signature tells them apart, so the list is checked
    again (and refused) instead of reusing the checks and table of the contiguous one."""
    launch.clear_table_cache()
    weights = [torch.nn.Parameter(w) for w in make_experts([(16, 16), (16, 16)], torch.float32)]
    amax = distinct_amax(weights).detach()
    with torch.no_grad():
        K.grouped_weight_fake_quant(weights, amax, "e4m3")
        original = weights[1].data
        weights[1].data = original.t()
        assert weights[1].data_ptr() == original.data_ptr()
        assert weights[1].shape == original.shape
        with pytest.raises(ValueError, match="expert 1 .* is not contiguous"):
            K.grouped_weight_fake_quant(weights, amax, "e4m3")


def test_equal_signatures_are_one_object_and_changed_ones_are_not():
    weights = make_experts([(4, 32), (4, 32)], torch.float32)
    first = launch.signature(weights)
    assert launch.signature(list(weights)) is first
    assert launch.signature([weights[0], weights[1].clone()]) is not first
    assert launch.signature([weights[0], weights[1].view(8, 16)]) != first


@pytest.mark.parametrize("shapes", [[(4, 32)] * 3, [(4, 32), (2, 32), (4, 16)]], ids=["uniform", "ragged"])
def test_output_views_have_each_experts_shape_and_follow_the_buffer(shapes):
    weights = make_experts(shapes, torch.float32)
    out = K.grouped_weight_fake_quant(weights, distinct_amax(weights), "e4m3")
    assert [tuple(o.shape) for o in out] == shapes
    offsets = [o.storage_offset() for o in out]
    assert offsets == [sum(torch.Size(s).numel() for s in shapes[:i]) for i in range(len(shapes))]
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1


def test_fake_tensors_outside_compile_are_checked_and_give_fake_outputs():
    """Under a FakeTensorMode without torch.compile (shape propagation, memory estimates) there are no addresses to
    read: the checks run every call and the op's fake implementation gives the shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        weights = [torch.empty(4, 32), torch.empty(2, 32)]
        out = K.grouped_weight_fake_quant(weights, torch.ones(2), "e4m3")
        assert [tuple(o.shape) for o in out] == [(4, 32), (2, 32)]
        with pytest.raises(ValueError, match="expert 1 .* not contiguous"):
            K.grouped_weight_fake_quant([weights[0], torch.empty(32, 2).t()], torch.ones(2), "e4m3")
        # Every grouped op: the fake implementation answers (eager calls bypass the op only with real tensors).
        x, m, amax = torch.empty(6, 32), torch.tensor([4, 2]), torch.ones(2)
        assert K.grouped_input_fake_quant(x, m, amax, "e4m3").shape == (6, 32)
        assert K.grouped_input_clip_grad(torch.empty(6, 32), x, m, amax).shape == (6, 32)
        assert K.grouped_weight_amax(weights).shape == (2,)
        assert [tuple(g.shape) for g in K.grouped_weight_clip_grad(weights, weights, amax)] == [(4, 32), (2, 32)]
        (a, b), sums = K.grouped_weight_fake_quant_stats(weights, amax, "e4m3")
        assert (tuple(a.shape), tuple(b.shape), tuple(sums.shape)) == ((4, 32), (2, 32), (2, 4))
        y, sums = K.grouped_input_fake_quant_stats(x, m, amax, "e4m3")
        assert (tuple(y.shape), tuple(sums.shape)) == ((6, 32), (2, 4))


@needs_triton
@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize(("shape", "dtype"), [((2, 9, 33), torch.bfloat16), ((40, 24), torch.float32), ((17,),
                                                                                                          torch.float16)])
def test_output_gradient_fake_quant_on_the_kernels_is_the_reference(fmt, shape, dtype):
    """``backward.mode: quantized``'s gradient fake quant (one amax launch, one fake-quant launch) against
    ``fake_quant(g, fmt, max|g|)`` with NaN ignored: bit for bit, edge values included."""
    from modelopt_moe.quantization.nn.functional import fake_quant_grad
    from modelopt_moe.quantization.tensor_quantizer import nan_ignoring_abs_max

    torch.manual_seed(3)
    g = (torch.randn(shape) * 1e-3).to(dtype)
    flat = g.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, float("nan"), 1e-7, -3e-3, 5e-3], dtype=dtype)
    expected = fake_quant(g, fmt, nan_ignoring_abs_max(g))
    assert_bits_equal(fake_quant_grad(g, fmt, "triton"), expected, f"{fmt} {shape} {dtype}")
    assert_bits_equal(fake_quant_grad(g, fmt, "torch"), expected, "torch path")
    amax = nan_ignoring_abs_max(g)  # a caller that has the max already
    assert_bits_equal(fake_quant_grad(g, fmt, "triton", amax=amax), expected, "given amax")
    assert_bits_equal(fake_quant_grad(g, fmt, "torch", amax=amax), expected, "given amax, torch path")
    g_inf = g.clone()
    g_inf.view(-1)[7] = float("inf")  # an Inf amax is invalid: scale 1, Inf saturates
    assert_bits_equal(fake_quant_grad(g_inf, fmt, "triton"), fake_quant(g_inf, fmt, nan_ignoring_abs_max(g_inf)),
                      "inf")
