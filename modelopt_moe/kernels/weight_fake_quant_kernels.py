"""``@triton.jit`` kernels of :mod:`.weight_fake_quant` (the fake quant of N expert weights, and its clipped
straight-through gradient) and of :mod:`.static_blocks_fake_quant` (the same with static NVFP4 block scales), in one
launch each. Imported lazily, on the first launch.

One program per tile; the tiles of all experts form one flat grid (ragged experts waste nothing), and a program finds
its expert through the per-expert table (:mod:`.launch`), or by division when all experts share a shape.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_kernels import (
    COL_AUX,
    COL_IN,
    NCOL,
    clipped_grad,
    fake_quant_tile,
    load_amax_rows,
    locate_tile,
    static_blocks_clipped_grad,
    static_nvfp4_tile,
    tile_offsets,
    to_fp32,
    to_out_dtype,
)


@triton.jit
def _load_weight_tile(in_base, table_ptr, e, out0, start, local, mask, VEC: tl.constexpr, EVEN: tl.constexpr):
    """A flat tile of expert ``e``'s weight as fp32, and the tile's output offset (int64; unmasked when ``EVEN``)."""
    in_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)
    out_off = tl.multiple_of(out0 + start, VEC)
    if EVEN:
        x = to_fp32(tl.load(in_base + in_off + local))
    else:
        x = to_fp32(tl.load(in_base + in_off + local, mask=mask, other=0.0))
    return x, out_off


@triton.jit
def _store_tile(out_ptr, out_off, local, mask, y, BITWISE_CVT: tl.constexpr, EVEN: tl.constexpr):
    """Stores a fake-quantized tile in the output's dtype (unmasked when ``EVEN``)."""
    if EVEN:
        tl.store(out_ptr + out_off + local, to_out_dtype(y, out_ptr.dtype.element_ty, BITWISE_CVT))
    else:
        tl.store(out_ptr + out_off + local, to_out_dtype(y, out_ptr.dtype.element_ty, BITWISE_CVT), mask=mask)


@triton.jit
def _load_grad_and_weight_tile(g_base, w_base, table_ptr, e, out0, start, local, mask, VEC: tl.constexpr):
    """A flat tile of expert ``e``'s gradient and of its weight (the table's aux column) as fp32, and the tile's
    output offset: what the clipped straight-through kernels read."""
    g_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)
    w_off = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_AUX) + start, VEC)
    out_off = tl.multiple_of(out0 + start, VEC)
    g = to_fp32(tl.load(g_base + g_off + local, mask=mask, other=0.0))
    w = to_fp32(tl.load(w_base + w_off + local, mask=mask, other=0.0))
    return g, w, out_off


@triton.jit
def _weight_fake_quant_tile(
    pid, in_base, out_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e, u_tiles, u_rows, u_cols, u_ctiles,
    FAMILY: tl.constexpr, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    INT_BLOCK: tl.constexpr, AMAX_MODE: tl.constexpr, TWO_D: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BITWISE_CVT: tl.constexpr, UNIFORM: tl.constexpr, EVEN: tl.constexpr,
    HW_CVT: tl.constexpr, LEAN: tl.constexpr, FAST_MAX: tl.constexpr, NARROW: tl.constexpr = True,
):
    # Offsets are int64: the concatenated output (and a weight's distance from the base pointer) can exceed 2**31
    # elements; only the in-tile offsets are int32.
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, pid, n_experts, u_tiles, u_rows, u_cols, u_ctiles,
                                                     SEARCH_STEPS, UNIFORM)
    start, local, mask, rows, row_mask = tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, TWO_D, VEC,
                                                      EVEN)
    x, out_off = _load_weight_tile(in_base, table_ptr, e, out0, start, local, mask, VEC, EVEN)
    a = load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE, amax_stride_e, TILE_R)
    y = fake_quant_tile(x, a, FAMILY, BOUND, MANT, EMIN, EMAX, INT_BLOCK, False, HW_CVT, LEAN, FAST_MAX, NARROW)
    _store_tile(out_ptr, out_off, local, mask, y, BITWISE_CVT, EVEN)


@triton.jit
def grouped_weight_fake_quant_kernel(
    in_base, out_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e, u_tiles, u_rows, u_cols, u_ctiles,
    FAMILY: tl.constexpr, BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    INT_BLOCK: tl.constexpr, AMAX_MODE: tl.constexpr, TWO_D: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BITWISE_CVT: tl.constexpr, UNIFORM: tl.constexpr = False,
    EVEN: tl.constexpr = False, HW_CVT: tl.constexpr = False, LEAN: tl.constexpr = False,
    FAST_MAX: tl.constexpr = False, NARROW: tl.constexpr = True,
):
    """Fake-quantizes one tile of one expert's weight (the program's tile of the flat grid) with the expert's amax."""
    # One program per tile; the tiles of all experts form one flat grid, so ragged experts waste nothing. (A
    # persistent grid-stride loop over the tiles was measured slower on an H200: docs/benchmarks.md.)
    _weight_fake_quant_tile(
        tl.program_id(0), in_base, out_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e, u_tiles, u_rows,
        u_cols, u_ctiles, FAMILY, BOUND, MANT, EMIN, EMAX, INT_BLOCK, AMAX_MODE, TWO_D, TILE_R, TILE_NB, BS, VEC,
        SEARCH_STEPS, BITWISE_CVT, UNIFORM, EVEN, HW_CVT, LEAN, FAST_MAX, NARROW)


@triton.jit
def grouped_weight_clip_grad_kernel(
    g_base, w_base, out_ptr, table_ptr, amax_ptr, n_experts, amax_stride_e,
    AMAX_MODE: tl.constexpr, TWO_D: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BITWISE_CVT: tl.constexpr,
):
    """The clipped straight-through gradient of one tile of one expert's weight: ``grad * (|w| <= amax)``."""
    # Clipped STE: grad * (|w| <= amax); an invalid amax clips nothing. int64 offsets as above.
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, tl.program_id(0), n_experts, 0, 0, 0, 0,
                                                     SEARCH_STEPS, False)
    start, local, mask, rows, row_mask = tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, TWO_D, VEC)
    g, w, out_off = _load_grad_and_weight_tile(g_base, w_base, table_ptr, e, out0, start, local, mask, VEC)
    a = load_amax_rows(amax_ptr, e, rows, row_mask, AMAX_MODE, amax_stride_e, TILE_R)
    y = clipped_grad(g, w, a)
    _store_tile(out_ptr, out_off, local, mask, y, BITWISE_CVT, False)


@triton.jit
def _tile_block_amax(block_ptr, out0, start, rows_n, cols_n, TILE_R: tl.constexpr, TILE_NB: tl.constexpr,
                     BS: tl.constexpr):
    """The static block amaxes [TILE_R, TILE_NB, 1] of a flat tile: the blocks follow the weights' elements (the
    table is ``[..., K // BS]`` per expert, experts in order), so a tile at output offset ``out0 + start`` starts at
    block ``(out0 + start) // BS``; blocks past the expert's end are masked."""
    blocal = tl.arange(0, TILE_R)[:, None, None] * TILE_NB + tl.arange(0, TILE_NB)[None, :, None]
    bmask = blocal * BS < rows_n * cols_n - start
    b0 = (out0 + start) // BS  # int64
    return to_fp32(tl.load(block_ptr + b0 + blocal, mask=bmask, other=0.0))


@triton.jit
def grouped_static_blocks_fake_quant_kernel(
    in_base, out_ptr, table_ptr, amax_ptr, block_ptr, n_experts, amax_stride_e, u_tiles, u_rows, u_cols, u_ctiles,
    BOUND: tl.constexpr, TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BITWISE_CVT: tl.constexpr, UNIFORM: tl.constexpr = False,
    EVEN: tl.constexpr = False, HW_CVT: tl.constexpr = False, LEAN: tl.constexpr = False,
):
    """Fake-quantizes one flat tile of one expert's weight with static NVFP4 block scales: the expert's second-level
    amax and each block's own amax."""
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, tl.program_id(0), n_experts, u_tiles, u_rows,
                                                     u_cols, u_ctiles, SEARCH_STEPS, UNIFORM)
    start, local, mask, rows, row_mask = tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, False, VEC,
                                                      EVEN)
    x, out_off = _load_weight_tile(in_base, table_ptr, e, out0, start, local, mask, VEC, EVEN)
    a = load_amax_rows(amax_ptr, e, rows, row_mask, 1, amax_stride_e, TILE_R)
    blocks = _tile_block_amax(block_ptr, out0, start, rows_n, cols_n, TILE_R, TILE_NB, BS)
    y = static_nvfp4_tile(x, a, blocks, BOUND, False, HW_CVT, LEAN)
    _store_tile(out_ptr, out_off, local, mask, y, BITWISE_CVT, EVEN)


@triton.jit
def grouped_static_blocks_clip_grad_kernel(
    g_base, w_base, out_ptr, table_ptr, block_ptr, n_experts,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, VEC: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BITWISE_CVT: tl.constexpr,
):
    """The clipped straight-through gradient of static block scales for one flat tile: ``grad`` where ``|w|`` is at
    most its block's amax, else ``grad * 0``."""
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, tl.program_id(0), n_experts, 0, 0, 0, 0,
                                                     SEARCH_STEPS, False)
    start, local, mask, rows, row_mask = tile_offsets(rows_n, cols_n, ctiles, t, TILE_R, TILE_NB, BS, False, VEC)
    g, w, out_off = _load_grad_and_weight_tile(g_base, w_base, table_ptr, e, out0, start, local, mask, VEC)
    blocks = _tile_block_amax(block_ptr, out0, start, rows_n, cols_n, TILE_R, TILE_NB, BS)
    y = static_blocks_clipped_grad(g, w, blocks)
    _store_tile(out_ptr, out_off, local, mask, y, BITWISE_CVT, False)
