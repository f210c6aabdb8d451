"""The numeric contract (modelopt_moe/numerics/formats.py): bit-exact fake quantization in every format.

Expected values are computed either by hand (literal numbers) or by an independent computation written here (the
formulas of docs/architecture.md, "The numeric contract", or a nearest-grid-point search for E2M1), never by the
function under test.
"""

import pytest
import torch

from modelopt_moe.numerics import fake_quant, format_from_num_bits, formats, round_to_e2m1

F32 = torch.float32


def _t(values, dtype=F32):
    return torch.tensor(values, dtype=dtype)


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape, NaN positions, and bit patterns everywhere else (so also the signs of zeros)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"NaN at {nan_a.nonzero().tolist()[:8]}, expected {nan_e.nonzero().tolist()[:8]}"
    bits_a = actual.masked_fill(nan_a, 0).view(_INT_VIEW[actual.dtype])
    bits_e = expected.masked_fill(nan_e, 0).view(_INT_VIEW[expected.dtype])
    bad = (bits_a != bits_e).nonzero()
    if len(bad):
        idx = tuple(bad[0].tolist())
        raise AssertionError(f"{len(bad)} of {actual.numel()} elements differ; first at {idx}: got "
                             f"{actual[idx].item()!r}, expected {expected[idx].item()!r}")


def _all_finite_bf16() -> torch.Tensor:
    """Every finite bf16 value (all 65536 bit patterns minus NaN and +-Inf)."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    assert x.numel() == 65536 - 2 * 127 - 2  # 2 * 127 NaN mantissas, +Inf, -Inf
    return x


def _fp8_independent(x: torch.Tensor, amax: torch.Tensor, bound: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The contract: scale = bound / amax; q = fp8(clamp(x * scale, -bound, bound)); out = q / scale (fp32 math)."""
    scale = torch.tensor(bound, dtype=F32) / amax.to(F32)
    q = torch.clamp(x.to(F32) * scale, min=-bound, max=bound).to(fp8_dtype).to(F32)
    return (q / scale).to(x.dtype)


def _int_independent(x: torch.Tensor, amax: torch.Tensor, bits: int) -> torch.Tensor:
    bound = float(2 ** (bits - 1) - 1)
    scale = torch.tensor(bound, dtype=F32) / amax.to(F32)
    return (torch.clamp(torch.round(x.to(F32) * scale), -bound, bound) / scale).to(x.dtype)


_E2M1_GRID = _t([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_nearest_grid_point(v: torch.Tensor) -> torch.Tensor:
    """E2M1 rounding by searching the grid: nearest point, a tie goes to the even grid index (even mantissa)."""
    a = v.abs().clamp(max=6.0)
    dist = (a.unsqueeze(-1) - _E2M1_GRID).abs()
    cand = dist == dist.min(dim=-1, keepdim=True).values
    even = (torch.arange(8) % 2 == 0) & cand
    idx = torch.where(cand.sum(-1) > 1, even.to(torch.int8).argmax(-1), cand.to(torch.int8).argmax(-1))
    return torch.copysign(_E2M1_GRID[idx], v)


# --------------------------------------------------------------------------------------------------------------
# FP8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e4m3_matches_torch_float8_on_every_finite_bf16(dtype):
    x = _all_finite_bf16().to(dtype)
    out = fake_quant(x, "e4m3", _t(448.0))
    expected = torch.clamp(x.to(F32), -448.0, 448.0).to(torch.float8_e4m3fn).to(F32).to(dtype)
    assert_bits_equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_e5m2_matches_torch_float8_on_every_finite_bf16(dtype):
    x = _all_finite_bf16().to(dtype)
    out = fake_quant(x, "e5m2", _t(57344.0))
    expected = torch.clamp(x.to(F32), -57344.0, 57344.0).to(torch.float8_e5m2).to(F32).to(dtype)
    assert_bits_equal(out, expected)


@pytest.mark.parametrize("amax", [1.0, 3.5, 0.0123, 777.7, 2.0**-20, 1e30])
@pytest.mark.parametrize(("fmt", "bound", "fp8_dtype"),
                         [("e4m3", 448.0, torch.float8_e4m3fn), ("e5m2", 57344.0, torch.float8_e5m2)])
def test_fp8_with_any_amax_matches_scale_clamp_cast_unscale_on_every_finite_bf16(fmt, bound, fp8_dtype, amax):
    x = _all_finite_bf16()
    a = _t(amax)
    assert_bits_equal(fake_quant(x, fmt, a), _fp8_independent(x, a, bound, fp8_dtype))
    xf = x.float()
    assert_bits_equal(fake_quant(xf, fmt, a), _fp8_independent(xf, a, bound, fp8_dtype))


def test_fp8_scale_448_over_3_5_is_exact_hand_values():
    # amax 3.5 -> scale 128: 1.0 -> 128 exactly; 0.0171875 * 128 = 2.2 -> e4m3 2.25 -> 0.017578125;
    # 10 -> 1280 -> clamp 448 -> 3.5; 0.0078125 * 128 = 1 exactly; 1.03 * 128 = 131.84 -> e4m3 128 -> 1.0.
    x = _t([1.0, 0.0171875, 10.0, -10.0, 0.0078125, 1.03, -0.0])
    out = fake_quant(x, "e4m3", _t(3.5))
    assert_bits_equal(out, _t([1.0, 0.017578125, 3.5, -3.5, 0.0078125, 1.0, -0.0]))


def test_fp8_per_channel_amax_scales_each_row_by_its_own_amax():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 40, generator=g) * torch.logspace(-3, 3, 6).unsqueeze(1)
    amax = x.abs().amax(dim=1, keepdim=True) * 0.7  # clips the largest values of each row
    out = fake_quant(x, "e4m3", amax)
    for c in range(6):
        assert_bits_equal(out[c], _fp8_independent(x[c], amax[c, 0], 448.0, torch.float8_e4m3fn))


# --------------------------------------------------------------------------------------------------------------
# NVFP4


def _one_block(values, fill=0.0):
    row = list(values) + [fill] * (16 - len(values))
    return _t(row)


def test_nvfp4_ties_round_to_even():
    # amax 2688 -> global scale 1; 6 in the block -> block scale e4m3(6/6) = 1, so values round as they are.
    x = _one_block([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    out = fake_quant(x, "nvfp4", _t(2688.0))
    expected = _one_block([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0])
    assert_bits_equal(out, expected)


def test_round_to_e2m1_ties_non_ties_saturation_and_nan():
    v = _t([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2500001, 0.74, 1.26, 2.49, 2.51, 3.49, 5.01, 6.0, 6.5,
            1e30, float("inf"), -0.25, -5.0, -7.0, float("-inf"), float("nan")])
    expected = _t([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 1.5, 2.0, 3.0, 3.0, 6.0, 6.0, 6.0,
                   6.0, 6.0, -0.0, -4.0, -6.0, -6.0, float("nan")])
    assert_bits_equal(round_to_e2m1(v), expected)


def test_round_to_e2m1_matches_nearest_grid_point_search_on_random_and_tie_values():
    g = torch.Generator().manual_seed(3)
    ties = _t([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v = torch.cat([torch.randn(20000, generator=g) * 3, torch.rand(5000, generator=g) * 8, ties, -ties])
    assert_bits_equal(round_to_e2m1(v), _e2m1_nearest_grid_point(v))


def test_nvfp4_saturates_values_above_six_times_block_scale():
    # blockmax 6.375: 6.375 / 6 = 1.0625 is an E4M3 tie between 1.0 and 1.125 -> 1.0 (even); so 6.375 -> 6.
    x = _one_block([6.375, -6.375, 6.2, 1.0])
    out = fake_quant(x, "nvfp4", _t(2688.0))
    assert_bits_equal(out, _one_block([6.0, -6.0, 6.0, 1.0]))


def test_nvfp4_block_scale_of_hand_worked_blocks():
    # Block 0: blockmax 7.125 -> 7.125 / 6 = 1.1875, an E4M3 tie between 1.125 and 1.25 -> 1.25 (even mantissa).
    #   7.125 / 1.25 = 5.7 -> 6 -> 7.5;  1 / 1.25 = 0.8 -> 1 -> 1.25;  0.3125 / 1.25 = 0.25 -> 0 (tie);
    #   -2 / 1.25 = -1.6 -> -1.5 -> -1.875;  3.1 / 1.25 = 2.48 -> 2 -> 2.5;  0.9375 / 1.25 = 0.75 -> 1 -> 1.25.
    # Block 1: blockmax 3 with global amax 1344 -> sg = 0.5 -> sb = e4m3(3 / 6 / 0.5) = 1 -> s = 0.5.
    #   3 -> 6 -> 3;  1.1 / 0.5 = 2.2 -> 2 -> 1;  0.375 / 0.5 = 0.75 -> 1 -> 0.5;  -0.125 -> -0.25 -> -0.
    # Both blocks are quantized in one call with amax 2688 for block 0 and 1344 for block 1 (per-row amax).
    x = torch.stack([_one_block([7.125, 1.0, 0.3125, -2.0, 3.1, 0.9375]),
                     _one_block([3.0, 1.1, 0.375, -0.125])])
    out = fake_quant(x, "nvfp4", _t([[2688.0], [1344.0]]))
    expected = torch.stack([_one_block([7.5, 1.25, 0.0, -1.875, 2.5, 1.25]),
                            _one_block([3.0, 1.0, 0.5, -0.0])])
    assert_bits_equal(out, expected)


def test_nvfp4_subnormal_and_underflowing_block_scales():
    # Block 0: blockmax 6 * 3.3 * 2**-9 -> sb = e4m3(3.3 * 2**-9) = 3 * 2**-9 (subnormal);
    #   the max element / sb = 6.6 -> 6 -> 18 * 2**-9; 2**-9 / (3 * 2**-9) = 1/3 -> 0.5 -> 1.5 * 2**-9.
    # Block 1: blockmax 1e-4: 1e-4 / 6 < 2**-10 -> sb = 0 -> every element becomes x * 0 (signed zero).
    x = torch.cat([_one_block([6 * 3.3 * 2.0**-9, 2.0**-9]), _one_block([1e-4, -5e-5])])
    out = fake_quant(x, "nvfp4", _t(2688.0))
    expected = torch.cat([_one_block([18 * 2.0**-9, 1.5 * 2.0**-9]), _one_block([0.0, -0.0])])
    assert_bits_equal(out, expected)


def test_nvfp4_grid_values_times_distinct_block_scales_round_trip_exactly_per_block():
    # Each block b is (E2M1 grid values) * s_b with the max element exactly 6 * s_b and s_b an E4M3 value, so
    # the block scale is exactly s_b (2**-6 .. 448) and the output equals the clean input; a wrong block index
    # cannot pass.
    g = torch.Generator().manual_seed(5)
    n_rows, n_blocks = 3, 5
    scales = torch.tensor([2.0**e * m for e, m in zip(range(-6, 9), [1.0, 1.125, 1.25, 1.5, 1.75] * 3, strict=True)])
    scales = scales[torch.randperm(len(scales), generator=g)][: n_rows * n_blocks].reshape(n_rows, n_blocks, 1)
    grid_idx = torch.randint(0, 8, (n_rows, n_blocks, 16), generator=g)
    signs = torch.where(torch.rand(n_rows, n_blocks, 16, generator=g) < 0.5, -1.0, 1.0)
    grid = _E2M1_GRID[grid_idx] * signs
    grid[..., 0] = 6.0
    clean = (grid * scales).flatten(-2)
    # 5% relative noise keeps every element nearest to its own grid point; the block max stays exact.
    noise = 1 + 0.05 * (2 * torch.rand(n_rows, n_blocks, 16, generator=g) - 1)
    noise[..., 0] = 1.0
    noisy = (grid * noise * scales).flatten(-2)
    amax = _t(2688.0)  # sg = 1
    assert_bits_equal(fake_quant(clean, "nvfp4", amax), clean)
    assert_bits_equal(fake_quant(noisy, "nvfp4", amax), clean)


def test_nvfp4_random_blocks_match_independent_reference():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 64, generator=g) * torch.logspace(-2, 2, 4).unsqueeze(1)
    amax = _t(float(x.abs().max()) * 0.9)
    sg = amax / 2688.0
    blocks = x.unflatten(-1, (-1, 16))
    bmax = blocks.abs().amax(-1, keepdim=True)
    sb = torch.clamp(bmax / 6.0 / sg, 0.0, 448.0).to(torch.float8_e4m3fn).to(F32)
    s = sb * sg
    expected = (_e2m1_nearest_grid_point(blocks / s) * s).flatten(-2)
    assert_bits_equal(fake_quant(x, "nvfp4", amax), expected)


# --------------------------------------------------------------------------------------------------------------
# INT8 / INT4


def test_int8_rounds_half_to_even_at_scale_one():
    x = _t([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 0.49, 0.51, 126.5, 125.5])
    out = fake_quant(x, "int8", _t(127.0))
    assert_bits_equal(out, _t([0.0, 2.0, 2.0, 4.0, -0.0, -2.0, -2.0, 0.0, 1.0, 126.0, 126.0]))


def test_int4_rounds_half_to_even_at_scale_one():
    x = _t([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, -2.5, -6.5])
    out = fake_quant(x, "int4", _t(7.0))
    assert_bits_equal(out, _t([0.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -2.0, -6.0]))


INT_BOUNDS = [("int8", 127.0), ("int4", 7.0), ("int2", 1.0), ("int3", 3.0), ("int5", 15.0), ("int6", 31.0),
              ("int7", 63.0)]


@pytest.mark.parametrize(("fmt", "bound"), INT_BOUNDS)
def test_int_clamps_symmetrically_to_the_bound(fmt, bound):
    x = _t([bound + 0.4, bound + 0.6, 1000.0, -(bound + 1.0), -1000.0, -(bound + 0.5)])
    out = fake_quant(x, fmt, _t(bound))
    assert_bits_equal(out, _t([bound, bound, bound, -bound, -bound, -bound]))


@pytest.mark.parametrize(("fmt", "bound"), INT_BOUNDS)
def test_int_wide_range_clamps_negatives_to_minus_bound_minus_one(fmt, bound):
    # narrow_range=False (Model Optimizer's default): two's complement levels [-B-1, B]; the scale stays B / amax.
    x = _t([bound + 0.4, 1000.0, -(bound + 0.4), -(bound + 0.6), -(bound + 1.0), -1000.0, -(bound + 0.5)])
    out = fake_quant(x, fmt, _t(bound), narrow_range=False)
    assert_bits_equal(out, _t([bound, bound, -bound, -(bound + 1), -(bound + 1), -(bound + 1), -(bound + 1)]))
    # Nothing else moves: inside [-B, B] both ranges give the same bits.
    g = torch.Generator().manual_seed(3)
    inner = (torch.rand(4096, generator=g) * 2 - 1) * bound
    assert_bits_equal(fake_quant(inner, fmt, _t(bound), narrow_range=False), fake_quant(inner, fmt, _t(bound)))


@pytest.mark.parametrize(("fmt", "top"), [("int8", 255.0), ("int4", 15.0), ("int7", 127.0), ("int2", 3.0)])
def test_int_unsigned_uses_levels_zero_to_two_to_the_bits_minus_one(fmt, top):
    x = _t([0.4, 0.6, 2.5, top + 0.4, 1000.0, -0.6, -1000.0])
    out = fake_quant(x, fmt, _t(top), unsigned=True)
    assert_bits_equal(out, _t([0.0, 1.0, 2.0, top, top, 0.0, 0.0]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "nvfp4"])
def test_narrow_range_and_unsigned_are_int_only(fmt):
    with pytest.raises(ValueError, match="int formats only"):
        fake_quant(torch.ones(2, 16), fmt, _t(1.0), narrow_range=False)
    with pytest.raises(ValueError, match="int formats only"):
        fake_quant(torch.ones(2, 16), fmt, _t(1.0), unsigned=True)


@pytest.mark.parametrize("narrow_range", [True, False])
@pytest.mark.parametrize(("k", "block"), [(16, 128), (100, 32), (200, 128), (1, 4)])
def test_int_block_pads_the_last_dim_like_model_optimizer(k, block, narrow_range):
    # Zero padding to a multiple of the block (Model Optimizer's static-block padding) leaves every block max
    # unchanged, so it equals quantizing the explicitly padded tensor and cutting the padding off.
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, k, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).unsqueeze(1)
    padded = torch.nn.functional.pad(x, (0, -k % block))
    expected = fake_quant(padded, "int4", block_size=block, narrow_range=narrow_range)[:, :k]
    assert_bits_equal(fake_quant(x, "int4", block_size=block, narrow_range=narrow_range), expected)


@pytest.mark.parametrize(("fmt", "bits"), [(f"int{b}", b) for b in range(2, 9)])
def test_int_per_channel_amax_quantizes_each_row_with_its_own_scale(fmt, bits):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5, 33, generator=g) * torch.logspace(-4, 4, 5).unsqueeze(1)
    amax = x.abs().amax(dim=1, keepdim=True) * 0.8
    out = fake_quant(x, fmt, amax)
    for c in range(5):
        assert_bits_equal(out[c], _int_independent(x[c], amax[c, 0], bits))
    # Hand check of the clamp: every row's max element lands exactly on 7 (or 127) / scale.
    bound = float(2 ** (bits - 1) - 1)
    top = x.abs().argmax(dim=1)
    for c in range(5):
        scale = torch.tensor(bound) / amax[c, 0]
        assert out[c, top[c]].abs() == torch.tensor(bound) / scale


def test_int4_block_128_uses_each_blocks_own_amax():
    # Block b holds integers k in [-7, 7] times 2**e_b (one element exactly 7 * 2**e_b): the scale 7 / blockmax
    # is the power of two 2**-e_b, so the output equals the clean input; +-0.3 of noise on k rounds back to k.
    g = torch.Generator().manual_seed(13)
    n_rows, n_blocks = 2, 4
    exps = torch.tensor([[-6.0, 3.0, -1.0, 9.0], [0.0, -12.0, 5.0, 2.0]]).unsqueeze(-1)
    k = torch.randint(-7, 8, (n_rows, n_blocks, 128), generator=g).float()
    k[..., 17] = 7.0
    clean = (k * 2.0**exps).flatten(-2)
    noise = (torch.rand(n_rows, n_blocks, 128, generator=g) - 0.5) * 0.6
    noise[..., 17] = 0.0
    noise = torch.where(k == 0, noise.abs(), noise)  # keeps the sign of the zeros
    noisy = (torch.clamp(k + noise, -7.0, 7.0) * 2.0**exps).flatten(-2)
    assert_bits_equal(fake_quant(clean, "int4", block_size=128), clean)
    assert_bits_equal(fake_quant(noisy, "int4", block_size=128), clean)
    # The per-tensor amax argument plays no part in block mode.
    assert_bits_equal(fake_quant(noisy, "int4", _t(1e-3), block_size=128), clean)


def test_int8_block_mode_matches_independent_per_block_computation():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 256, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).unsqueeze(1)
    out = fake_quant(x, "int8", block_size=64)
    for r in range(3):
        for b in range(4):
            blk = x[r, b * 64:(b + 1) * 64]
            assert_bits_equal(out[r, b * 64:(b + 1) * 64], _int_independent(blk, blk.abs().max(), 8))


@pytest.mark.parametrize("amax", [3.0, 6.0])
def test_scale_is_bound_divided_by_amax_not_reciprocal_times_bound(amax):
    # float / tensor in torch is reciprocal(tensor) * float: for amax 3 or 6 that scale is 1 ulp off bound / amax.
    g = torch.Generator().manual_seed(15)
    x = torch.randn(512, generator=g) * amax
    a = _t(amax)
    assert_bits_equal(fake_quant(x, "e4m3", a), _fp8_independent(x, a, 448.0, torch.float8_e4m3fn))
    assert_bits_equal(fake_quant(x, "e5m2", a), _fp8_independent(x, a, 57344.0, torch.float8_e5m2))
    assert_bits_equal(fake_quant(x, "int8", a), _int_independent(x, a, 8))
    assert_bits_equal(fake_quant(x, "int4", a), _int_independent(x, a, 4))
    xb = torch.cat([_t([amax]), x[:127].clamp(-amax, amax)])
    assert_bits_equal(fake_quant(xb, "int4", block_size=128), _int_independent(xb, a, 4))


# --------------------------------------------------------------------------------------------------------------
# Edge values of amax and input


_INVALID_AMAX = [0.0, 2.0**-24, 2.0**-30, 1e-45, -1.0, -448.0, float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("amax", _INVALID_AMAX)
@pytest.mark.parametrize(("fmt", "fp8_dtype", "bound"),
                         [("e4m3", torch.float8_e4m3fn, 448.0), ("e5m2", torch.float8_e5m2, 57344.0)])
def test_fp8_invalid_amax_means_scale_one(fmt, fp8_dtype, bound, amax):
    g = torch.Generator().manual_seed(31)
    x = torch.cat([torch.randn(200, generator=g) * 100, _t([0.0, 1e5, -1e6, 2.0**-20])])
    out = fake_quant(x, fmt, _t(amax))
    assert torch.isfinite(out).all()
    assert_bits_equal(out, torch.clamp(x, -bound, bound).to(fp8_dtype).to(F32))


@pytest.mark.parametrize("amax", _INVALID_AMAX)
@pytest.mark.parametrize(("fmt", "bound"), [("int8", 127.0), ("int4", 7.0)])
def test_int_invalid_amax_means_scale_one(fmt, bound, amax):
    g = torch.Generator().manual_seed(32)
    x = torch.cat([torch.randn(200, generator=g) * 10, _t([0.5, 1.5, 1e9, -1e9])])
    out = fake_quant(x, fmt, _t(amax))
    assert torch.isfinite(out).all()
    assert_bits_equal(out, torch.clamp(torch.round(x), -bound, bound))


@pytest.mark.parametrize("amax", _INVALID_AMAX)
def test_nvfp4_invalid_amax_means_global_scale_one(amax):
    # sg = 1: block 0 has max 6 -> sb = 1 (values round as they are); block 1 has max 12 -> sb = 2.
    x = torch.cat([_one_block([6.0, 0.75, 2.5, -5.0, 0.2]), _one_block([12.0, 1.5, 5.0, -7.0])])
    out = fake_quant(x, "nvfp4", _t(amax))
    assert torch.isfinite(out).all()
    assert_bits_equal(out, torch.cat([_one_block([6.0, 1.0, 2.0, -4.0, 0.0]), _one_block([12.0, 2.0, 4.0, -8.0])]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "int8", "int4", "nvfp4"])
def test_amax_just_above_tiny_is_used_and_gives_finite_output(fmt):
    just_above = torch.nextafter(_t(2.0**-24), _t(1.0))
    g = torch.Generator().manual_seed(33)
    x = torch.cat([torch.randn(30, generator=g) * 1e3, _t([3e38, -3e38])])
    out = fake_quant(x, fmt, just_above)
    assert torch.isfinite(out).all()
    # The amax is honoured (not replaced by the bound): everything saturates at about +-amax.
    assert out.abs().max() <= just_above * (1 + 1e-6)
    assert out.abs().max() >= just_above * 0.99
    if fmt in ("e4m3", "e5m2"):
        bound, fp8 = (448.0, torch.float8_e4m3fn) if fmt == "e4m3" else (57344.0, torch.float8_e5m2)
        assert_bits_equal(out, _fp8_independent(x, just_above, bound, fp8))
    elif fmt.startswith("int"):
        assert_bits_equal(out, _int_independent(x, just_above, int(fmt[3:])))


def test_invalid_entry_of_a_per_channel_amax_affects_only_its_row():
    g = torch.Generator().manual_seed(34)
    x = torch.randn(4, 16, generator=g) * 3
    amax = _t([[2.0], [float("nan")], [0.0], [0.5]])
    out = fake_quant(x, "e4m3", amax)
    assert torch.isfinite(out).all()
    for c, a in [(0, 2.0), (3, 0.5), (1, 448.0), (2, 448.0)]:
        assert_bits_equal(out[c], _fp8_independent(x[c], _t(a), 448.0, torch.float8_e4m3fn))


@pytest.mark.parametrize(("fmt", "kwargs"), [("e4m3", {"amax": _t(3.0)}), ("e5m2", {"amax": _t(3.0)}),
                                             ("int8", {"amax": _t(3.0)}), ("int4", {"amax": _t(3.0)}),
                                             ("int4", {"block_size": 16}), ("int8", {"block_size": 32}),
                                             ("nvfp4", {"amax": _t(3.0)})])
def test_nan_input_stays_nan_in_its_element_only(fmt, kwargs):
    g = torch.Generator().manual_seed(41)
    x = torch.randn(4, 64, generator=g)
    nan_at = torch.zeros_like(x, dtype=torch.bool)
    nan_at[0, 3] = nan_at[2, 17] = nan_at[3, 63] = True
    # Replacing the NaN by 0 changes no scale (per-tensor amax is given; block maxima ignore NaN).
    x_nan = torch.where(nan_at, torch.full_like(x, float("nan")), x)
    x_zero = torch.where(nan_at, torch.zeros_like(x), x)
    out = fake_quant(x_nan, fmt, **kwargs)
    assert torch.equal(torch.isnan(out), nan_at)
    ref = fake_quant(x_zero, fmt, **kwargs)
    assert_bits_equal(out[~nan_at], ref[~nan_at])


def test_nvfp4_nan_in_an_all_zero_block_stays_nan_and_the_rest_is_zero():
    x = torch.cat([_one_block([0.0, float("nan")]), _one_block([6.0, 1.25])])
    out = fake_quant(x, "nvfp4", _t(2688.0))
    expected = torch.cat([_one_block([0.0, float("nan")]), _one_block([6.0, 1.0])])
    assert_bits_equal(out, expected)


def test_inf_input_saturates_in_every_format():
    inf = float("inf")
    # FP8: amax 3.5 -> scale 128 -> +-448 / 128 = +-3.5.
    assert_bits_equal(fake_quant(_t([inf, -inf, 1.0]), "e4m3", _t(3.5)), _t([3.5, -3.5, 1.0]))
    assert_bits_equal(fake_quant(_t([inf, -inf, 1.0]), "e5m2", _t(7.0)), _t([7.0, -7.0, 1.0]))
    # INT: amax 2 -> scale 63.5: +-127 / 63.5 = +-2; 1.0 * 63.5 = 63.5 -> 64 (even) -> 64 / 63.5.
    out = fake_quant(_t([inf, -inf, 1.0]), "int8", _t(2.0))
    assert_bits_equal(out, torch.stack([_t(2.0), _t(-2.0), _t(64.0) / _t(63.5)]))
    # INT block mode: an Inf block max is an invalid amax -> that block's scale is 1 -> +-7, 2.6 -> 3, 0.3 -> 0;
    # the next block keeps its own scale (max 3.5 -> scale 2: 1.25 * 2 = 2.5 -> 2 -> 1.0).
    out = fake_quant(_t([inf, -inf, 0.3, 2.6, 3.5, 1.25, 0.0, -3.5]), "int4", block_size=4)
    assert_bits_equal(out, _t([7.0, -7.0, 0.0, 3.0, 3.5, 1.0, 0.0, -3.5]))
    # NVFP4: the Inf block's max is Inf -> sb saturates at 448 -> s = 448 (sg = 1): +-Inf -> +-6 * 448 = +-2688;
    # the block's small values / 448 round to 0. The other block is untouched (max 6 -> sb 1).
    x = torch.cat([_one_block([inf, -inf, 100.0, -50.0]), _one_block([6.0, 2.5])])
    expected = torch.cat([_one_block([2688.0, -2688.0, 0.0, -0.0]), _one_block([6.0, 2.0])])
    assert_bits_equal(fake_quant(x, "nvfp4", _t(2688.0)), expected)


# --------------------------------------------------------------------------------------------------------------
# Dtypes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("fmt", "kwargs"), [("e4m3", {"amax": _t(2.5)}), ("e5m2", {"amax": _t(2.5)}),
                                             ("int8", {"amax": _t(2.5)}), ("int4", {"amax": _t(2.5)}),
                                             ("int4", {"block_size": 32}), ("nvfp4", {"amax": _t(2.5)})])
def test_output_keeps_input_dtype_and_equals_fp32_result_rounded(fmt, kwargs, dtype):
    g = torch.Generator().manual_seed(51)
    x = (torch.randn(8, 64, generator=g) * 1.5).to(dtype)
    out = fake_quant(x, fmt, **kwargs)
    assert out.dtype == dtype
    assert_bits_equal(out, fake_quant(x.float(), fmt, **kwargs).to(dtype))


# --------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(("x", "fmt", "kwargs", "match"), [
    (torch.ones(4, 16), "fp16", {"amax": _t(1.0)}, "unknown format 'fp16'"),
    (torch.ones(4, 16, dtype=torch.int32), "e4m3", {"amax": _t(1.0)}, "dtype"),
    (torch.ones(4, 16, dtype=torch.float64), "int8", {"amax": _t(1.0)}, "dtype"),
    (torch.ones(4, 16), "e4m3", {}, "needs an amax"),
    (torch.ones(4, 16), "nvfp4", {}, "needs an amax"),
    (torch.ones(4, 16), "int8", {}, "needs an amax"),
    (torch.ones(4, 16), "e4m3", {"amax": torch.ones(3, 1)}, r"does not broadcast"),
    (torch.ones(4, 16), "int8", {"amax": torch.ones(16, 1)}, r"does not broadcast"),
    (torch.ones(4, 24), "nvfp4", {"amax": _t(1.0)}, "multiple of block size 16"),
    (torch.ones(4, 32), "nvfp4", {"amax": _t(1.0), "block_size": 32}, "blocks of 16"),
    (torch.ones(4, 32), "e4m3", {"amax": _t(1.0), "block_size": (16, 16, 16)}, "blocks of the last dim"),
    (torch.ones(4, 32), "e5m2", {"amax": _t(1.0), "block_size": 0}, "blocks of the last dim"),
    (torch.ones(32), "e4m3", {"block_size": (16, 16)}, "at least 2 dims"),
])
def test_fake_quant_rejects_bad_arguments_with_value_error(x, fmt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fake_quant(x, fmt, **kwargs)


def test_amax_that_broadcasts_to_a_larger_shape_than_x_is_rejected():
    with pytest.raises(ValueError, match="broadcast"):
        fake_quant(torch.ones(8), "e4m3", torch.ones(4, 1))  # today: returns shape [4, 8]


def test_nvfp4_amax_varying_along_the_last_dim_is_rejected():
    with pytest.raises(ValueError, match=r"with size 1 in the last dim \(nvfp4 blocks run along it\)"):
        fake_quant(torch.ones(3, 16), "nvfp4", torch.ones(1, 16))


@pytest.mark.parametrize(("num_bits", "fmt"), [((4, 3), "e4m3"), ([4, 3], "e4m3"), ("e4m3", "e4m3"),
                                               ((5, 2), "e5m2"), ("E2M1", "nvfp4"), ((2, 1), "nvfp4"),
                                               (8, "int8"), (4, "int4"), (" INT8 ", "int8"), (7, "int7"),
                                               (2, "int2"), (3, "int3"), (5, "int5"), (6, "int6"),
                                               ("int7", "int7")])
def test_format_from_num_bits_maps_model_optimizer_names(num_bits, fmt):
    assert format_from_num_bits(num_bits) == fmt


@pytest.mark.parametrize("num_bits", [(3, 3), [3, 3], "fp16", True, False, 1, 9, 16, None, (4, 3, 1), "int9"])
def test_format_from_num_bits_rejects_unsupported_values(num_bits):
    with pytest.raises(ValueError, match="unsupported num_bits"):
        format_from_num_bits(num_bits)


@pytest.mark.parametrize("num_bits", [[[4, 3]], {"a": 1}])
def test_format_from_num_bits_rejects_unhashable_values_with_value_error(num_bits):
    with pytest.raises(ValueError, match="unsupported num_bits"):
        format_from_num_bits(num_bits)


def test_format_table_bounds():
    assert {k: v.bound for k, v in formats.FORMATS.items()} == {
        "e4m3": 448.0, "e5m2": 57344.0, "nvfp4": 2688.0, "nvfp4_four_over_six": 1536.0, "int8": 127.0, "int4": 7.0,
        "int2": 1.0, "int3": 3.0, "int5": 15.0, "int6": 31.0, "int7": 63.0, "mxfp4": 6.0, "mxfp8": 448.0}
    assert torch.finfo(torch.float8_e4m3fn).max == 448.0
    assert torch.finfo(torch.float8_e5m2).max == 57344.0
