"""``@triton.jit`` kernels of :mod:`.kl_divergence`: the per-row sums of the softmax KL's forward and the student's
gradient, each reading both logits tensors once in their own dtype. Imported lazily, on the first launch.

A program owns ``BLOCK_R`` rows (tokens) and walks their vocabulary in ``BLOCK_V`` columns, keeping fp32 partial sums
per lane; nothing of size ``[rows, vocab]`` is written but the gradient. Each element's arithmetic is the torch
reference's, operation for operation (``x / T`` by IEEE division, then ``- max``; ``exp``; ``(t - s) * exp(t)``;
``exp(s) / Z`` by IEEE division), launched without fused multiply-adds; only the order of the summation differs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_kernels import to_fp32, to_out_dtype


@triton.jit
def _scaled(x, m, temperature, UNIT_T: tl.constexpr):
    """``x / T - m`` in fp32."""
    if not UNIT_T:  # x / 1 == x: the reference skips the division too
        x = tl.math.div_rn(x, temperature)
    return x - m


@triton.jit
def _row_tile(max_ptr, thr_ptr, n_rows, BLOCK_R: tl.constexpr, TOP_K: tl.constexpr):
    """This program's rows, their mask, both maxima and (``TOP_K``) the teacher threshold, as ``[BLOCK_R, 1]``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    ms = tl.load(max_ptr + rows, mask=row_ok, other=0.0)[:, None]
    mt = tl.load(max_ptr + n_rows + rows, mask=row_ok, other=0.0)[:, None]
    if TOP_K:
        thr = to_fp32(tl.load(thr_ptr + rows, mask=row_ok, other=0.0))[:, None]
    else:
        thr = ms
    return rows, row_ok, ms, mt, thr


@triton.jit
def kl_sums_kernel(
    s_ptr, t_ptr, max_ptr, thr_ptr, out_ptr, n_rows, vocab, s_stride, t_stride, temperature,
    UNIT_T: tl.constexpr, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Writes ``sum exp(s/T - ms)``, ``sum exp(t/T - mt)`` and ``sum exp(t/T - mt) * ((t/T - mt) - (s/T - ms))`` of
    each row to ``out[0]``, ``out[1]``, ``out[2]`` (``[3, n_rows]`` fp32), a NaN product in the last counted as 0
    (a teacher probability of 0, as the reference's). With ``TOP_K``, entries whose teacher logit is below the
    row's threshold count as ``-inf`` in both."""
    rows, row_ok, ms, mt, thr = _row_tile(max_ptr, thr_ptr, n_rows, BLOCK_R, TOP_K)
    # int64 row offsets: rows * stride exceeds 2**31 elements at real sizes (32k tokens x 248k vocabulary).
    s_row = rows.to(tl.int64)[:, None] * s_stride
    t_row = rows.to(tl.int64)[:, None] * t_stride
    zs = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    zt = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    cross = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)[None, :]
        mask = row_ok[:, None] & (cols < vocab)
        xt = to_fp32(tl.load(t_ptr + t_row + cols, mask=mask, other=0.0))
        s = _scaled(to_fp32(tl.load(s_ptr + s_row + cols, mask=mask, other=0.0)), ms, temperature, UNIT_T)
        t = _scaled(xt, mt, temperature, UNIT_T)
        if TOP_K:
            outside = xt < thr  # the teacher's own values against the threshold, as the reference compares them
            s = tl.where(outside, float("-inf"), s)
            t = tl.where(outside, float("-inf"), t)
        d = t - s
        es = tl.exp(s)
        et = tl.exp(t)
        c = d * et
        c = tl.where(c != c, 0.0, c)  # a teacher probability of 0 contributes 0: 0 * -inf, 0 * NaN (both -inf)
        zs += tl.where(mask, es, 0.0)
        zt += tl.where(mask, et, 0.0)
        cross += tl.where(mask, c, 0.0)
    tl.store(out_ptr + rows, tl.sum(zs, axis=1), mask=row_ok)
    tl.store(out_ptr + n_rows + rows, tl.sum(zt, axis=1), mask=row_ok)
    tl.store(out_ptr + 2 * n_rows + rows, tl.sum(cross, axis=1), mask=row_ok)


@triton.jit
def kl_grad_kernel(
    s_ptr, t_ptr, max_ptr, sums_ptr, scale_ptr, thr_ptr, out_ptr, n_rows, vocab, s_stride, t_stride, sums_stride,
    temperature, UNIT_T: tl.constexpr, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    BITWISE_CVT: tl.constexpr,
):
    """Writes ``scale * (exp(s/T - ms) / Zs - exp(t/T - mt) / Zt)`` per row into ``out`` (contiguous ``[n_rows,
    vocab]``, the student's dtype, rounded to nearest even); ``TOP_K`` as in :func:`kl_sums_kernel`."""
    rows, row_ok, ms, mt, thr = _row_tile(max_ptr, thr_ptr, n_rows, BLOCK_R, TOP_K)
    zs = tl.load(sums_ptr + rows, mask=row_ok, other=1.0)[:, None]
    zt = tl.load(sums_ptr + sums_stride + rows, mask=row_ok, other=1.0)[:, None]
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    s_row = rows64 * s_stride
    t_row = rows64 * t_stride
    o_row = rows64 * vocab
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)[None, :]
        mask = row_ok[:, None] & (cols < vocab)
        xt = to_fp32(tl.load(t_ptr + t_row + cols, mask=mask, other=0.0))
        s = _scaled(to_fp32(tl.load(s_ptr + s_row + cols, mask=mask, other=0.0)), ms, temperature, UNIT_T)
        t = _scaled(xt, mt, temperature, UNIT_T)
        if TOP_K:
            outside = xt < thr
            s = tl.where(outside, float("-inf"), s)
            t = tl.where(outside, float("-inf"), t)
        ps = tl.math.div_rn(tl.exp(s), zs)
        pt = tl.math.div_rn(tl.exp(t), zt)
        g = (ps - pt) * scale
        tl.store(out_ptr + o_row + cols, to_out_dtype(g, out_ptr.dtype.element_ty, BITWISE_CVT), mask=mask)
