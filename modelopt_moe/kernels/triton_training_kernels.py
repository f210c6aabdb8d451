"""Triton kernels for training-time statistics of N experts in one launch; private, imported lazily.

Only ``@triton.jit`` code, built on the tile helpers of :mod:`.triton_kernels` (same tiling, same exact arithmetic):

* ``_grouped_weight_amax_kernel``: the NaN-ignoring ``max |w|`` of every expert (or of every row of every expert),
  for ``weight_amax_update: dynamic``. Each program reduces its tile and merges it with ``atomic_max``: a maximum does
  not depend on the order in which tiles arrive, so the result is exact and deterministic.
* ``_grouped_weight_fake_quant_stats_kernel`` / ``_grouped_input_fake_quant_stats_kernel``: the fake quant of
  :mod:`.triton_kernels` (same bits) that also writes, per tile (weights) or per token row and column tile (inputs),
  the four sums precision autoswitch needs: non-zero elements, those that quantize to zero (underflow), the squared
  error and the squared input (NaN elements excluded). Counts are exact (a tile holds at most 4096 elements); the
  launchers add the partial sums per expert in float64.

The launchers, custom ops and torch references live in :mod:`.grouped_training_stats`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import (
    COL_IN,
    NCOL,
    _fake_quant_tile,
    _input_tile,
    _load_amax_rows,
    _locate_tile,
    _row_amax,
    _tile_offsets,
    _to_fp32,
    _to_out_dtype,
)


@triton.jit
def _grouped_weight_amax_kernel(
    in_base, out_ptr, table_ptr, n_experts, u_tiles, u_rows, u_cols, u_ctiles,
    PER_ROW: tl.constexpr, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, UNIFORM: tl.constexpr,
):
    # int64 offsets as in the fake-quant kernel; out is [N] (per expert) or [N, rows] (PER_ROW, 2-D tiles).
    e, t, rows_n, cols_n, ctiles, out0 = _locate_tile(table_ptr, tl.program_id(0), n_experts, u_tiles, u_rows,
                                                      u_cols, u_ctiles, SEARCH_STEPS, UNIFORM)
    start, local, mask, rows, row_mask = _tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, PER_ROW, VEC)
    in_off = tl.load(table_ptr + e * NCOL + COL_IN) + start
    a = tl.abs(_to_fp32(tl.load(in_base + in_off + local, mask=mask, other=0.0)))
    a = tl.where(a != a, 0.0, a)  # NaN ignored, like nan_ignoring_abs_max; |x| >= +0.0 so the max is never -0.0
    if PER_ROW:
        m = tl.max(tl.max(a, axis=2, keep_dims=True), axis=1, keep_dims=True)  # [TILE_R, 1, 1]
        tl.atomic_max(out_ptr + e * rows_n + rows, m, mask=row_mask)
    else:
        tl.atomic_max(out_ptr + e, tl.max(a))


@triton.jit
def _tile_stats(x, y, mask):
    """(non-zero, underflow, squared error, squared input) of a tile, summed over every axis but the first:
    [TILE_R] each. NaN inputs (and masked elements) count nowhere."""
    ok = mask & (x == x)
    nz = ok & (x != 0.0)
    uf = nz & (y == 0.0)
    d = tl.where(ok, y - x, 0.0)
    xx = tl.where(ok, x, 0.0)
    return (tl.sum(tl.sum(nz.to(tl.float32), axis=2), axis=1), tl.sum(tl.sum(uf.to(tl.float32), axis=2), axis=1),
            tl.sum(tl.sum(d * d, axis=2), axis=1), tl.sum(tl.sum(xx * xx, axis=2), axis=1))


@triton.jit
def _grouped_weight_fake_quant_stats_kernel(
    in_base, out_ptr, stats_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e, u_tiles, u_rows, u_cols, u_ctiles,
    FMT: tl.constexpr, INT_BLOCK: tl.constexpr, AMAX_MODE: tl.constexpr, TWO_D: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BITWISE_CVT: tl.constexpr, UNIFORM: tl.constexpr, NARROW: tl.constexpr = True,
):
    pid = tl.program_id(0)
    e, t, rows_n, cols_n, ctiles, out0 = _locate_tile(table_ptr, pid, n_experts, u_tiles, u_rows, u_cols, u_ctiles,
                                                      SEARCH_STEPS, UNIFORM)
    start, local, mask, rows, row_mask = _tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, TWO_D, VEC)
    in_off = tl.load(table_ptr + e * NCOL + COL_IN) + start
    x = _to_fp32(tl.load(in_base + in_off + local, mask=mask, other=0.0))
    a = _load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE, amax_stride_e, TILE_R)
    y = _to_out_dtype(_fake_quant_tile(x, a, FMT, INT_BLOCK, NARROW=NARROW), out_ptr.dtype.element_ty, BITWISE_CVT)
    tl.store(out_ptr + out0 + start + local, y, mask=mask)
    # Statistics of the operand the GEMM reads: the output in its own dtype against the input.
    nz, uf, se, ss = _tile_stats(x, _to_fp32(y), mask)
    tl.store(stats_ptr + pid * 4 + 0, tl.sum(nz))
    tl.store(stats_ptr + pid * 4 + 1, tl.sum(uf))
    tl.store(stats_ptr + pid * 4 + 2, tl.sum(se))
    tl.store(stats_ptr + pid * 4 + 3, tl.sum(ss))


@triton.jit
def _grouped_input_fake_quant_stats_kernel(
    x_ptr, y_ptr, stats_ptr, m_splits_ptr, amax_ptr, n_rows, n_cols, n_experts, n_ctiles,
    FMT: tl.constexpr, INT_BLOCK: tl.constexpr, PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, BITWISE_CVT: tl.constexpr,
    NARROW: tl.constexpr = True,
):
    start, local, mask, rows = _input_tile(n_rows, n_cols, TILE_R, TILE_NB, BS)
    x = _to_fp32(tl.load(x_ptr + start + local, mask=mask, other=0.0))
    a = _row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT, N_PAD, TILE_R)
    y = _to_out_dtype(_fake_quant_tile(x, a, FMT, INT_BLOCK, NARROW=NARROW), y_ptr.dtype.element_ty, BITWISE_CVT)
    tl.store(y_ptr + start + local, y, mask=mask)
    # One partial per token row and column tile ([T, n_ctiles, 4]): a tile's rows may belong to two experts.
    nz, uf, se, ss = _tile_stats(x, _to_fp32(y), mask)
    base = stats_ptr + (rows * n_ctiles + tl.program_id(1)) * 4
    row_ok = rows < n_rows
    tl.store(base + 0, nz, mask=row_ok)
    tl.store(base + 1, uf, mask=row_ok)
    tl.store(base + 2, se, mask=row_ok)
    tl.store(base + 3, ss, mask=row_ok)
