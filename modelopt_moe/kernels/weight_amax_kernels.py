"""``@triton.jit`` kernel of :mod:`.weight_amax`: the NaN-ignoring ``max |w|`` of every expert (or of every row of
every expert), for ``weight_amax_update: dynamic``. Each program reduces its tile and merges it with ``atomic_max``: a
maximum does not depend on the order in which tiles arrive, so the result is exact and deterministic. Imported lazily,
on the first launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_kernels import COL_IN, NCOL, locate_tile, tile_offsets, to_fp32


@triton.jit
def grouped_weight_amax_kernel(
    in_base, out_ptr, table_ptr, n_experts, u_tiles, u_rows, u_cols, u_ctiles,
    PER_ROW: tl.constexpr, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, UNIFORM: tl.constexpr,
):
    """Reduces one tile of one expert's weight to its NaN-ignoring ``max |w|`` (per row with ``PER_ROW``) and merges it
    into ``out_ptr`` with ``atomic_max``."""
    # int64 offsets as in the fake-quant kernel; out is [N] (per expert) or [N, rows] (PER_ROW, 2-D tiles).
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, tl.program_id(0), n_experts, u_tiles, u_rows,
                                                     u_cols, u_ctiles, SEARCH_STEPS, UNIFORM)
    start, local, mask, rows, row_mask = tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, PER_ROW, VEC)
    in_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)  # 16-byte vectors when VEC > 1
    a = tl.abs(to_fp32(tl.load(in_base + in_off + local, mask=mask, other=0.0)))
    a = tl.where(a != a, 0.0, a)  # NaN ignored, like nan_ignoring_abs_max; |x| >= +0.0 so the max is never -0.0
    if PER_ROW:
        m = tl.max(tl.max(a, axis=2, keep_dims=True), axis=1, keep_dims=True)  # [TILE_R, 1, 1]
        tl.atomic_max(out_ptr + e * rows_n + rows, m, mask=row_mask)
    else:
        tl.atomic_max(out_ptr + e, tl.max(a))
