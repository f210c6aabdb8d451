"""Triton kernels for grouped (all experts, one launch) fake quantization; private, imported lazily.

This file holds only ``@triton.jit`` code. The launchers, ``torch.library`` custom ops and autograd functions live
in :mod:`modelopt_moe.kernels.grouped_fake_quant`, which imports this module only when Triton can run (Triton is
optional, and ``TRITON_INTERPRET=1`` must be set before the decorators below run).

Bit-exactness with :func:`modelopt_moe.quantization.formats.fake_quant` (interpreter and GPU alike) rests on:

* no ``.to(fp8)`` and no fp32 -> bf16 ``.to()`` of inexact values (the interpreter gets both wrong): every rounding
  is plain fp32 arithmetic (add and subtract a power of two whose ulp is the target quantum, round half to even by
  the FPU) or integer arithmetic on the fp32 bits;
* IEEE division via ``tl.math.div_rn`` (a bare ``/`` is ``div.full.f32``, approximate, on NVIDIA GPUs);
* clamps written as ``tl.where`` on comparisons (NaN compares false, so NaN stays NaN and -0.0 stays -0.0), never
  ``tl.minimum``/``tl.maximum`` whose NaN behaviour differs between backends;
* launches with ``enable_fp_fusion=False``: ``x * scale + magic`` must not become one fused multiply-add.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Format codes (constexpr). Keep in sync with grouped_fake_quant._FMT_CODES.
E4M3: tl.constexpr = tl.constexpr(0)
E5M2: tl.constexpr = tl.constexpr(1)
NVFP4: tl.constexpr = tl.constexpr(2)
INT8: tl.constexpr = tl.constexpr(3)
INT4: tl.constexpr = tl.constexpr(4)

# formats.TINY_AMAX (2**-24) and the largest finite fp32; both exact in fp32.
TINY_AMAX: tl.constexpr = tl.constexpr(5.960464477539063e-08)
FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)

# Table columns of the weight kernels (int64 [N, NCOL]); see grouped_fake_quant._build_weight_table.
COL_IN: tl.constexpr = tl.constexpr(0)  # element offset of the input (forward) / gradient (backward) from its base
COL_AUX: tl.constexpr = tl.constexpr(1)  # element offset of the weight from its base (backward only)
COL_OUT: tl.constexpr = tl.constexpr(2)  # element offset of this expert in the output buffer
COL_ROWS: tl.constexpr = tl.constexpr(3)
COL_COLS: tl.constexpr = tl.constexpr(4)
COL_TILE0: tl.constexpr = tl.constexpr(5)  # first program id of this expert (cumulative tile count)
COL_CTILES: tl.constexpr = tl.constexpr(6)  # column tiles per row tile (2-D tiling only)
NCOL: tl.constexpr = tl.constexpr(8)


# ----------------------------------------------------------------------------------------------------------------
# Exact arithmetic helpers
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _div(a, b):
    """IEEE round-to-nearest a / b (broadcasting)."""
    a, b = tl.broadcast(a, b)
    return tl.math.div_rn(a, b)


@triton.jit
def _with_sign_of(mag, x):
    """``copysign(mag, x)`` for ``mag >= 0``, taking the sign bit of ``x`` (so -0.0 and -NaN count as negative)."""
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -mag, mag)


@triton.jit
def _round_to_float(v, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr):
    """Rounds fp32 ``v`` to a float with MANT mantissa bits and min normal exponent EMIN, half to even.

    Subnormals of the target format come out right (the quantum stops shrinking below 2**EMIN). No saturation:
    the caller clamps, or checks the result against the format's max. NaN stays NaN; EMAX only bounds the magic
    number so that huge inputs cannot overflow the exponent field (they come back unchanged).
    """
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(e < EMIN, EMIN, e)
    e = tl.where(e > EMAX, EMAX, e)
    # 2**(e - MANT) is the quantum of a; adding 2**(e - MANT + 23) makes it the ulp of the sum, so the FPU rounds
    # a to a multiple of the quantum (ties to even) and the subtraction is exact.
    magic = ((e + (23 - MANT + 127)) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    r = _with_sign_of(r, v)
    return tl.where(v != v, v, r)


@triton.jit
def _round_half_even_small(v):
    """Round half to even to an integer for |v| < 2**23 (callers clamp first), sign of zero kept, NaN kept."""
    a = tl.abs(v)
    r = (a + 8388608.0) - 8388608.0
    r = _with_sign_of(r, v)
    return tl.where(v != v, v, r)


@triton.jit
def _clamp_sym(v, bound):
    """clamp(v, -bound, bound) with NaN and -0.0 kept (like torch.clamp)."""
    v = tl.where(v > bound, bound, v)
    return tl.where(v < -bound, -bound, v)


@triton.jit
def _round_e2m1(v):
    """formats.round_to_e2m1: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even mantissa, saturating, NaN kept."""
    a = tl.abs(v)
    mag = tl.where(a <= 5.0, 4.0, 6.0)
    mag = tl.where(a < 3.5, 3.0, mag)
    mag = tl.where(a <= 2.5, 2.0, mag)
    mag = tl.where(a < 1.75, 1.5, mag)
    mag = tl.where(a <= 1.25, 1.0, mag)
    mag = tl.where(a < 0.75, 0.5, mag)
    mag = tl.where(a <= 0.25, 0.0, mag)
    return tl.where(v != v, v, _with_sign_of(mag, v))


@triton.jit
def _to_out_dtype(v, OUT_DTYPE: tl.constexpr):
    """fp32 -> OUT_DTYPE rounded to nearest even, by arithmetic, so the final ``.to()`` is exact everywhere."""
    if OUT_DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        abits = bits & 0x7FFFFFFF
        # Integer RNE on the top 16 bits; a carry into the exponent is the right answer (up to Inf).
        hi = (abits + (0x7FFF + ((abits >> 16) & 1))) >> 16
        hi = tl.where(v != v, 0x7FC0, hi)  # canonical NaN
        hi = hi | ((bits >> 16) & 0x8000)
        # Assembled as bits: the interpreter's fp32 -> bf16 .to() truncates and mangles subnormals.
        return hi.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif OUT_DTYPE == tl.float16:
        r = _round_to_float(v, 10, -14, 15)
        # 65520 is the midpoint between fp16's max (65504) and 2**16: RNE overflows to Inf from there on.
        r = tl.where(tl.abs(r) > 65504.0, _with_sign_of(float("inf"), v), r)
        r = tl.where(v != v, float("nan"), r)
        return r.to(tl.float16)
    else:
        return v


@triton.jit
def _to_fp32(x):
    """Exact widening to fp32; bf16 by bits (the interpreter's bf16 -> fp32 .to() flushes subnormals wrongly)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _safe_amax(a, bound):
    """formats.safe_amax: entries <= 2**-24, NaN or Inf become ``bound``."""
    ok = (a > TINY_AMAX) & (a <= FP32_MAX)
    return tl.where(ok, a, bound)


@triton.jit
def _nan_ignoring_block_max(x):
    """max |x| over the last axis of a 3-D tile, NaN ignored; shape [R, NB, 1]."""
    ax = tl.where(x != x, 0.0, tl.abs(x))
    return tl.max(ax, axis=2, keep_dims=True)


@triton.jit
def _fp8_tile(x, amax, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr):
    scale = _div(tl.full(amax.shape, BOUND, tl.float32), _safe_amax(amax, BOUND))
    # The clamp makes the fp8 rounding saturating (BOUND is the format's largest finite value).
    q = _round_to_float(_clamp_sym(x * scale, BOUND), MANT, EMIN, EMAX)
    return _div(q, scale)


@triton.jit
def _int_tile(x, amax, IBOUND: tl.constexpr, INT_BLOCK: tl.constexpr):
    if INT_BLOCK:
        a = _safe_amax(_nan_ignoring_block_max(x), IBOUND)
    else:
        a = _safe_amax(amax, IBOUND)
    scale = _div(tl.full(a.shape, IBOUND, tl.float32), a)
    # round(clamp(v)) == clamp(round(v)) for an integer bound; clamping first keeps |v| < 2**23.
    q = _round_half_even_small(_clamp_sym(x * scale, IBOUND))
    return _div(q, scale)


@triton.jit
def _nvfp4_tile(x, amax):
    sg = _div(_safe_amax(amax, 2688.0), tl.full(amax.shape, 2688.0, tl.float32))  # [R, 1, 1]
    bmax = _nan_ignoring_block_max(x)  # [R, NB, 1]
    t = _div(_div(bmax, tl.full(bmax.shape, 6.0, tl.float32)), sg)
    t = tl.where(t > 448.0, 448.0, t)  # t >= 0 and never NaN (the block max ignores NaN)
    sb = _round_to_float(t, 3, -6, 8)  # e4m3 block scale
    s = sb * sg
    v = tl.where(s > 0.0, _div(x, tl.where(s > 0.0, s, 1.0)), x * 0.0)
    return _round_e2m1(v) * s


@triton.jit
def _fake_quant_tile(x, amax, FMT: tl.constexpr, INT_BLOCK: tl.constexpr):
    """Fake-quantizes a fp32 tile ``x`` [R, NB, BS] exactly as formats.fake_quant.

    ``amax`` is fp32 [R, 1, 1] (per row: expert or channel). For NVFP4 and block int formats the last axis of the
    tile is one quantization block.
    """
    if FMT == E4M3:
        out = _fp8_tile(x, amax, 448.0, 3, -6, 8)
    elif FMT == E5M2:
        out = _fp8_tile(x, amax, 57344.0, 2, -14, 15)
    elif FMT == INT8:
        out = _int_tile(x, amax, 127.0, INT_BLOCK)
    elif FMT == INT4:
        out = _int_tile(x, amax, 7.0, INT_BLOCK)
    else:
        out = _nvfp4_tile(x, amax)
    return out


@triton.jit
def _find_expert(table_ptr, pid, n_experts, SEARCH_STEPS: tl.constexpr):
    """Largest e with tile0[e] <= pid (binary search over the cumulative tile counts; experts of 0 tiles skipped)."""
    lo = pid * 0
    hi = lo + n_experts
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(table_ptr + mid * NCOL + COL_TILE0) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _tile_offsets(table_ptr, e, t, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr,
                  TWO_D: tl.constexpr, VEC: tl.constexpr):
    """Where local tile ``t`` of expert ``e`` lies: (int64 start offset, int32 [TILE_R, TILE_NB, BS] offsets from
    it, mask, rows [TILE_R, 1, 1], row mask).

    Flat tiling walks the flattened expert in contiguous chunks of TILE_R * TILE_NB * BS elements; 2-D tiling walks
    the [rows, cols] matrix in [TILE_R, TILE_NB * BS] tiles (needed when the amax is per row).
    """
    rows_n = tl.load(table_ptr + e * NCOL + COL_ROWS)
    cols_n = tl.load(table_ptr + e * NCOL + COL_COLS)
    r = tl.arange(0, TILE_R)[:, None, None]
    c = tl.arange(0, TILE_NB)[None, :, None] * BS + tl.arange(0, BS)[None, None, :]
    if TWO_D:
        ctiles = tl.load(table_ptr + e * NCOL + COL_CTILES)
        tr = t // ctiles
        tc = t - tr * ctiles
        row0 = tr * TILE_R
        col0 = tc * (TILE_NB * BS)
        start = row0 * cols_n + col0
        rows = row0 + r
        row_mask = rows < rows_n
        mask = row_mask & ((col0 + c) < cols_n)
        # The launcher guarantees cols_n % VEC == 0 whenever VEC > 1 (so each row starts aligned).
        local = tl.multiple_of(r * cols_n.to(tl.int32), [VEC, 1, 1]) + c
    else:
        start = t * (TILE_R * TILE_NB * BS)
        rows = r.to(tl.int64)  # unused
        row_mask = rows >= 0
        local = r * (TILE_NB * BS) + c
        mask = local < (rows_n * cols_n - start)
    return start, local, mask, rows, row_mask


@triton.jit
def _load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE: tl.constexpr, amax_stride_e, TILE_R: tl.constexpr):
    """amax as fp32 [TILE_R, 1, 1]: 1 = one value per expert (stride amax_stride_e; 0 = shared), 2 = per row."""
    zero = tl.zeros([TILE_R, 1, 1], dtype=tl.float32)
    if AMAX_MODE == 2:
        a = tl.load(amax_ptr + e * amax_stride_e + rows, mask=row_mask, other=1.0).to(tl.float32)
    elif AMAX_MODE == 1:
        a = zero + tl.load(amax_ptr + e * amax_stride_e).to(tl.float32)
    else:
        a = zero + 1.0  # unused (block int formats take their amax from the data)
    return a


# ----------------------------------------------------------------------------------------------------------------
# Weights: all N experts in one launch
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _grouped_weight_fake_quant_kernel(
    in_base, out_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e,
    FMT: tl.constexpr, INT_BLOCK: tl.constexpr, AMAX_MODE: tl.constexpr, TWO_D: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    # One program per (expert, tile); the grid is flat over all experts' tiles, so ragged experts waste nothing.
    # Offsets are int64: the concatenated output (and a weight's distance from the base pointer) can exceed 2**31
    # elements; only the in-tile offsets are int32.
    pid = tl.program_id(0).to(tl.int64)
    e = _find_expert(table_ptr, pid, n_experts, SEARCH_STEPS)
    t = pid - tl.load(table_ptr + e * NCOL + COL_TILE0)
    start, local, mask, rows, row_mask = _tile_offsets(table_ptr, e, t, TILE_R, TILE_NB, BS, TWO_D, VEC)
    in_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)
    out_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_OUT) + start, VEC)
    x = _to_fp32(tl.load(in_base + in_off + local, mask=mask, other=0.0))
    a = _load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE, amax_stride_e, TILE_R)
    y = _fake_quant_tile(x, a, FMT, INT_BLOCK)
    tl.store(out_ptr + out_off + local, _to_out_dtype(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_weight_clip_grad_kernel(
    g_base, w_base, out_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e,
    AMAX_MODE: tl.constexpr, TWO_D: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    # Clipped STE: grad * (|w| <= amax); an invalid amax clips nothing. int64 offsets as above.
    pid = tl.program_id(0).to(tl.int64)
    e = _find_expert(table_ptr, pid, n_experts, SEARCH_STEPS)
    t = pid - tl.load(table_ptr + e * NCOL + COL_TILE0)
    start, local, mask, rows, row_mask = _tile_offsets(table_ptr, e, t, TILE_R, TILE_NB, BS, TWO_D, VEC)
    g_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)
    w_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_AUX) + start, VEC)
    out_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_OUT) + start, VEC)
    g = _to_fp32(tl.load(g_base + g_off + local, mask=mask, other=0.0))
    w = _to_fp32(tl.load(w_base + w_off + local, mask=mask, other=0.0))
    a = _load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE, amax_stride_e, TILE_R)
    limit = tl.where((a > TINY_AMAX) & (a <= FP32_MAX), a, float("inf"))
    y = tl.where(tl.abs(w) <= limit, g, g * 0.0)
    tl.store(out_ptr + out_off + local, _to_out_dtype(y, out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Inputs: x [T, K] split into N row groups by a device m_splits
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr,
              TILE_R: tl.constexpr):
    """amax [TILE_R, 1, 1] for token rows ``rows`` [TILE_R]: their expert's, found from m_splits on the device."""
    if PER_EXPERT:
        idx = tl.arange(0, N_PAD)
        ms = tl.load(m_splits_ptr + idx, mask=idx < n_experts, other=0).to(tl.int64)
        ends = tl.cumsum(ms, axis=0)  # exclusive end row of each expert
        eid = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        # Rows past sum(m_splits) (a caller error that cannot be checked without a sync) use the last expert.
        eid = tl.where(eid < n_experts, eid, n_experts - 1)
        a = tl.load(amax_ptr + eid).to(tl.float32)
    else:
        a = tl.zeros([TILE_R], dtype=tl.float32) + tl.load(amax_ptr).to(tl.float32)
    return a[:, None, None]


@triton.jit
def _input_tile(n_rows, n_cols, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr):
    """(int64 start offset, int32 offsets from it, mask, int64 rows [TILE_R]) of this program's [TILE_R, TILE_K]."""
    row0 = tl.program_id(0).to(tl.int64) * TILE_R
    col0 = tl.program_id(1) * (TILE_NB * BS)
    r = tl.arange(0, TILE_R)
    c = tl.arange(0, TILE_NB)[None, :, None] * BS + tl.arange(0, BS)[None, None, :]
    rows = row0 + r
    mask = (rows[:, None, None] < n_rows) & ((col0 + c) < n_cols)
    local = r[:, None, None] * n_cols + c
    # int64 start: T * K can exceed 2**31 elements.
    return row0 * n_cols + col0, local, mask, rows


@triton.jit
def _grouped_input_fake_quant_kernel(
    x_ptr, y_ptr, m_splits_ptr, amax_ptr, n_rows, n_cols, n_experts,
    FMT: tl.constexpr, INT_BLOCK: tl.constexpr, PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr,
):
    start, local, mask, rows = _input_tile(n_rows, n_cols, TILE_R, TILE_NB, BS)
    x = _to_fp32(tl.load(x_ptr + start + local, mask=mask, other=0.0))
    a = _row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT, N_PAD, TILE_R)
    y = _fake_quant_tile(x, a, FMT, INT_BLOCK)
    tl.store(y_ptr + start + local, _to_out_dtype(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_input_clip_grad_kernel(
    g_ptr, x_ptr, out_ptr, m_splits_ptr, amax_ptr, n_rows, n_cols, n_experts,
    PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr,
):
    start, local, mask, rows = _input_tile(n_rows, n_cols, TILE_R, TILE_NB, BS)
    g = _to_fp32(tl.load(g_ptr + start + local, mask=mask, other=0.0))
    x = _to_fp32(tl.load(x_ptr + start + local, mask=mask, other=0.0))
    a = _row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT, N_PAD, TILE_R)
    limit = tl.where((a > TINY_AMAX) & (a <= FP32_MAX), a, float("inf"))
    y = tl.where(tl.abs(x) <= limit, g, g * 0.0)
    tl.store(out_ptr + start + local, _to_out_dtype(y, out_ptr.dtype.element_ty), mask=mask)
