"""Distillation losses on logits that may be split over the vocabulary across tensor-parallel ranks.

Megatron's output layer (``parallel_output=True``) leaves each tensor-parallel rank with the logits of its slice of
the vocabulary. A softmax over the whole vocabulary then needs two reductions over the TP group, exactly as
Megatron's vocab-parallel cross entropy does them: the max (for a stable exponent) and the sums of exponentials.
Both losses here reduce that way (one all-reduce of the maxima, one of the sums, every rank alike, whatever the
data), return a per-token loss that is the same on every TP rank, and compute their own gradient (no collective in
the backward): each rank's gradient is its own slice of the full-vocabulary gradient.

Everything is computed in fp32, whatever the logits' dtype; the gradient has the student logits' dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["logits_kl_loss", "vocab_parallel_cross_entropy"]


def _tp(group) -> tuple[int, int]:
    """(rank, size) of ``group`` (``(0, 1)`` without one)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if _tp(group)[1] > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelKL(torch.autograd.Function):
    """Per-token ``T**2 * KL(softmax(t / T) || softmax(s / T))`` over a vocabulary split across ``group``."""

    @staticmethod
    def forward(ctx, student, teacher, temperature, group):
        s = student.float() / temperature
        t = teacher.float() / temperature
        maxima = torch.stack([s.amax(-1), t.amax(-1)])
        _all_reduce(maxima, dist.ReduceOp.MAX if dist.is_available() else None, group)
        s = s - maxima[0].unsqueeze(-1)
        t = t - maxima[1].unsqueeze(-1)
        es, et = s.exp(), t.exp()
        # sum_v p_t (log p_t - log p_s) = sum_v e_t (t - s) / Z_t - log Z_t + log Z_s
        sums = torch.stack([es.sum(-1), et.sum(-1), (et * (t - s)).sum(-1)])
        _all_reduce(sums, dist.ReduceOp.SUM if dist.is_available() else None, group)
        zs, zt, cross = sums
        kl = cross / zt - zt.log() + zs.log()
        ctx.save_for_backward(es.div_(zs.unsqueeze(-1)), et.div_(zt.unsqueeze(-1)))
        ctx.temperature, ctx.dtype = temperature, student.dtype
        return kl * (temperature * temperature)

    @staticmethod
    def backward(ctx, grad):
        ps, pt = ctx.saved_tensors
        # d/ds [T^2 KL(p_t || p_s(s / T))] = T (p_s - p_t): this rank's slice of the vocabulary.
        g = (ps - pt) * (grad.float().unsqueeze(-1) * ctx.temperature)
        return g.to(ctx.dtype), None, None, None


def logits_kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0,
                   tp_group=None) -> torch.Tensor:
    """Per-token forward KL divergence from the teacher's to the student's softmax, ``KL(p_teacher || p_student)``,
    at ``temperature`` and multiplied by ``temperature**2`` (Hinton et al.: keeps the gradient's scale independent of
    the temperature).

    Args:
        student_logits: ``[..., V]`` or, with ``tp_group``, this rank's ``[..., V / tp]`` slice of the vocabulary.
        teacher_logits: the teacher's logits, shaped like ``student_logits`` (the same vocabulary slice). No gradient
            flows to them.
        temperature: softmax temperature (> 0).
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).

    Returns:
        fp32 ``[...]``: the loss of every token, the same on every rank of ``tp_group``.

    Raises:
        ValueError: shapes differ, a non-float input, or a temperature that is not positive.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"logits_kl_loss: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape (same tokens, same vocabulary slice?)")
    if not (student_logits.is_floating_point() and teacher_logits.is_floating_point()):
        raise ValueError(f"logits_kl_loss: logits must be floating point, got {student_logits.dtype} and "
                         f"{teacher_logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"logits_kl_loss: temperature must be > 0, got {temperature!r}")
    return _VocabParallelKL.apply(student_logits, teacher_logits.detach(), float(temperature), tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over the vocabulary (Megatron's vocab-parallel cross entropy)."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        z = logits.float()
        rank, _ = _tp(group)
        vocab = z.shape[-1]
        first = rank * vocab
        m = z.amax(-1)
        _all_reduce(m, dist.ReduceOp.MAX if dist.is_available() else None, group)
        z = z - m.unsqueeze(-1)
        outside = (labels < first) | (labels >= first + vocab)
        local = torch.where(outside, torch.zeros_like(labels), labels - first)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        ez = z.exp()
        sums = torch.stack([ez.sum(-1), picked])
        _all_reduce(sums, dist.ReduceOp.SUM if dist.is_available() else None, group)
        ctx.save_for_backward(ez.div_(sums[0].unsqueeze(-1)), local, outside)
        ctx.dtype = logits.dtype
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad):
        p, local, outside = ctx.saved_tensors
        g = p.scatter_add(-1, local.unsqueeze(-1), -(~outside).to(p.dtype).unsqueeze(-1))
        return (g * grad.float().unsqueeze(-1)).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, tp_group=None) -> torch.Tensor:
    """Per-token next-token cross entropy of ``logits`` (``[..., V]``, or this rank's ``[..., V / tp]`` slice, rank
    ``r`` holding ids ``[r * V / tp, (r + 1) * V / tp)``) against integer ``labels`` (``[...]``, full-vocabulary ids).

    Returns:
        fp32 ``[...]``, the same on every rank of ``tp_group``.

    Raises:
        ValueError: ``labels`` does not match the logits' leading shape or is not an integer tensor.
    """
    if labels.shape != logits.shape[:-1] or labels.is_floating_point():
        raise ValueError(f"vocab_parallel_cross_entropy: labels {tuple(labels.shape)} ({labels.dtype}) must be "
                         f"integer ids shaped like the logits' leading dims {tuple(logits.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(logits, labels.long(), tp_group)
