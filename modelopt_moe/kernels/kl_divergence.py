"""The softmax KL of two logits tensors, given each row's softmax maxima: its per-row sums (forward) and the
student's gradient (backward), on one Triton launch each or on the pure-torch reference, chunk by chunk of rows.

The distillation loss (:func:`modelopt_moe.distill.logits_kl_loss`) computes the maxima, calls these with them,
and reduces across tensor-parallel ranks itself (the collectives stay in torch, called by every rank); here every
row is a token of this rank's vocabulary slice. Rows are ``[rows, vocab]`` matrices of logits in their own dtype
(the kernels read each element of both once per call: no fp32 copy, no ``[rows, vocab]`` temporary); the sums and
the maxima are fp32.

Parts, in this order (the ``@triton.jit`` code is in :mod:`.kl_divergence_kernels`, imported on the first launch):

1. launchers: :func:`softmax_kl_sums` and :func:`softmax_kl_grad` validate their inputs with ``ValueError`` and run
   the op; ``_launch_*`` run the kernels;
2. the pure-torch reference (``_torch_*``), chunked over rows: the default on CPU, the reference the kernels are
   tested against (equal to fp32 rounding: only the order of the summation and the ``exp`` differ);
3. the ``torch.library.custom_op`` s with ``register_fake``.

No autograd here: the loss's own ``autograd.Function`` calls both.
"""

from __future__ import annotations

import functools
import math

import torch

from .checks import FLOAT_DTYPES
from .launch import cdiv, eager, kernels_available, launch_kwargs, next_pow2

__all__ = ["softmax_kl_sums", "softmax_kl_grad", "kernel_takes"]

_BLOCK_V = 4096  # vocabulary columns per step of a program (16 per thread at 8 warps)
_TILE = 4096  # elements per step: several rows per program when the vocabulary is small


@functools.lru_cache(maxsize=1)
def _kernels():
    from . import kl_divergence_kernels

    return kl_divergence_kernels


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def kernel_takes(student: torch.Tensor, teacher: torch.Tensor) -> bool:
    """Whether the kernels take these logits: bf16, fp16 or fp32, both with unit stride along the vocabulary (any
    stride between rows), on a device where :func:`~.launch.kernels_available`."""
    return (student.dtype in FLOAT_DTYPES and teacher.dtype in FLOAT_DTYPES and _unit_last_stride(student)
            and _unit_last_stride(teacher) and kernels_available(student.device))


def _unit_last_stride(x: torch.Tensor) -> bool:
    return x.dim() == 2 and (x.stride(-1) == 1 or x.shape[-1] <= 1)


def _check(what: str, student, teacher, maxima, threshold, triton: bool) -> None:
    """The checks both ops share: ``[rows, vocab]`` logits, fp32 ``[2, rows]`` maxima, a ``[rows]`` threshold."""
    if not (isinstance(student, torch.Tensor) and isinstance(teacher, torch.Tensor)):
        raise ValueError(f"{what}: student and teacher logits must be tensors")
    if student.dim() != 2 or student.shape != teacher.shape:
        raise ValueError(f"{what}: expected student and teacher logits of one shape [rows, vocab], got "
                         f"{tuple(student.shape)} and {tuple(teacher.shape)}")
    if student.device != teacher.device:
        raise ValueError(f"{what}: student logits on {student.device}, teacher logits on {teacher.device}")
    rows = student.shape[0]
    if maxima.dtype != torch.float32 or tuple(maxima.shape) != (2, rows) or maxima.device != student.device:
        raise ValueError(f"{what}: maxima must be fp32 [2, {rows}] on {student.device}, got {maxima.dtype} "
                         f"{tuple(maxima.shape)} on {maxima.device}")
    if threshold is not None and (tuple(threshold.shape) != (rows,) or threshold.device != student.device):
        raise ValueError(f"{what}: threshold must be [{rows}] on {student.device}, got {tuple(threshold.shape)} on "
                         f"{threshold.device}")
    if not triton:
        return
    if not kernels_available(student.device):
        raise ValueError(f"{what}: the Triton kernels cannot run on {student.device} (no triton, or a CPU tensor "
                         "without TRITON_INTERPRET=1)")
    for name, x in (("student", student), ("teacher", teacher)):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{what}: {name} logits have dtype {x.dtype}; the kernels take {FLOAT_DTYPES}")
        if not _unit_last_stride(x):
            raise ValueError(f"{what}: {name} logits of shape {tuple(x.shape)} have stride {x.stride()}; the kernels "
                             "need unit stride along the vocabulary")


def softmax_kl_sums(student: torch.Tensor, teacher: torch.Tensor, maxima: torch.Tensor, temperature: float,
                    threshold: torch.Tensor | None = None, *, chunk_rows: int, triton: bool) -> torch.Tensor:
    """Per row, the three sums of the softmax KL at ``temperature``, with ``s = student / T - maxima[0]`` and
    ``t = teacher / T - maxima[1]``: ``sum exp(s)``, ``sum exp(t)`` and ``sum exp(t) * (t - s)``, whose terms of a
    teacher probability of 0 are 0 (``0 * log 0 = 0``: a teacher logit of -inf, whatever the student's).

    Args:
        student: ``[rows, vocab]`` logits (this rank's vocabulary slice).
        teacher: the teacher's logits, shaped like ``student``.
        maxima: fp32 ``[2, rows]``: per row, the student's and the teacher's largest ``logit / T`` over the whole
            vocabulary (all ranks').
        temperature: softmax temperature (> 0).
        threshold: None, or ``[rows]`` in the teacher's dtype: entries whose teacher logit is below it count as
            ``-inf`` in both (the top-k KL).
        chunk_rows: rows per chunk of the torch reference (its fp32 temporaries are three ``[chunk_rows, vocab]``);
            the kernel needs none.
        triton: True: one Triton launch; False: the torch reference.

    Returns:
        fp32 ``[3, rows]``.

    Raises:
        ValueError: shapes, devices or dtypes that do not fit, or ``triton`` where the kernels cannot run or do not
            take the logits (:func:`kernel_takes`).
    """
    _check("softmax_kl_sums", student, teacher, maxima, threshold, triton)
    args = (student, teacher, maxima, float(temperature), threshold, int(chunk_rows), bool(triton))
    if eager():
        return _sums_impl(*args)
    return torch.ops.modelopt_moe.softmax_kl_sums(*args)


def softmax_kl_grad(student: torch.Tensor, teacher: torch.Tensor, maxima: torch.Tensor, sums: torch.Tensor,
                    scale: torch.Tensor, temperature: float, threshold: torch.Tensor | None = None, *,
                    chunk_rows: int, triton: bool) -> torch.Tensor:
    """Per row, ``scale * (exp(s) / sums[0] - exp(t) / sums[1])`` (``s``, ``t``, ``threshold`` as in
    :func:`softmax_kl_sums`): the student's gradient of the KL, in the student's dtype.

    Args:
        student: ``[rows, vocab]`` logits, as in :func:`softmax_kl_sums`.
        teacher: the teacher's logits, shaped like ``student``.
        maxima: fp32 ``[2, rows]``, as in :func:`softmax_kl_sums`.
        sums: fp32 ``[2, rows]`` (or more rows; the first two are read): the two partition functions over the
            whole vocabulary.
        scale: fp32 ``[rows]``: the incoming gradient of each row's loss times its factor.
        temperature: softmax temperature (> 0).
        threshold: None, or the top-k threshold of :func:`softmax_kl_sums`.
        chunk_rows: rows per chunk of the torch reference.
        triton: True: one Triton launch; False: the torch reference.

    Returns:
        ``[rows, vocab]`` in the student's dtype, contiguous.

    Raises:
        ValueError: as :func:`softmax_kl_sums`, and ``sums`` or ``scale`` that do not fit.
    """
    _check("softmax_kl_grad", student, teacher, maxima, threshold, triton)
    rows = student.shape[0]
    if sums.dtype != torch.float32 or sums.dim() != 2 or sums.shape[0] < 2 or sums.shape[1] != rows or (
            sums.device != student.device):
        raise ValueError(f"softmax_kl_grad: sums must be fp32 [2, {rows}] on {student.device}, got {sums.dtype} "
                         f"{tuple(sums.shape)} on {sums.device}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (rows,) or scale.device != student.device:
        raise ValueError(f"softmax_kl_grad: scale must be fp32 [{rows}] on {student.device}, got {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")
    args = (student, teacher, maxima, sums, scale, float(temperature), threshold, int(chunk_rows), bool(triton))
    if eager():
        return _grad_impl(*args)
    return torch.ops.modelopt_moe.softmax_kl_grad(*args)


def _tiling(rows: int, vocab: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_V, num_warps)."""
    block_v = min(_BLOCK_V, next_pow2(max(vocab, 16)))
    block_r = max(1, min(next_pow2(max(rows, 1)), _TILE // block_v))
    return block_r, block_v, 8 if block_r * block_v >= 4096 else 4


def _launch_sums(student, teacher, maxima, temperature, threshold) -> torch.Tensor:
    rows, vocab = student.shape
    out = torch.zeros(3, rows, dtype=torch.float32, device=student.device)
    if rows == 0:
        return out
    block_r, block_v, warps = _tiling(rows, vocab)
    _kernels().kl_sums_kernel[(cdiv(rows, block_r),)](
        student, teacher, maxima.contiguous(), maxima if threshold is None else threshold.contiguous(), out, rows,
        vocab, student.stride(0), teacher.stride(0), temperature, UNIT_T=temperature == 1.0,
        TOP_K=threshold is not None, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps,
        enable_fp_fusion=False)  # (t - s) * exp(t) + acc must round like the reference's separate ops
    return out


def _launch_grad(student, teacher, maxima, sums, scale, temperature, threshold) -> torch.Tensor:
    rows, vocab = student.shape
    out = torch.empty(rows, vocab, dtype=student.dtype, device=student.device)
    if out.numel() == 0:
        return out
    block_r, block_v, warps = _tiling(rows, vocab)
    sums = sums if sums.stride(1) == 1 else sums.contiguous()
    _kernels().kl_grad_kernel[(cdiv(rows, block_r),)](
        student, teacher, maxima.contiguous(), sums, scale.contiguous(),
        maxima if threshold is None else threshold.contiguous(), out, rows, vocab, student.stride(0),
        teacher.stride(0), sums.stride(0), temperature, UNIT_T=temperature == 1.0, TOP_K=threshold is not None,
        BLOCK_R=block_r, BLOCK_V=block_v, BITWISE_CVT=launch_kwargs(out.device)["BITWISE_CVT"], num_warps=warps,
        enable_fp_fusion=False)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Torch reference
# ----------------------------------------------------------------------------------------------------------------
def _scaled(x: torch.Tensor, temperature: float, maxima: torch.Tensor) -> torch.Tensor:
    """``x / T - max`` in a new fp32 tensor (the input is never written, whatever its dtype)."""
    if temperature == 1.0:  # x / 1 == x: one pass (a low-precision x is promoted to fp32 exactly)
        return torch.sub(x, maxima.unsqueeze(-1))
    return x.to(torch.float32, copy=True).div_(temperature).sub_(maxima.unsqueeze(-1))


def _torch_sums(student, teacher, maxima, temperature, threshold, chunk_rows) -> torch.Tensor:
    n = student.shape[0]
    sums = torch.empty(3, n, dtype=torch.float32, device=student.device)
    for a in range(0, n, chunk_rows):
        b = min(a + chunk_rows, n)
        s = _scaled(student[a:b], temperature, maxima[0, a:b])
        t = _scaled(teacher[a:b], temperature, maxima[1, a:b])
        if threshold is not None:  # both distributions on the teacher's top k alone
            outside = teacher[a:b] < threshold[a:b].unsqueeze(-1)
            s.masked_fill_(outside, -math.inf)
            t.masked_fill_(outside, -math.inf)
            del outside
        # sum_v p_t (log p_t - log p_s) = sum_v e_t (t - s) / Z_t - log Z_t + log Z_s
        d = t - s
        torch.sum(s.exp_(), -1, out=sums[0, a:b])
        del s
        torch.sum(t.exp_(), -1, out=sums[1, a:b])
        # A teacher probability of 0 contributes 0 (0 * log 0 = 0) whatever the student's logit: e_t (t - s) is then
        # 0 * -inf (a teacher -inf, outside the top k included) or 0 * NaN (both -inf), the only NaN logits below +inf
        # make, which nansum counts as 0 (in sum's order: the same bits where there is none). Infinities stay: a
        # student -inf where the teacher's probability is not 0 makes the KL +inf.
        torch.nansum(d.mul_(t), -1, out=sums[2, a:b])
        del t, d
    return sums


def _torch_grad(student, teacher, maxima, sums, scale, temperature, threshold, chunk_rows) -> torch.Tensor:
    out = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    for a in range(0, student.shape[0], chunk_rows):
        b = min(a + chunk_rows, student.shape[0])
        # d/ds [T^2 KL(p_t || p_s(s / T))] = T (p_s - p_t): this rank's slice of the vocabulary.
        ps = _scaled(student[a:b], temperature, maxima[0, a:b])
        pt = _scaled(teacher[a:b], temperature, maxima[1, a:b])
        if threshold is not None:
            outside = teacher[a:b] < threshold[a:b].unsqueeze(-1)
            ps.masked_fill_(outside, -math.inf)
            pt.masked_fill_(outside, -math.inf)
            del outside
        ps = ps.exp_().div_(sums[0, a:b].unsqueeze(-1))
        pt = pt.exp_().div_(sums[1, a:b].unsqueeze(-1))
        out[a:b] = ps.sub_(pt).mul_(scale[a:b].unsqueeze(-1))
        del ps, pt
    return out


# ----------------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_moe::softmax_kl_sums", mutates_args=())
def _sums_op(student: torch.Tensor, teacher: torch.Tensor, maxima: torch.Tensor, temperature: float,
             threshold: torch.Tensor | None, chunk_rows: int, triton: bool) -> torch.Tensor:
    return _sums_impl(student, teacher, maxima, temperature, threshold, chunk_rows, triton)


def _sums_impl(student, teacher, maxima, temperature, threshold, chunk_rows, triton) -> torch.Tensor:
    if triton:
        return _launch_sums(student, teacher, maxima, temperature, threshold)
    return _torch_sums(student, teacher, maxima, temperature, threshold, chunk_rows)


@_sums_op.register_fake
def _(student, teacher, maxima, temperature, threshold, chunk_rows, triton):
    return student.new_empty((3, student.shape[0]), dtype=torch.float32)


@torch.library.custom_op("modelopt_moe::softmax_kl_grad", mutates_args=())
def _grad_op(student: torch.Tensor, teacher: torch.Tensor, maxima: torch.Tensor, sums: torch.Tensor,
             scale: torch.Tensor, temperature: float, threshold: torch.Tensor | None, chunk_rows: int,
             triton: bool) -> torch.Tensor:
    return _grad_impl(student, teacher, maxima, sums, scale, temperature, threshold, chunk_rows, triton)


def _grad_impl(student, teacher, maxima, sums, scale, temperature, threshold, chunk_rows, triton) -> torch.Tensor:
    if triton:
        return _launch_grad(student, teacher, maxima, sums, scale, temperature, threshold)
    return _torch_grad(student, teacher, maxima, sums, scale, temperature, threshold, chunk_rows)


@_grad_op.register_fake
def _(student, teacher, maxima, sums, scale, temperature, threshold, chunk_rows, triton):
    return torch.empty(student.shape, dtype=student.dtype, device=student.device)
