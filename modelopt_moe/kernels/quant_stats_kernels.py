"""``@triton.jit`` kernels of :mod:`.quant_stats`: the fake quant of :mod:`.weight_fake_quant_kernels` and
:mod:`.input_fake_quant_kernels` (same tile code, same bits) that also writes, per tile (weights) or per token row and
column tile (inputs), the four sums precision autoswitch needs: non-zero elements, those that quantize to zero
(underflow), the squared error and the squared input (NaN elements excluded). Counts are exact (a tile holds at most
4096 elements); the launchers add the partial sums per expert in float64. Imported lazily, on the first launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_kernels import (
    COL_IN,
    NCOL,
    fake_quant_tile,
    input_tile,
    load_amax_rows,
    locate_tile,
    row_amax,
    tile_offsets,
    to_fp32,
    to_out_dtype,
)


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
def grouped_weight_fake_quant_stats_kernel(
    in_base, out_ptr, stats_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e, u_tiles, u_rows, u_cols, u_ctiles,
    FAMILY: tl.constexpr, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    INT_BLOCK: tl.constexpr, AMAX_MODE: tl.constexpr, TWO_D: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BITWISE_CVT: tl.constexpr, UNIFORM: tl.constexpr, NARROW: tl.constexpr = True,
):
    """Fake-quantizes one tile of one expert's weight, as the weight fake-quant kernel does, and writes the tile's four
    sums to ``stats_ptr[pid]``."""
    pid = tl.program_id(0)
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, pid, n_experts, u_tiles, u_rows, u_cols, u_ctiles,
                                                     SEARCH_STEPS, UNIFORM)
    start, local, mask, rows, row_mask = tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, TWO_D, VEC)
    # The alignment hints of the weight fake-quant kernel (the same plan's promise): 16-byte vectors when VEC > 1.
    in_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)
    out_off = tl.multiple_of(out0 + start, VEC)
    x = to_fp32(tl.load(in_base + in_off + local, mask=mask, other=0.0))
    a = load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE, amax_stride_e, TILE_R)
    y = fake_quant_tile(x, a, FAMILY, BOUND, MANT, EMIN, EMAX, INT_BLOCK, NARROW=NARROW)
    y = to_out_dtype(y, out_ptr.dtype.element_ty, BITWISE_CVT)
    tl.store(out_ptr + out_off + local, y, mask=mask)
    # Statistics of the operand the GEMM reads: the output in its own dtype against the input.
    nz, uf, se, ss = _tile_stats(x, to_fp32(y), mask)
    tl.store(stats_ptr + pid * 4 + 0, tl.sum(nz))
    tl.store(stats_ptr + pid * 4 + 1, tl.sum(uf))
    tl.store(stats_ptr + pid * 4 + 2, tl.sum(se))
    tl.store(stats_ptr + pid * 4 + 3, tl.sum(ss))


@triton.jit
def grouped_input_fake_quant_stats_kernel(
    x_ptr, y_ptr, stats_ptr, m_splits_ptr, amax_ptr, n_rows, n_cols, n_experts, n_ctiles,
    FAMILY: tl.constexpr, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    INT_BLOCK: tl.constexpr, PER_EXPERT: tl.constexpr, N_PAD: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, BITWISE_CVT: tl.constexpr,
    NARROW: tl.constexpr = True,
):
    """Fake-quantizes one tile of token rows, as the input fake-quant kernel does, and writes the four sums of each of
    its rows."""
    start, local, mask, rows = input_tile(n_rows, n_cols, TILE_R, TILE_NB, BS)
    x = to_fp32(tl.load(x_ptr + start + local, mask=mask, other=0.0))
    a = row_amax(m_splits_ptr, amax_ptr, rows, n_experts, PER_EXPERT, N_PAD, TILE_R)
    y = fake_quant_tile(x, a, FAMILY, BOUND, MANT, EMIN, EMAX, INT_BLOCK, NARROW=NARROW)
    y = to_out_dtype(y, y_ptr.dtype.element_ty, BITWISE_CVT)
    tl.store(y_ptr + start + local, y, mask=mask)
    # One partial per token row and column tile ([T, n_ctiles, 4]): a tile's rows may belong to two experts.
    nz, uf, se, ss = _tile_stats(x, to_fp32(y), mask)
    base = stats_ptr + (rows * n_ctiles + tl.program_id(1)) * 4
    row_ok = rows < n_rows
    tl.store(base + 0, nz, mask=row_ok)
    tl.store(base + 1, uf, mask=row_ok)
    tl.store(base + 2, se, mask=row_ok)
    tl.store(base + 3, ss, mask=row_ok)
