"""``@triton.jit`` kernels of :mod:`.fp8_block_fake_quant`: FP8 in blocks whose amax comes from the data, bit-exact with
:func:`modelopt_moe.numerics.fake_quant`. Imported lazily, on the first launch.

* :func:`grouped_weight_block2d_kernel`: 2-D blocks ``BR x BC`` of N expert weights in one launch, over the flat grid
  of all experts' blocks (found through the per-expert table of :mod:`.launch`, or by a division when the experts
  share one shape). A block's amax needs all its elements before any output. Two ways, chosen by ``CHUNK``: the
  whole block at once (one read from memory; ``BR * BC / (32 * num_warps)`` values per thread), or ``CHUNK``-row
  slices read twice (the max, then the quantized values) in two runtime loops, which the compiler cannot merge into
  one read. Either one program per block, or a persistent grid looping over blocks with software pipelining
  (``PERSISTENT``, ``STAGES``) or with the next block's values loaded by hand before this one is reduced
  (``PREFETCH``: the default launch, at copy bandwidth). :data:`.fp8_block_fake_quant.BLOCK2D_VARIANTS` names the
  combinations; all give the same bits.
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
def _load(ptr, mask, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    return x


@triton.jit
def _store(ptr, y, mask, BITWISE_CVT: tl.constexpr, EVEN: tl.constexpr):
    y = to_out_dtype(y, ptr.dtype.element_ty, BITWISE_CVT)
    if EVEN:
        tl.store(ptr, y)
    else:
        tl.store(ptr, y, mask=mask)


@triton.jit
def _block_geometry(table_ptr, n_experts, blk, u_tiles, u_rows, u_cols, u_ctiles, BR: tl.constexpr,
                    BC: tl.constexpr, SEARCH_STEPS: tl.constexpr, VEC: tl.constexpr, UNIFORM: tl.constexpr):
    """Where block ``blk`` of the flat grid of all experts' blocks lies: (input offset from the base, output offset,
    first row, first column, the expert's rows, its row length)."""
    e, t, rows_n, cols_n, ctiles, out0 = locate_tile(table_ptr, blk, n_experts, u_tiles, u_rows, u_cols, u_ctiles,
                                                     SEARCH_STEPS, UNIFORM)
    tr = t // ctiles
    tc = t - tr * ctiles
    # int64 offsets: the concatenated output (and a weight's distance from the base) can exceed 2**31 elements.
    row0 = tr.to(tl.int64) * BR
    col0 = tc * BC
    cols_v = tl.multiple_of(cols_n, VEC)
    start = tl.multiple_of(row0 * cols_v + col0, VEC)
    in0 = tl.multiple_of(tl.load(table_ptr + e * NCOL + COL_IN) + start, VEC)
    o0 = tl.multiple_of(out0 + start, VEC)
    return in0, o0, row0, col0, rows_n, cols_v


@triton.jit
def _rows_offsets(row0, col0, rows_n, cols_v, r0, CHUNK: tl.constexpr, BC: tl.constexpr, VEC: tl.constexpr):
    """(int32 offsets [CHUNK, BC] of rows ``r0 ..`` of a block from its start, their mask)."""
    r = r0 + tl.arange(0, CHUNK)
    c = tl.arange(0, BC)[None, :]
    # The hints after the int32 cast (which drops them) and on the 1-D row offsets: a hint on the broadcast 2-D form
    # ([VEC, 1]) would say nothing along a row, and the loads and stores would be single elements.
    cols32 = tl.multiple_of(cols_v.to(tl.int32), VEC)
    off = tl.multiple_of(r * cols32, VEC)[:, None] + c
    mask = (row0 + r < rows_n)[:, None] & ((col0 + c) < cols32)
    return off, mask


@triton.jit
def _block_max(x):
    return tl.max(tl.max(_nan_free_abs(x), axis=1, keep_dims=True), axis=0, keep_dims=True)


@triton.jit
def _one_block(
    in_base, out_ptr, table_ptr, n_experts, blk, u_tiles, u_rows, u_cols, u_ctiles,
    BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BITWISE_CVT: tl.constexpr, VEC: tl.constexpr, HW_CVT: tl.constexpr, UNIFORM: tl.constexpr, EVEN: tl.constexpr,
):
    """Fake-quantizes block ``blk`` of the flat grid of all experts' blocks with the block's own amax."""
    in0, o0, row0, col0, rows_n, cols_v = _block_geometry(table_ptr, n_experts, blk, u_tiles, u_rows, u_cols,
                                                          u_ctiles, BR, BC, SEARCH_STEPS, VEC, UNIFORM)
    if CHUNK >= BR:  # the whole block at once: one read
        off, mask = _rows_offsets(row0, col0, rows_n, cols_v, 0, BR, BC, VEC)
        x = to_fp32(_load(in_base + in0 + off, mask, EVEN))
        y = _fp8_tile(x, _block_max(x), BOUND, MANT, EMIN, EMAX, False, HW_CVT)
        _store(out_ptr + o0 + off, y, mask, BITWISE_CVT, EVEN)
    else:
        amax = tl.zeros([1, 1], dtype=tl.float32)
        # Loops, not static_range: unrolled, the compiler merges the two passes' identical loads and keeps the
        # whole block in registers (255 registers and spills, an eighth of copy bandwidth on an H100).
        for r0 in range(0, BR, CHUNK):
            off, mask = _rows_offsets(row0, col0, rows_n, cols_v, r0, CHUNK, BC, VEC)
            m = _block_max(to_fp32(_load(in_base + in0 + off, mask, EVEN)))
            amax = tl.where(m > amax, m, amax)
        for r0 in range(0, BR, CHUNK):
            off, mask = _rows_offsets(row0, col0, rows_n, cols_v, r0, CHUNK, BC, VEC)
            x = to_fp32(_load(in_base + in0 + off, mask, EVEN))
            y = _fp8_tile(x, amax, BOUND, MANT, EMIN, EMAX, False, HW_CVT)
            _store(out_ptr + o0 + off, y, mask, BITWISE_CVT, EVEN)


@triton.jit
def grouped_weight_block2d_kernel(
    in_base, out_ptr, table_ptr, n_experts, n_blocks, u_tiles, u_rows, u_cols, u_ctiles,
    BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BITWISE_CVT: tl.constexpr, VEC: tl.constexpr = 1, HW_CVT: tl.constexpr = False, UNIFORM: tl.constexpr = False,
    EVEN: tl.constexpr = False, PERSISTENT: tl.constexpr = False, STAGES: tl.constexpr = 1,
    PREFETCH: tl.constexpr = False,
):
    """Fake-quantizes ``BR x BC`` blocks of N experts' ``[rows, cols]`` weights, each with its own amax.

    One program per block, or (``PERSISTENT``) a grid of a few programs per SM, each looping over every
    ``num_programs``-th block with ``STAGES`` software-pipelining stages of the compiler's, or (``PREFETCH``, whole
    blocks) by hand: the next block's raw values are loaded into registers before this block is reduced and stored.
    ``VEC > 1`` is the launcher's promise that every expert's start (in and out) and row length are multiples of
    ``VEC`` elements (16 bytes): the hints then keep loads and stores 16-byte vectors. ``UNIFORM``: experts of one
    shape, ``u_tiles`` blocks each (the expert by a division, no table search); ``EVEN``: with it, every block full
    (no masks).
    """
    if PREFETCH:
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        in0, o0, row0, col0, rows_n, cols_v = _block_geometry(table_ptr, n_experts, pid, u_tiles, u_rows, u_cols,
                                                              u_ctiles, BR, BC, SEARCH_STEPS, VEC, UNIFORM)
        off, mask = _rows_offsets(row0, col0, rows_n, cols_v, 0, BR, BC, VEC)
        raw = _load(in_base + in0 + off, mask, EVEN)  # the launcher gives no program more than n_blocks
        for blk in tl.range(pid, n_blocks, step):
            nxt = tl.minimum(blk + step, n_blocks - 1)  # the last iteration re-reads a block it does not use
            n_in0, n_o0, n_row0, n_col0, n_rows, n_cols = _block_geometry(
                table_ptr, n_experts, pid * 0 + nxt, u_tiles, u_rows, u_cols, u_ctiles, BR, BC, SEARCH_STEPS, VEC,
                UNIFORM)
            n_off, n_mask = _rows_offsets(n_row0, n_col0, n_rows, n_cols, 0, BR, BC, VEC)
            raw_next = _load(in_base + n_in0 + n_off, n_mask, EVEN)
            x = to_fp32(raw)
            y = _fp8_tile(x, _block_max(x), BOUND, MANT, EMIN, EMAX, False, HW_CVT)
            off, mask = _rows_offsets(row0, col0, rows_n, cols_v, 0, BR, BC, VEC)
            _store(out_ptr + o0 + off, y, mask, BITWISE_CVT, EVEN)
            raw, o0, row0, col0, rows_n, cols_v = raw_next, n_o0, n_row0, n_col0, n_rows, n_cols
    elif PERSISTENT:
        zero = tl.program_id(0) * 0  # the interpreter's loop index is a Python int: made a tensor
        for blk in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
            _one_block(in_base, out_ptr, table_ptr, n_experts, zero + blk, u_tiles, u_rows, u_cols, u_ctiles,
                       BOUND, MANT, EMIN, EMAX, BR, BC, CHUNK, SEARCH_STEPS, BITWISE_CVT, VEC, HW_CVT, UNIFORM, EVEN)
    else:
        _one_block(in_base, out_ptr, table_ptr, n_experts, tl.program_id(0), u_tiles, u_rows, u_cols, u_ctiles,
                   BOUND, MANT, EMIN, EMAX, BR, BC, CHUNK, SEARCH_STEPS, BITWISE_CVT, VEC, HW_CVT, UNIFORM, EVEN)


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
