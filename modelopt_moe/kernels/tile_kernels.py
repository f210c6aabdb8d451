"""The ``@triton.jit`` helpers every grouped kernel is built from: exact arithmetic, the fake quant of a tile in each
format, and where a program's tile lies (weights: through the per-expert table; tokens: rows split by ``m_splits``).
Public within the package; imported lazily, with the kernel modules (``*_kernels.py``) that use them.

Bit-exactness with :func:`modelopt_moe.numerics.fake_quant` (interpreter and GPU alike) rests on:

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

from ..numerics import TINY_AMAX as _TINY_AMAX
from ..numerics import KernelRoutine
from . import launch

# The tile routines (the FAMILY constexpr, a format's KernelSpec.routine); each format's constants come as constexprs.
SCALED_FLOAT: tl.constexpr = tl.constexpr(int(KernelRoutine.SCALED_FLOAT))
SCALED_INT: tl.constexpr = tl.constexpr(int(KernelRoutine.SCALED_INT))
TWO_LEVEL_E2M1: tl.constexpr = tl.constexpr(int(KernelRoutine.TWO_LEVEL_E2M1))
POWER_OF_TWO_BLOCKS: tl.constexpr = tl.constexpr(int(KernelRoutine.POWER_OF_TWO_BLOCKS))
TWO_LEVEL_E2M1_FOUR_OVER_SIX: tl.constexpr = tl.constexpr(int(KernelRoutine.TWO_LEVEL_E2M1_FOUR_OVER_SIX))

# The invalid-amax threshold (2**-24) and the largest finite fp32; both exact in fp32.
TINY_AMAX: tl.constexpr = tl.constexpr(_TINY_AMAX)
FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)

# Table columns of the weight kernels (int64 [N, NCOL]); see launch.py.
COL_IN: tl.constexpr = tl.constexpr(launch.COL_IN)
COL_AUX: tl.constexpr = tl.constexpr(launch.COL_AUX)
COL_OUT: tl.constexpr = tl.constexpr(launch.COL_OUT)
COL_ROWS: tl.constexpr = tl.constexpr(launch.COL_ROWS)
COL_COLS: tl.constexpr = tl.constexpr(launch.COL_COLS)
COL_TILE0: tl.constexpr = tl.constexpr(launch.COL_TILE0)
COL_CTILES: tl.constexpr = tl.constexpr(launch.COL_CTILES)
NCOL: tl.constexpr = tl.constexpr(launch.NCOL)


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
    """``copysign(mag, x)`` for fp32 ``mag >= 0`` by bits, taking the sign bit of ``x`` (so -0.0 counts as negative).

    Not ``-mag``: Triton lowers float negation to ``0 - mag``, which turns a zero into +0.0 on the GPU.
    """
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


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
def to_out_dtype(v, OUT_DTYPE: tl.constexpr, BITWISE: tl.constexpr):
    """fp32 -> OUT_DTYPE rounded to nearest even.

    On the GPU (``BITWISE`` False) that is the hardware ``cvt.rn``; in the interpreter, whose ``.to()`` truncates
    (and mangles bf16 subnormals), the same IEEE rounding is done by arithmetic and the result assembled from bits.
    Both give identical bits (tests check each against torch's ``.to()``).
    """
    if not BITWISE:
        out = v.to(OUT_DTYPE)
    elif OUT_DTYPE == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        abits = bits & 0x7FFFFFFF
        # Integer RNE on the top 16 bits; a carry into the exponent is the right answer (up to Inf).
        hi = (abits + (0x7FFF + ((abits >> 16) & 1))) >> 16
        hi = tl.where(v != v, 0x7FC0, hi)  # canonical NaN
        hi = hi | ((bits >> 16) & 0x8000)
        # Assembled as bits: the interpreter's fp32 -> bf16 .to() truncates and mangles subnormals.
        out = hi.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif OUT_DTYPE == tl.float16:
        r = _round_to_float(v, 10, -14, 15)
        # 65520 is the midpoint between fp16's max (65504) and 2**16: RNE overflows to Inf from there on.
        r = tl.where(tl.abs(r) > 65504.0, _with_sign_of(tl.zeros_like(v) + float("inf"), v), r)
        r = tl.where(v != v, float("nan"), r)
        out = r.to(tl.float16)
    else:
        out = v
    return out


@triton.jit
def to_fp32(x):
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
def _round_mag(a, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, NO_HI: tl.constexpr = False):
    """Rounds ``a >= 0`` (or NaN) to MANT mantissa bits, min normal exponent EMIN (subnormals below), half to even.

    Adding 2**(e - MANT + 23), e = max(exponent(a), EMIN), makes the target quantum 2**(e - MANT) the ulp of the
    sum, so the FPU rounds; the subtraction is exact. No saturation (callers clamp first). EMAX bounds the magic
    number for huge or non-finite inputs (NaN stays NaN). ``NO_HI=True`` drops that bound where the caller has
    already saturated ``a`` to at most the format's max (exponent <= EMAX), so only NaN can exceed it, and NaN plus
    any magic number stays NaN.
    """
    eb = a.to(tl.int32, bitcast=True) >> 23
    eb = tl.where(eb < EMIN + 127, EMIN + 127, eb)
    if not NO_HI:
        eb = tl.where(eb > EMAX + 127, EMAX + 127, eb)
    magic = ((eb << 23) + ((23 - MANT) << 23)).to(tl.float32, bitcast=True)
    return (a + magic) - magic


@triton.jit
def _div_by(q, d, rcp, NATIVE_DIV: tl.constexpr):
    """RN(q / d) for a divisor ``d > 0`` shared by many elements and ``rcp = RN(1 / d)``.

    Markstein's theorem: y = RN(q * rcp) is within an ulp of q / d, so the residual q - d * y is exact and
    RN(y + residual * rcp) is the correctly rounded quotient (no overflow or underflow occurs here: see callers).
    Three flops instead of a full division per element. ``NATIVE_DIV`` uses ``div_rn`` instead (for checking).
    """
    if NATIVE_DIV:
        return _div(q, d)
    else:
        d, q = tl.broadcast(d, q)
        rcp, q = tl.broadcast(rcp, q)
        y = q * rcp
        return tl.fma(tl.fma(-d, y, q), rcp, y)


@triton.jit
def _hw_round_fp8(v, E5M2_: tl.constexpr):
    """Saturating round of fp32 ``v`` to e4m3 (or e5m2) and back to fp32 by the GPU's converters (sm_89+).

    ``cvt.rn.satfinite`` rounds to nearest even with the format's subnormals, turns anything beyond the largest
    finite value (Inf too) into it and keeps NaN a NaN; the way back (fp8 -> f16 -> f32) is exact. That is
    ``_round_mag(where(v > BOUND, BOUND, v))`` for ``v >= 0`` or NaN. GPU only (the interpreter has no inline asm).
    """
    vi = v.to(tl.int32, bitcast=True)
    if E5M2_:
        r = tl.inline_asm_elementwise(
            "{ .reg .b16 t, l, u; .reg .b32 h; cvt.rn.satfinite.e5m2x2.f32 t, $3, $2; cvt.rn.f16x2.e5m2x2 h, t; "
            "mov.b32 {l, u}, h; cvt.f32.f16 $0, l; cvt.f32.f16 $1, u; }",
            "=r,=r,r,r", [vi], dtype=tl.int32, is_pure=True, pack=2)
    else:
        r = tl.inline_asm_elementwise(
            "{ .reg .b16 t, l, u; .reg .b32 h; cvt.rn.satfinite.e4m3x2.f32 t, $3, $2; cvt.rn.f16x2.e4m3x2 h, t; "
            "mov.b32 {l, u}, h; cvt.f32.f16 $0, l; cvt.f32.f16 $1, u; }",
            "=r,=r,r,r", [vi], dtype=tl.int32, is_pure=True, pack=2)
    return r.to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------------------------------------------
# Fake quant of a fp32 tile, per format
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _fp8_tile(x, amax, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
              NATIVE_DIV: tl.constexpr, HW_CVT: tl.constexpr = False, LEAN: tl.constexpr = False):
    scale = _div(tl.full(amax.shape, BOUND, tl.float32), _safe_amax(amax, BOUND))
    rcp = _div(tl.full(amax.shape, 1.0, tl.float32), scale)
    # Magnitudes only (rounding is symmetric); the sign of x goes back on at the end, so -0.0 survives.
    v = tl.abs(x) * scale
    if HW_CVT:
        q = _hw_round_fp8(v, MANT == 2)
    else:
        v = tl.where(v > BOUND, BOUND, v)  # saturate (NaN compares false and stays NaN)
        q = _round_mag(v, MANT, EMIN, EMAX, LEAN)
    # q / scale: q >= 2**-16 or 0, scale in [2**-126, 2**40]: the quotient is a normal fp32 (or 0).
    return _with_sign_of(_div_by(q, scale, rcp, NATIVE_DIV), x)


@triton.jit
def _int_tile(x, amax, IBOUND: tl.constexpr, INT_BLOCK: tl.constexpr, NATIVE_DIV: tl.constexpr,
              NEG_BOUND: tl.constexpr):
    """Int fake quant on magnitudes: levels ``[-NEG_BOUND, IBOUND]`` (NEG_BOUND is IBOUND for the symmetric
    narrow range, IBOUND + 1 for two's complement); rounding half to even is symmetric, so rounding |x| and putting
    the sign back equals rounding x."""
    ax = tl.abs(x)
    if INT_BLOCK:
        a = _safe_amax(tl.max(tl.where(ax != ax, 0.0, ax), axis=2, keep_dims=True), IBOUND)
    else:
        a = _safe_amax(amax, IBOUND)
    scale = _div(tl.full(a.shape, IBOUND, tl.float32), a)
    rcp = _div(tl.full(a.shape, 1.0, tl.float32), scale)
    v = ax * scale
    # round(clamp(v)) == clamp(round(v)) for integer bounds
    if NEG_BOUND == IBOUND:
        v = tl.where(v > IBOUND, IBOUND, v)
    else:
        # The sign bit decides (x < 0 is false for -0.0, whose magnitude 0 is below either bound anyway).
        lim = tl.where(x < 0.0, NEG_BOUND, IBOUND)
        v = tl.where(v > lim, lim, v)
    q = (v + 8388608.0) - 8388608.0  # round half to even (0 <= v <= 128 < 2**23)
    return _with_sign_of(_div_by(q, scale, rcp, NATIVE_DIV), x)


@triton.jit
def _mx_tile(x, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
             LEAN: tl.constexpr = False):
    """MX (numerics/mx.py): each block (the last axis) scaled by ``2**-e``, ``e = ceil(log2(amax / BOUND))`` read
    from the quotient's bits, its elements rounded to the float grid (MANT, EMIN, EMAX) saturating at BOUND."""
    ax = tl.abs(x)
    bmax = tl.max(tl.where(ax != ax, 0.0, ax), axis=2, keep_dims=True)  # [R, NB, 1], NaN ignored
    bmax = tl.where(bmax > FP32_MAX, FP32_MAX, bmax)  # Inf counts as the largest finite (Model Optimizer's clamp)
    bits = _div(bmax, tl.full(bmax.shape, BOUND, tl.float32)).to(tl.int32, bitcast=True)  # >= 0: no sign bit
    ef = bits >> 23
    sig = bits & 0x7FFFFF
    # ceil(log2(ratio)): the exponent, one more where the significand is not zero; a subnormal ratio (ef == 0) is
    # above 2**-127 (-126) or not (-127, also for an underflow to 0). At most 126 (FP32_MAX / 6 < 2**126), so
    # 2**-e is a normal fp32.
    e = tl.where(sig != 0, ef - 126, ef - 127)
    e = tl.where(ef == 0, tl.where(sig > 0x400000, -126, -127), e)
    e = tl.where(bmax == 0.0, 0, e)  # an all-zero (or all-NaN) block: scale 1
    scale = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = ax * scale  # exact: a power of two (values that underflow round to 0 below anyway)
    v = tl.where(v > BOUND, BOUND, v)  # only Inf exceeds it (NaN compares false and stays NaN)
    q = _round_mag(v, MANT, EMIN, EMAX, LEAN)
    # q * 2**e, exact: 2**e is normal but at e = -127, whose product is taken in two normal steps.
    half = tl.where(e == -127, -64, e)
    y = q * ((127 + half) << 23).to(tl.float32, bitcast=True)
    y = tl.where(e == -127, y * 1.0842021724855044e-19, y)  # 2**-63
    return _with_sign_of(y, x)


@triton.jit
def _nvfp4_block_max(ax, FAST_MAX: tl.constexpr):
    """The max of each block (the last axis) of ``ax = |x|`` [R, NB, BS], NaN ignored: [R, NB, 1]."""
    if FAST_MAX:
        # GPU only: the reduction's max.f32 already returns the other operand when one is NaN (ax >= 0, so an
        # all-NaN block gives 0, as the masked max below does); the interpreter's max propagates NaN.
        bmax = tl.max(ax, axis=2, keep_dims=True)
    else:
        bmax = tl.max(tl.where(ax != ax, 0.0, ax), axis=2, keep_dims=True)
    return bmax


@triton.jit
def _nvfp4_scale(bmax, sg, DIVISOR: tl.constexpr, HW_CVT: tl.constexpr, LEAN: tl.constexpr):
    """The block scale ``s = e4m3(bmax / DIVISOR / sg) * sg`` [R, NB, 1], the E4M3 rounding saturating at 448."""
    if DIVISOR == 4.0:
        # x * 0.25 and x / 4 are roundings of the same real number (0.25 is exact), subnormals included: one multiply
        # instead of a division.
        a = bmax * 0.25
    else:
        a = _div(bmax, tl.full(bmax.shape, DIVISOR, tl.float32))
    t = _div(a, sg)
    if HW_CVT:
        s = _hw_round_fp8(t, False) * sg  # saturates at 448 itself; t >= 0, never NaN
    else:
        t = tl.where(t > 448.0, 448.0, t)  # t >= 0, never NaN
        s = _round_mag(t, 3, -6, 8, LEAN) * sg  # e4m3 block scale times the global scale
    return s


@triton.jit
def _nvfp4_tile(x, amax, BOUND: tl.constexpr, NATIVE_DIV: tl.constexpr, HW_CVT: tl.constexpr = False,
                LEAN: tl.constexpr = False, FAST_MAX: tl.constexpr = False):
    sg = _div(_safe_amax(amax, BOUND), tl.full(amax.shape, BOUND, tl.float32))  # [R, 1, 1]; BOUND = 6 * 448
    ax = tl.abs(x)
    s = _nvfp4_scale(_nvfp4_block_max(ax, FAST_MAX), sg, 6.0, HW_CVT, LEAN)
    return _e2m1_scaled(x, ax, s, NATIVE_DIV, LEAN)


@triton.jit
def _add_adjacent_pairs(v, HALF: tl.constexpr):
    """[R, NB, 2 * HALF] -> [R, NB, HALF]: element j is ``v[2j] + v[2j + 1]``, one add of two numbers."""
    even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], HALF, 2]))
    return even + odd


@triton.jit
def _block_square_error(y, x):
    """``numerics.nvfp4.block_square_error(y - x)`` of [R, NB, 16] tiles: [R, NB, 1]. The squares are summed as the
    reference's fixed tree of adjacent pairs, each add of exactly two numbers (which no order can change); a
    reduction (``tl.sum``) has no set order and would differ in the last bit."""
    d = y - x
    sq = d * d  # enable_fp_fusion=False: no fused multiply-add into the sums below
    sq = _add_adjacent_pairs(sq, 8)
    sq = _add_adjacent_pairs(sq, 4)
    sq = _add_adjacent_pairs(sq, 2)
    return _add_adjacent_pairs(sq, 1)


@triton.jit
def _nvfp4_four_over_six_tile(x, amax, BOUND: tl.constexpr, NATIVE_DIV: tl.constexpr, HW_CVT: tl.constexpr = False,
                              LEAN: tl.constexpr = False, FAST_MAX: tl.constexpr = False):
    """NVFP4 with 4-over-6 block scales (``NVFP4FourOverSixFormat``), bit for bit: each block quantized with its max
    on E2M1's 6 and on its 4 (``BOUND = 6 * 256``), the 4 kept only where its squared error is strictly smaller (a
    tie or a NaN error keeps 6). Each candidate is :func:`_nvfp4_tile`'s arithmetic with its own divisor."""
    sg = _div(_safe_amax(amax, BOUND), tl.full(amax.shape, BOUND, tl.float32))  # [R, 1, 1]
    ax = tl.abs(x)
    bmax = _nvfp4_block_max(ax, FAST_MAX)
    y6 = _e2m1_scaled(x, ax, _nvfp4_scale(bmax, sg, 6.0, HW_CVT, LEAN), NATIVE_DIV, LEAN)
    y4 = _e2m1_scaled(x, ax, _nvfp4_scale(bmax, sg, 4.0, HW_CVT, LEAN), NATIVE_DIV, LEAN)
    four = _block_square_error(y4, x) < _block_square_error(y6, x)  # NaN compares false: 6
    return tl.where(tl.broadcast_to(four, x.shape), y4, y6)


@triton.jit
def _e2m1_scaled(x, ax, s, NATIVE_DIV: tl.constexpr, LEAN: tl.constexpr):
    """``x`` [R, NB, BS] rounded to E2M1 under its block's scale ``s`` [R, NB, 1] (``> 0``, or 0: then ``q * 0``)
    and scaled back, with the sign of ``x``; ``ax = |x|``."""
    s_ok = tl.where(s > 0.0, s, 1.0)
    rcp = _div(tl.full(s.shape, 1.0, tl.float32), s_ok)
    # |x| / s; where that exceeds 8 (or is Inf/NaN) E2M1 saturates anyway, and Markstein's correction could
    # overflow, so the plain product is kept there. Where s == 0 the result is multiplied by 0 below (x * 0).
    y = ax * tl.broadcast_to(rcp, ax.shape)
    v = tl.where(y < 8.0, _div_by(ax, s_ok, rcp, NATIVE_DIV), y)
    v = tl.where(v > 6.0, 6.0, v)
    # E2M1 is a float with 1 mantissa bit and min normal exponent 0: {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even
    # (the same thresholds as formats.round_to_e2m1).
    q = _round_mag(v, 1, 0, 2, LEAN)
    return _with_sign_of(q * s, x)


@triton.jit
def static_nvfp4_tile(x, amax, block_amax, BOUND: tl.constexpr, NATIVE_DIV: tl.constexpr = False,
                      HW_CVT: tl.constexpr = False, LEAN: tl.constexpr = False):
    """NVFP4 with static block scales (``NVFP4Format.quantize_static``), bit for bit: each block's calibrated amax
    ``block_amax`` [R, NB, 1] in place of its max, ``BOUND = 6 * scale_max`` (448, or 256 for 4-over-6).

    The reference's edge rules: a zero, negative or NaN block amax is the scale +0.0, and where the scale is 0 the
    output is ``(x * 0) * s`` (a zero of ``x``'s sign; NaN for an Inf or NaN element, as ``x * 0.0`` in the
    reference).
    """
    sg = _div(_safe_amax(amax, BOUND), tl.full(amax.shape, BOUND, tl.float32))  # [R, 1, 1]
    a = tl.where(block_amax != block_amax, 0.0, block_amax)
    t = _div(_div(a, tl.full(a.shape, 6.0, tl.float32)), sg)
    t = tl.where(t > 0.0, t, 0.0)  # zero, negative: +0.0
    if HW_CVT:
        sb = _hw_round_fp8(t, False)  # saturates an Inf at 448
    else:
        t = tl.where(t > 448.0, 448.0, t)
        sb = _round_mag(t, 3, -6, 8, LEAN)
    s = _with_sign_of(sb, t) * sg  # the magic-number rounding turns -0.0 into +0.0: its sign goes back on
    ax = tl.abs(x)
    y = _e2m1_scaled(x, ax, s, NATIVE_DIV, LEAN)
    s_b = tl.broadcast_to(s, x.shape)
    return tl.where(s_b != 0.0, y, (x * 0.0) * s_b)


@triton.jit
def static_blocks_clipped_grad(g, x, block_amax):
    """Clipped STE of static block scales: ``g`` where ``|x|`` is at most its block's amax, else ``g * 0`` (keeps a
    NaN or turns an Inf into NaN, as the reference's ``grad * mask``); a NaN block amax clips its whole block."""
    a = tl.broadcast_to(block_amax, x.shape)
    return tl.where(tl.abs(x) <= a, g, g * 0.0)


@triton.jit
def fake_quant_tile(x, amax, FAMILY: tl.constexpr, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                    EMAX: tl.constexpr, INT_BLOCK: tl.constexpr, NATIVE_DIV: tl.constexpr = False,
                    HW_CVT: tl.constexpr = False, LEAN: tl.constexpr = False, FAST_MAX: tl.constexpr = False,
                    NARROW: tl.constexpr = True):
    """Fake-quantizes a fp32 tile ``x`` [R, NB, BS] exactly as formats.fake_quant.

    ``amax`` is fp32 [R, 1, 1] (per row: expert or channel). The format arrives as its ``KernelSpec``'s constexprs:
    ``FAMILY`` (the tile routine), ``BOUND`` and, for float grids, ``MANT`` / ``EMIN`` / ``EMAX``. For two-level
    and block int formats the last axis of the tile is one quantization block. Same bits whatever the options (GPU
    only: ``HW_CVT``, ``FAST_MAX``): ``HW_CVT`` rounds to fp8 with the hardware converter, ``LEAN`` drops a clamp that
    saturation makes redundant, ``FAST_MAX`` takes the NVFP4 block max with the GPU's NaN-ignoring max. ``NARROW``
    (int formats): the symmetric range ``[-B, B]``; False: ``[-B-1, B]`` (integer.int_range).
    """
    if FAMILY == SCALED_FLOAT:
        out = _fp8_tile(x, amax, BOUND, MANT, EMIN, EMAX, NATIVE_DIV, HW_CVT, LEAN)
    elif FAMILY == SCALED_INT:
        out = _int_tile(x, amax, BOUND, INT_BLOCK, NATIVE_DIV, BOUND if NARROW else BOUND + 1.0)
    elif FAMILY == POWER_OF_TWO_BLOCKS:
        out = _mx_tile(x, BOUND, MANT, EMIN, EMAX, LEAN)
    elif FAMILY == TWO_LEVEL_E2M1_FOUR_OVER_SIX:
        out = _nvfp4_four_over_six_tile(x, amax, BOUND, NATIVE_DIV, HW_CVT, LEAN, FAST_MAX)
    else:
        out = _nvfp4_tile(x, amax, BOUND, NATIVE_DIV, HW_CVT, LEAN, FAST_MAX)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Weights: where a program's tile lies (the per-expert table), its amax; the clipped gradient
# ----------------------------------------------------------------------------------------------------------------
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
def tile_offsets(rows_n, cols_n, ctiles, t, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr,
                 TWO_D: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr = False):
    """Where local tile ``t`` of an expert of ``rows_n x cols_n`` (``ctiles`` column tiles) lies: (int64 start
    offset, int32 [TILE_R, TILE_NB, BS] offsets from it, mask, rows [TILE_R, 1, 1], row mask).

    Flat tiling walks the flattened expert in contiguous chunks of TILE_R * TILE_NB * BS elements; 2-D tiling walks
    the [rows, cols] matrix in [TILE_R, TILE_NB * BS] tiles (needed when the amax is per row). ``EVEN`` (the
    launcher's promise that every tile is full) makes the mask all-true; the caller then drops it.
    """
    r = tl.arange(0, TILE_R)[:, None, None]
    c = tl.arange(0, TILE_NB)[None, :, None] * BS + tl.arange(0, BS)[None, None, :]
    if TWO_D:
        tr = t // ctiles
        tc = t - tr * ctiles
        row0 = tr.to(tl.int64) * TILE_R
        col0 = tc * (TILE_NB * BS)
        start = row0 * cols_n + col0
        rows = row0 + r
        row_mask = rows < rows_n
        # The launcher guarantees cols_n % VEC == 0 whenever VEC > 1 (so each row starts aligned). The hints go after
        # the int32 cast (which drops them) and on the 1-D row offsets: a hint on the broadcast form ([VEC, 1, 1])
        # would say nothing along a row, and the loads and stores would be single elements.
        cols32 = tl.multiple_of(cols_n.to(tl.int32), VEC)
        row_off = tl.arange(0, TILE_R) * cols32
        local = tl.multiple_of(row_off, VEC)[:, None, None] + c
        if EVEN:
            mask = local >= 0  # unused
        else:
            # The row length as the hinted int32 (the offsets above are int32 too): a hint on the int64 cols_n that
            # the per-expert table gives is lost, and with it the 16-byte vectors of every non-uniform launch.
            mask = row_mask & ((col0 + c) < cols32)
    else:
        start = t.to(tl.int64) * (TILE_R * TILE_NB * BS)
        rows = r.to(tl.int64)  # unused
        row_mask = rows >= 0
        local = r * (TILE_NB * BS) + c
        if EVEN:
            mask = local >= 0  # unused
        else:
            mask = local < tl.multiple_of(rows_n * cols_n - start, VEC)
    return start, local, mask, rows, row_mask


@triton.jit
def locate_tile(table_ptr, pid, n_experts, u_tiles, u_rows, u_cols, u_ctiles, SEARCH_STEPS: tl.constexpr,
                UNIFORM: tl.constexpr):
    """(expert e (int64), its local tile, rows, cols, column tiles, output offset) of program/tile ``pid``.

    ``UNIFORM`` (all experts of one shape, ``u_tiles`` tiles each): e = pid // u_tiles and the geometry comes from
    the scalar arguments, so no table load precedes the data load but the expert's input offset. Otherwise a binary
    search over the table's cumulative tile counts.
    """
    if UNIFORM:
        e32 = pid // u_tiles
        t = pid - e32 * u_tiles
        e = e32.to(tl.int64)
        # int32 values (the launcher checks rows * cols < 2**31), made tensors: an argument equal to 1 arrives as
        # a constexpr.
        zero = tl.program_id(0) * 0
        rows_n = zero + u_rows
        cols_n = zero + u_cols
        ctiles = zero + u_ctiles
        out0 = e * u_rows * u_cols
    else:
        e = _find_expert(table_ptr, pid.to(tl.int64), n_experts, SEARCH_STEPS)
        t = pid.to(tl.int64) - tl.load(table_ptr + e * NCOL + COL_TILE0)
        rows_n = tl.load(table_ptr + e * NCOL + COL_ROWS)
        cols_n = tl.load(table_ptr + e * NCOL + COL_COLS)
        ctiles = tl.load(table_ptr + e * NCOL + COL_CTILES)
        out0 = tl.load(table_ptr + e * NCOL + COL_OUT)
    return e, t, rows_n, cols_n, ctiles, out0


@triton.jit
def load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE: tl.constexpr, amax_stride_e, TILE_R: tl.constexpr):
    """The amax as fp32 [TILE_R, 1, 1]: 1 = one value per expert (stride amax_stride_e; 0 = shared), 2 = per row."""
    zero = tl.zeros([TILE_R, 1, 1], dtype=tl.float32)
    if AMAX_MODE == 2:
        a = tl.load(amax_ptr + e * amax_stride_e + rows, mask=row_mask, other=1.0).to(tl.float32)
    elif AMAX_MODE == 1:
        a = zero + tl.load(amax_ptr + e * amax_stride_e).to(tl.float32)
    else:
        a = zero + 1.0  # unused (block int formats take their amax from the data)
    return a


@triton.jit
def clipped_grad(g, x, a):
    """Clipped STE: ``g`` where ``|x| <= a``, else 0 (``g * 0`` keeps g's NaN); an invalid amax (<= 2**-24, NaN, Inf:
    the comparisons are false for NaN) clips nothing."""
    limit = tl.where((a > TINY_AMAX) & (a <= FP32_MAX), a, float("inf"))
    return tl.where(tl.abs(x) <= limit, g, g * 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Tokens: x [T, K] split into N row groups by a device m_splits
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr,
             TILE_R: tl.constexpr):
    """The amax [TILE_R, 1, 1] for token rows ``rows`` [TILE_R]: their expert's, found from m_splits on the device."""
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
def input_tile(n_rows, n_cols, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr):
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
