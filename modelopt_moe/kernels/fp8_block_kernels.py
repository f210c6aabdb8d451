"""``@triton.jit`` kernels of :mod:`.fp8_block_fake_quant`: FP8 in blocks whose amax comes from the data, bit-exact with
:func:`modelopt_moe.numerics.fake_quant`. Imported lazily, on the first launch.

* :func:`grouped_weight_block2d_kernel`: 2-D blocks ``BR x BC`` of N expert weights in one launch, over the flat grid
  of all experts' blocks (found through the per-expert table of :mod:`.launch`, or by a division when the experts
  share one shape). A block's amax needs all its elements before any output. Two ways, chosen by ``CHUNK``: the
  whole block at once (one read from memory; ``BR * BC / (32 * num_warps)`` values per thread), or ``CHUNK``-row
  slices read twice (the max, then the quantized values; the second read mostly hits L2) in two runtime loops, which
  the compiler cannot merge into one read. Either one program per block, or a persistent grid looping over blocks
  with software pipelining (``PERSISTENT``, ``STAGES``). :data:`.fp8_block_fake_quant.BLOCK2D_VARIANTS` names the
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
def _load_fp32(ptr, mask, EVEN: tl.constexpr):
    if EVEN:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    return to_fp32(x)


@triton.jit
def _store(ptr, y, mask, BITWISE_CVT: tl.constexpr, EVEN: tl.constexpr):
    y = to_out_dtype(y, ptr.dtype.element_ty, BITWISE_CVT)
    if EVEN:
        tl.store(ptr, y)
    else:
        tl.store(ptr, y, mask=mask)


@triton.jit
def _one_block(
    in_base, out_ptr, table_ptr, n_experts, blk, u_tiles, u_rows, u_cols, u_ctiles,
    BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BITWISE_CVT: tl.constexpr, VEC: tl.constexpr, HW_CVT: tl.constexpr, UNIFORM: tl.constexpr, EVEN: tl.constexpr,
):
    """Fake-quantizes block ``blk`` of the flat grid of all experts' blocks with the block's own amax."""
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
    r = tl.arange(0, CHUNK)[:, None]
    c = tl.arange(0, BC)[None, :]
    col_ok = (col0 + c) < cols_v
    if CHUNK >= BR:  # the whole block at once: one read
        off = tl.multiple_of(r * cols_v.to(tl.int32), [VEC, 1]) + c
        mask = (row0 + r < rows_n) & col_ok
        x = _load_fp32(in_base + in0 + off, mask, EVEN)
        amax = tl.max(tl.max(_nan_free_abs(x), axis=1, keep_dims=True), axis=0, keep_dims=True)
        y = _fp8_tile(x, amax, BOUND, MANT, EMIN, EMAX, False, HW_CVT)
        _store(out_ptr + o0 + off, y, mask, BITWISE_CVT, EVEN)
    else:
        amax = tl.zeros([1, 1], dtype=tl.float32)
        # Loops, not static_range: unrolled, the compiler merges the two passes' identical loads and keeps the
        # whole block in registers (255 registers and spills, an eighth of copy bandwidth on an H100).
        for r0 in range(0, BR, CHUNK):
            off = tl.multiple_of((r0 + r) * cols_v.to(tl.int32), [VEC, 1]) + c
            mask = (row0 + r0 + r < rows_n) & col_ok
            x = _load_fp32(in_base + in0 + off, mask, EVEN)
            m = tl.max(tl.max(_nan_free_abs(x), axis=1, keep_dims=True), axis=0, keep_dims=True)
            amax = tl.where(m > amax, m, amax)
        for r0 in range(0, BR, CHUNK):
            off = tl.multiple_of((r0 + r) * cols_v.to(tl.int32), [VEC, 1]) + c
            mask = (row0 + r0 + r < rows_n) & col_ok
            x = _load_fp32(in_base + in0 + off, mask, EVEN)
            y = _fp8_tile(x, amax, BOUND, MANT, EMIN, EMAX, False, HW_CVT)
            _store(out_ptr + o0 + off, y, mask, BITWISE_CVT, EVEN)


@triton.jit
def grouped_weight_block2d_kernel(
    in_base, out_ptr, table_ptr, n_experts, n_blocks, u_tiles, u_rows, u_cols, u_ctiles,
    BOUND: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BITWISE_CVT: tl.constexpr, VEC: tl.constexpr = 1, HW_CVT: tl.constexpr = False, UNIFORM: tl.constexpr = False,
    EVEN: tl.constexpr = False, PERSISTENT: tl.constexpr = False, STAGES: tl.constexpr = 1,
):
    """Fake-quantizes ``BR x BC`` blocks of N experts' ``[rows, cols]`` weights, each with its own amax.

    One program per block, or (``PERSISTENT``) a grid of a few programs per SM, each looping over every
    ``num_programs``-th block with ``STAGES`` software-pipelining stages (the next block's loads in flight while this
    one is reduced and stored). ``VEC > 1`` is the launcher's promise that every expert's start (in and out) and row
    length are multiples of ``VEC`` elements (16 bytes): the hints then keep loads and stores 16-byte vectors.
    ``UNIFORM``: experts of one shape, ``u_tiles`` blocks each (the expert by a division, no table search); ``EVEN``:
    with it, every block full (no masks).
    """
    if PERSISTENT:
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
