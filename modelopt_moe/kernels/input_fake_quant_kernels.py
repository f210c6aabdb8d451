"""``@triton.jit`` kernels of :mod:`.input_fake_quant`: the fake quant of tokens ``x`` [T, K] split into N row groups
by a device ``m_splits`` (optionally times a per-row scale), and its clipped straight-through gradient, in one launch
each. Imported lazily, on the first launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_kernels import clipped_grad, fake_quant_tile, input_tile, row_amax, to_fp32, to_out_dtype


@triton.jit
def _scale_rows(v, scale_ptr, rows, n_rows, OUT_DTYPE: tl.constexpr, BITWISE_CVT: tl.constexpr):
    """``numerics.scale_rows`` of a fp32 tile ``v`` [TILE_R, NB, BS]: ``v`` rounded to OUT_DTYPE (the operand's
    value), times its row's scale in fp32 (the caller rounds the product to OUT_DTYPE)."""
    s = to_fp32(tl.load(scale_ptr + rows, mask=rows < n_rows, other=0.0))
    return to_fp32(to_out_dtype(v, OUT_DTYPE, BITWISE_CVT)) * s[:, None, None]


@triton.jit
def grouped_input_fake_quant_kernel(
    x_ptr, y_ptr, m_splits_ptr, amax_ptr, scale_ptr, n_rows, n_cols, n_experts,
    FAMILY: tl.constexpr, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    INT_BLOCK: tl.constexpr, PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, BITWISE_CVT: tl.constexpr,
    NARROW: tl.constexpr = True, HW_CVT: tl.constexpr = False, LEAN: tl.constexpr = False,
    FAST_MAX: tl.constexpr = False, HAS_SCALE: tl.constexpr = False,
):
    """Fake-quantizes one tile of token rows with each row's expert amax (found from ``m_splits`` on the device)."""
    # HAS_SCALE: each output row times its row scale (the router probability of the down projection's input), in
    # the same pass; scale_ptr is not read otherwise.
    start, local, mask, rows = input_tile(n_rows, n_cols, TILE_R, TILE_NB, BS)
    x = to_fp32(tl.load(x_ptr + start + local, mask=mask, other=0.0))
    a = row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT, N_PAD, TILE_R)
    y = fake_quant_tile(x, a, FAMILY, BOUND, MANT, EMIN, EMAX, INT_BLOCK, False, HW_CVT, LEAN, FAST_MAX, NARROW)
    if HAS_SCALE:
        y = _scale_rows(y, scale_ptr, rows, n_rows, y_ptr.dtype.element_ty, BITWISE_CVT)
    tl.store(y_ptr + start + local, to_out_dtype(y, y_ptr.dtype.element_ty, BITWISE_CVT), mask=mask)


@triton.jit
def grouped_input_clip_grad_kernel(
    g_ptr, x_ptr, out_ptr, m_splits_ptr, amax_ptr, scale_ptr, n_rows, n_cols, n_experts,
    PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr,
    BITWISE_CVT: tl.constexpr, HAS_SCALE: tl.constexpr = False,
):
    """The clipped straight-through gradient of one tile of token rows: ``grad * (|x| <= amax of the row's expert)``."""
    # HAS_SCALE: the incoming gradient is first multiplied by its row scale (the backward of numerics.scale_rows).
    start, local, mask, rows = input_tile(n_rows, n_cols, TILE_R, TILE_NB, BS)
    g = to_fp32(tl.load(g_ptr + start + local, mask=mask, other=0.0))
    if HAS_SCALE:
        g = to_fp32(to_out_dtype(_scale_rows(g, scale_ptr, rows, n_rows, out_ptr.dtype.element_ty, BITWISE_CVT),
                                 out_ptr.dtype.element_ty, BITWISE_CVT))
    x = to_fp32(tl.load(x_ptr + start + local, mask=mask, other=0.0))
    a = row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT, N_PAD, TILE_R)
    y = clipped_grad(g, x, a)
    tl.store(out_ptr + start + local, to_out_dtype(y, out_ptr.dtype.element_ty, BITWISE_CVT), mask=mask)
