"""``@triton.jit`` kernels of :mod:`.fp8_block_fake_quant`: FP8 in blocks whose amax comes from the data, bit-exact with
:func:`modelopt_moe.numerics.fake_quant`. Imported lazily, on the first launch.

* :func:`grouped_weight_block2d_kernel`: 2-D blocks ``BR x BC`` of N expert weights in one launch, one program per
  block of the flat grid of all experts' blocks (found through the per-expert table of :mod:`.launch`). A block's
  amax needs all its elements before any output, so the program reads the block twice in ``CHUNK``-row slices (the
  max, then the quantized values; the second read mostly hits L2) instead of holding ``BR * BC`` values in registers
  (two runtime loops, which the compiler cannot merge into one read).
* :func:`token_groups_kernel`: groups of ``BS`` consecutive elements of each row of a token matrix (every group its
  own amax; independent of the expert a row belongs to).

Partial blocks load as zeros (the reference's zero padding) and are stored masked. The per-block arithmetic is the
per-tensor FP8 tile routine (:func:`.tile_kernels.fake_quant_tile`'s ``SCALED_FLOAT``) with the block's amax.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_kernels import COL_IN, NCOL, _fp8_tile, input_tile, locate_tile, to_fp32, to_out_dtype


@triton.jit
def _nan_free_abs(x):
    ax = tl.abs(x)
    return tl.where(ax != ax, 0.0, ax)


@triton.jit
def grouped_weight_block2d_kernel(
    in_base, out_ptr, table_ptr, n_experts,
    BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BITWISE_CVT: tl.constexpr, VEC: tl.constexpr = 1, HW_CVT: tl.constexpr = False,
):
    """Fake-quantizes one ``BR x BC`` block of one expert's ``[rows, cols]`` weight with the block's own amax.

    ``VEC > 1`` is the launcher's promise that every expert's start (in and out) and row length are multiples of
    ``VEC`` elements (16 bytes): the hints then keep loads and stores 16-byte vectors.
    """
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, tl.program_id(0), n_experts, 0, 0, 0, 0,
                                                     SEARCH_STEPS, False)
    tr = t // ctiles
    tc = t - tr * ctiles
    # int64 offsets: the concatenated output (and a weight's distance from the base) can exceed 2**31 elements.
    row0 = tr.to(tl.int64) * BR
    col0 = tc * BC
    cols_v = tl.multiple_of(cols_n, VEC)
    start = tl.multiple_of(row0 * cols_v + col0, VEC)
    in0 = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)
    o0 = tl.multiple_of(out0 + start, VEC)
    r = tl.arange(0, CHUNK)[:, None]
    c = tl.arange(0, BC)[None, :]
    col_ok = (col0 + c) < cols_v
    if CHUNK >= BR:  # the whole block at once: one read
        off = tl.multiple_of(r * cols_v.to(tl.int32), [VEC, 1]) + c
        mask = (row0 + r < rows_n) & col_ok
        x = to_fp32(tl.load(in_base + in0 + off, mask=mask, other=0.0))
        amax = tl.max(tl.max(_nan_free_abs(x), axis=1, keep_dims=True), axis=0, keep_dims=True)
        y = _fp8_tile(x, amax, BOUND, MANT, EMIN, EMAX, False, HW_CVT)
        tl.store(out_ptr + o0 + off, to_out_dtype(y, out_ptr.dtype.element_ty, BITWISE_CVT), mask=mask)
        return
    amax = tl.zeros([1, 1], dtype=tl.float32)
    # Loops, not static_range: unrolled, the compiler merges the two passes' identical loads and keeps the whole
    # block in registers (255 registers and spills, an eighth of copy bandwidth on an H100).
    for r0 in range(0, BR, CHUNK):
        off = tl.multiple_of((r0 + r) * cols_v.to(tl.int32), [VEC, 1]) + c
        mask = (row0 + r0 + r < rows_n) & col_ok
        x = to_fp32(tl.load(in_base + in0 + off, mask=mask, other=0.0))
        m = tl.max(tl.max(_nan_free_abs(x), axis=1, keep_dims=True), axis=0, keep_dims=True)
        amax = tl.where(m > amax, m, amax)
    for r0 in range(0, BR, CHUNK):
        off = tl.multiple_of((r0 + r) * cols_v.to(tl.int32), [VEC, 1]) + c
        mask = (row0 + r0 + r < rows_n) & col_ok
        x = to_fp32(tl.load(in_base + in0 + off, mask=mask, other=0.0))
        y = _fp8_tile(x, amax, BOUND, MANT, EMIN, EMAX, False, HW_CVT)
        tl.store(out_ptr + o0 + off, to_out_dtype(y, out_ptr.dtype.element_ty, BITWISE_CVT), mask=mask)


@triton.jit
def token_groups_kernel(
    x_ptr, out_ptr, n_rows, n_cols,
    BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    TILE_R: tl.constexpr, TILE_NB: tl.constexpr, BS: tl.constexpr, BITWISE_CVT: tl.constexpr,
):
    """Fake-quantizes a ``[TILE_R, TILE_NB * BS]`` tile of tokens, every group of ``BS`` with its own amax."""
    start, local, mask, rows = input_tile(n_rows, n_cols, TILE_R, TILE_NB, BS)
    x = to_fp32(tl.load(x_ptr + start + local, mask=mask, other=0.0))
    amax = tl.max(_nan_free_abs(x), axis=2, keep_dims=True)  # [TILE_R, TILE_NB, 1]
    y = _fp8_tile(x, amax, BOUND, MANT, EMIN, EMAX, False)
    tl.store(out_ptr + start + local, to_out_dtype(y, out_ptr.dtype.element_ty, BITWISE_CVT), mask=mask)
