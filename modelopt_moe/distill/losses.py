"""Distillation losses on logits that may be split over the vocabulary across tensor-parallel ranks.

Megatron's output layer (``parallel_output=True``) leaves each tensor-parallel rank with the logits of its slice of
the vocabulary. A softmax over the whole vocabulary then needs two reductions over the TP group, exactly as
Megatron's vocab-parallel cross entropy does them: the max (for a stable exponent) and the sums of exponentials.
Both losses here reduce that way (one all-reduce of the maxima, one of the sums, every rank alike, whatever the
data), return a per-token loss that is the same on every TP rank, and compute their own gradient (no collective in
the backward): each rank's gradient is its own slice of the full-vocabulary gradient.

Everything is computed in fp32, whatever the logits' dtype; the gradient has the student logits' dtype. The KL never
holds ``[tokens, vocab]`` in fp32: on CUDA two Triton kernels read both logits once per pass (the forward's sums, the
backward's gradient); elsewhere, or with ``kernel="torch"``, it runs over chunks of tokens and recomputes them in its
backward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..kernels.kl_divergence import kernel_takes, softmax_kl_grad, softmax_kl_sums
from ..quantization.nn.experts import use_kernels
from ..quantization.utils import warn_once

__all__ = ["check_top_p", "logits_kl_loss", "vocab_parallel_cross_entropy"]


def _tp(group) -> tuple[int, int]:
    """(rank, size) of ``group`` (``(0, 1)`` without one)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


_SUM, _MAX = (dist.ReduceOp.SUM, dist.ReduceOp.MAX) if dist.is_available() else (None, None)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if _tp(group)[1] > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


# Up to _ONE_CHUNK elements the KL runs in one chunk (the whole-tensor arithmetic, op for op). Above, a chunk holds at
# most _CHUNK_ELEMENTS (64 MiB an fp32 temporary: few enough kernel launches) and a 32nd of the tokens (its three fp32
# temporaries stay under a quarter of one bf16 logits tensor).
_ONE_CHUNK = 1 << 22
_CHUNK_ELEMENTS = 1 << 24
_CHUNKS_AT_LEAST = 32


def _chunk_rows(tokens: int, vocab: int, chunk_tokens: int | None) -> int:
    """Tokens per chunk: ``chunk_tokens``, else all of them while ``tokens * vocab <= _ONE_CHUNK``, else as many as
    keep one fp32 temporary under ``_CHUNK_ELEMENTS`` and a 32nd of the tokens."""
    if chunk_tokens is not None:
        return max(1, min(tokens, chunk_tokens))
    if tokens * vocab <= _ONE_CHUNK:
        return max(1, tokens)
    return max(1, min(_CHUNK_ELEMENTS // max(1, vocab), -(-tokens // _CHUNKS_AT_LEAST)))


class _VocabParallelKL(torch.autograd.Function):
    """Per-token ``T**2 * KL(softmax(t / T) || softmax(s / T))`` over a vocabulary split across ``group`` or, with
    ``top_k`` or ``top_p``, over the teacher's most likely tokens alone (both softmaxes renormalised there).

    No ``[tokens, vocab]`` tensor in fp32 exists at any time. The maxima come from the logits in their own dtype;
    the per-token sums (:func:`~modelopt_moe.kernels.kl_divergence.softmax_kl_sums`) either from one Triton launch
    that reads both logits once, or from the torch reference chunked over tokens (``[chunk, vocab]`` fp32
    temporaries). The backward recomputes both softmaxes from the saved logits (in their own dtype) and the per-token
    maxima and sums, the same way. Each token's arithmetic is the one of the whole-tensor formula, operation for
    operation (the kernels sum in another order).
    """

    @staticmethod
    def forward(ctx, student, teacher, temperature, group, chunk_tokens, top_k, top_p, kernel):
        shape, vocab = student.shape, student.shape[-1]
        s_all, t_all = student.reshape(-1, vocab), teacher.reshape(-1, vocab)
        triton = _use_triton(kernel, s_all, t_all)
        rows = _chunk_rows(s_all.shape[0], vocab, chunk_tokens)
        threshold = (_top_k_threshold(t_all, top_k, group) if top_k else
                     _top_p_threshold(t_all, top_p, temperature, group, rows) if top_p is not None and top_p < 1 else
                     None)
        # max(round(x_i / T)) == round(max(x_i) / T) for T > 0: the maxima need no fp32 copy of the logits.
        s_max = s_all.amax(-1) if threshold is None or not s_all.shape[0] else torch.cat([
            s_all[a:a + rows].masked_fill(t_all[a:a + rows] < threshold[a:a + rows, None], -math.inf).amax(-1)
            for a in range(0, s_all.shape[0], rows)])
        maxima = torch.stack([s_max.float() / temperature, t_all.amax(-1).float() / temperature])
        _all_reduce(maxima, _MAX, group)
        sums = softmax_kl_sums(s_all, t_all, maxima, temperature, threshold, chunk_rows=rows, triton=triton)
        _all_reduce(sums, _SUM, group)
        zs, zt, cross = sums
        kl = cross / zt - zt.log() + zs.log()
        extra = (threshold,) if threshold is not None else ()
        ctx.save_for_backward(student, teacher, maxima, sums[:2], *extra)
        ctx.temperature, ctx.rows, ctx.shape, ctx.triton = temperature, rows, shape, triton
        return (kl * (temperature * temperature)).reshape(shape[:-1])

    @staticmethod
    def backward(ctx, grad):
        student, teacher, maxima, sums, *extra = ctx.saved_tensors
        threshold = extra[0] if extra else None
        vocab, temperature = student.shape[-1], ctx.temperature
        scale = grad.reshape(-1).float() * temperature
        out = softmax_kl_grad(student.reshape(-1, vocab), teacher.reshape(-1, vocab), maxima, sums, scale,
                              temperature, threshold, chunk_rows=ctx.rows, triton=ctx.triton)
        return out.reshape(ctx.shape), None, None, None, None, None, None, None


def _top_k_threshold(teacher: torch.Tensor, k: int, group) -> torch.Tensor:
    """Per token, the ``k``-th largest teacher logit over the whole vocabulary (in the logits' dtype): each rank's
    local top ``k`` gathered over ``group``."""
    local = teacher.topk(min(k, teacher.shape[-1]), dim=-1).values
    if local.shape[-1] < k:  # a shard smaller than k: pad with -inf so every rank gathers the same shape
        local = torch.cat([local, local.new_full((*local.shape[:-1], k - local.shape[-1]), -math.inf)], -1)
    _, size = _tp(group)
    if size > 1:
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, -1)
    return local.topk(k, dim=-1).values[..., -1]


# per float size in bytes: the signed integer of the same size, and the mask of its magnitude bits
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAGNITUDE = {2: (1 << 15) - 1, 4: (1 << 31) - 1, 8: (1 << 63) - 1}


def _sortable(values: torch.Tensor) -> torch.Tensor:
    """int64 keys that order like the float ``values`` (their bits, the negatives' magnitude bits flipped)."""
    size = values.element_size()
    bits = values.view(_SAME_SIZE_INT[size]).long()
    return torch.where(bits < 0, bits ^ _MAGNITUDE[size], bits)


def _unsortable(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_sortable`: the ``dtype`` values of int64 ``keys``."""
    size = torch.empty((), dtype=dtype).element_size()
    bits = torch.where(keys < 0, keys ^ _MAGNITUDE[size], keys)
    return bits.to(_SAME_SIZE_INT[size]).view(dtype)


def _top_p_threshold(teacher: torch.Tensor, p: float, temperature: float, group, rows: int) -> torch.Tensor:
    """Per token, the largest teacher logit ``v`` (in the logits' dtype) such that the teacher's probability of the
    tokens with logits ``>= v`` is at least ``p``, over the whole vocabulary: the nucleus of Holtzman et al., ties
    with its least likely token kept.

    Bisection over the values of the logits' dtype, ordered as integers (:func:`_sortable`), for all tokens at once:
    as many steps as the dtype has bits, so it ends on an adjacent pair whatever the data, with one all-reduce over
    ``group`` a step (the same number on every rank). Each step sums, per token, ``exp(t / T - max)`` over the tokens
    at or above the candidate (fp32, ``rows`` tokens at a time) and compares it with ``p`` times the sum over all
    tokens. The cost: the forward reads the teacher's logits once per bit (the exponentials are kept across the steps
    only when all tokens fit in one chunk); the backward reuses the threshold.
    """
    bits, tokens = 8 * teacher.element_size(), teacher.shape[0]
    local_max = teacher.amax(-1)  # one pass over the logits serves the softmax's maxima and the upper end below
    t_max = _all_reduce(local_max.float() / temperature, _MAX, group)
    chunks = [slice(a, a + rows) for a in range(0, tokens, rows)]

    def exps(c: slice) -> torch.Tensor:
        return torch.exp(teacher[c].float() / temperature - t_max[c, None])

    cached = exps(chunks[0]) if len(chunks) == 1 else None  # one chunk: its exponentials serve every step

    def mass(threshold: torch.Tensor | None) -> torch.Tensor:
        """Per token, the sum of the exponentials at or above ``threshold`` (all of them: None), over ``group``."""
        sums = []
        for c in chunks:  # one chunk's fp32 temporaries at a time
            e = cached if cached is not None else exps(c)
            sums.append((e if threshold is None else torch.where(teacher[c] >= threshold[c, None], e, 0.0)).sum(-1))
        return _all_reduce(torch.cat(sums) if sums else t_max.new_empty(0), _SUM, group)

    bound = mass(None) * p
    # the ends: -inf (its mass is all of it, >= p) and one above the largest logit (its mass, 0, is below p)
    lo = _sortable(teacher.new_full((), -math.inf)).expand(tokens).clone()
    hi = _all_reduce(_sortable(local_max) + 1, _MAX, group)
    for _ in range(bits):
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        above = mass(_unsortable(mid, teacher.dtype)) >= bound
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return _unsortable(lo, teacher.dtype)


KERNELS = ("auto", "triton", "torch")


def _use_triton(kernel: str, student: torch.Tensor, teacher: torch.Tensor) -> bool:
    """Whether the KL of these ``[rows, vocab]`` logits runs on the Triton kernels (``kernel``: auto | triton |
    torch); ``auto`` warns once where a CUDA tensor falls back to the torch reference."""
    if not use_kernels(kernel, student.device):  # raises for "triton" where the kernels cannot run
        if kernel == "auto" and student.device.type == "cuda":
            warn_once("logits_kl_loss: the Triton kernels cannot run here (triton missing or interpreted); the KL "
                      "runs on the torch reference, chunked over tokens (slower)")
        return False
    if kernel == "triton" or kernel_takes(student, teacher):  # "triton": the launcher names what it does not take
        return True
    warn_once(f"logits_kl_loss: the Triton kernels do not take {student.dtype} / {teacher.dtype} logits with strides "
              f"{student.stride()} / {teacher.stride()} (bf16, fp16 or fp32 with unit stride along the vocabulary); "
              "the KL runs on the torch reference, chunked over tokens (slower)")
    return False


def logits_kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, temperature: float = 1.0,
                   tp_group=None, top_k: int | None = None, top_p: float | None = None,
                   chunk_tokens: int | None = None, kernel: str = "auto") -> torch.Tensor:
    """Per-token forward KL divergence from the teacher's to the student's softmax, ``KL(p_teacher || p_student)``,
    at ``temperature`` and multiplied by ``temperature**2`` (Hinton et al.: keeps the gradient's scale independent of
    the temperature).

    Args:
        student_logits: ``[..., V]`` or, with ``tp_group``, this rank's ``[..., V / tp]`` slice of the vocabulary.
        teacher_logits: the teacher's logits, shaped like ``student_logits`` (the same vocabulary slice). No gradient
            flows to them.
        temperature: softmax temperature (> 0).
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).
        top_k: None (the default): the exact KL. An integer: the KL of the two distributions restricted to the
            teacher's ``top_k`` most likely tokens of the whole vocabulary and renormalised there (top-k knowledge
            distillation, as Model Optimizer's ``TopKLogitsKLLoss``; tokens tied with the k-th are kept). An
            approximation (its error is measured in docs/qad.md); it saves no memory here.
        top_p: None (the default): the exact KL. A number in (0, 1): the KL of the two distributions restricted to
            the teacher's nucleus, its most likely tokens of the whole vocabulary whose probability (at
            ``temperature``) adds up to at least ``top_p`` (the fewest such tokens, those tied with the least likely
            of them kept; the sums compared in fp32), and renormalised there. 1: the exact KL. An approximation, as
            ``top_k`` (measured in docs/qad.md); finding the nucleus reads the teacher's logits once per bit of
            their dtype (16 for bf16), with one all-reduce of a value per token each time, in the forward only.
            Not with ``top_k``.
        chunk_tokens: tokens per chunk of the torch reference (None: automatic, see below). Only memory and speed
            depend on it.
        kernel: ``"auto"`` (the default): the Triton kernels on CUDA, the torch reference elsewhere (and, with a
            rank-0 warning, on CUDA logits the kernels do not take: other than bf16, fp16 or fp32, or without unit
            stride along the vocabulary); ``"triton"``: the kernels wherever they run (CPU only under
            ``TRITON_INTERPRET=1``), an error elsewhere; ``"torch"``: the torch reference.

    The maxima come from the logits in their own dtype. The kernels then read both logits once per pass (one launch
    for the forward's sums, one for the backward's gradient): nothing of ``[tokens, V]`` is allocated but the gradient.
    The torch reference is computed chunk by chunk over the tokens and recomputed in the backward: besides the logits
    (saved in their own dtype, no fp32 copy) and the gradient, its fp32 working set is three ``[chunk, V]`` tensors.
    By default a chunk holds all the tokens while ``tokens * V`` is at most 2**22 (the values are then bit for bit
    those of the whole-tensor formula), else at most 2**24 elements and a 32nd of the tokens (under a quarter of one
    bf16 logits tensor). Either way, kernels or not, every token's result is the whole-tensor formula's to fp32
    rounding (the kernels sum in another order).

    Infinite logits are taken as the math takes them, on every path alike. A teacher logit of ``-inf`` (vocabulary
    padding masked out, a truncated top-k / top-p teacher, stored top-k teacher logits) is a teacher probability of
    0: it contributes 0 to the loss and 0 to the gradient (``0 * log 0 = 0``), whatever the student's logit there.
    A student logit of ``-inf`` where the teacher's probability is not 0 makes that token's loss ``+inf`` (the
    student rules out a token the teacher predicts; its gradient stays finite). A token whose teacher logits are all
    ``-inf`` (over the whole vocabulary, every rank's slice) has no teacher distribution: its loss and its gradient
    are NaN, even where its loss is then weighted by 0 (not checked here: that would wait for the device on every
    call). Give such a token other teacher logits before the call (the student's, detached: a loss of 0).

    Returns:
        fp32 ``[...]``: the loss of every token, the same on every rank of ``tp_group``.

    Raises:
        ValueError: shapes differ, a non-float input, a temperature that is not positive, a ``top_k`` or
            ``chunk_tokens`` that is not a positive integer, a ``top_p`` not in (0, 1], both ``top_k`` and
            ``top_p``, a ``kernel`` not in ``("auto", "triton", "torch")``, or
            ``kernel="triton"`` with logits the kernels do not take.
        RuntimeError: ``kernel="triton"`` where the kernels cannot run.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"logits_kl_loss: student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape (same tokens, same vocabulary slice?)")
    if not (student_logits.is_floating_point() and teacher_logits.is_floating_point()):
        raise ValueError(f"logits_kl_loss: logits must be floating point, got {student_logits.dtype} and "
                         f"{teacher_logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"logits_kl_loss: temperature must be > 0, got {temperature!r}")
    for name, value in (("top_k", top_k), ("chunk_tokens", chunk_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"logits_kl_loss: {name} must be a positive integer or None, got {value!r}")
    check_top_p("logits_kl_loss", top_p, top_k)
    if kernel not in KERNELS:
        raise ValueError(f"logits_kl_loss: kernel must be one of {KERNELS}, got {kernel!r}")
    return _VocabParallelKL.apply(student_logits, teacher_logits.detach(), float(temperature), tp_group, chunk_tokens,
                                  top_k, None if top_p is None else float(top_p), kernel)


def check_top_p(where: str, top_p, top_k) -> None:
    """Raises ValueError, naming ``where``, unless ``top_p`` is None or a number in (0, 1] given without ``top_k``."""
    if top_p is None:
        return
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"{where}: top_p must be a number in (0, 1] or None, got {top_p!r}")
    if top_k is not None:
        raise ValueError(f"{where}: top_k={top_k!r} and top_p={top_p!r}: give one of them, not both")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over the vocabulary (Megatron's vocab-parallel cross entropy)."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        z = logits.float()
        rank, _ = _tp(group)
        vocab = z.shape[-1]
        first = rank * vocab
        m = z.amax(-1)
        _all_reduce(m, _MAX, group)
        z = z - m.unsqueeze(-1)
        outside = (labels < first) | (labels >= first + vocab)
        local = torch.where(outside, torch.zeros_like(labels), labels - first)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        ez = z.exp()
        sums = torch.stack([ez.sum(-1), picked])
        _all_reduce(sums, _SUM, group)
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


class _WholeTensorKL(torch.autograd.Function):
    """The KL on whole tensors, one TP rank, fp32 softmaxes saved for the backward: how it was computed before it was
    chunked, kept as the reference the chunked KL is tested and measured against (11x one logits tensor of memory)."""

    @staticmethod
    def forward(ctx, student, teacher, temperature):
        s = student.float() / temperature
        t = teacher.float() / temperature
        s = s - s.amax(-1, keepdim=True)
        t = t - t.amax(-1, keepdim=True)
        es, et = s.exp(), t.exp()
        # 0 * log 0 = 0: a teacher probability of 0 contributes 0 whatever the student's (0 * -inf: nansum's 0).
        cross = (et * (t - s)).nansum(-1)
        zs, zt = es.sum(-1), et.sum(-1)
        ctx.save_for_backward(es.div_(zs.unsqueeze(-1)), et.div_(zt.unsqueeze(-1)))
        ctx.temperature, ctx.dtype = temperature, student.dtype
        return (cross / zt - zt.log() + zs.log()) * (temperature * temperature)

    @staticmethod
    def backward(ctx, grad):
        ps, pt = ctx.saved_tensors
        return ((ps - pt) * (grad.float().unsqueeze(-1) * ctx.temperature)).to(ctx.dtype), None, None


def whole_tensor_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-token ``KL(teacher || student)`` on whole tensors of one rank: the reference of :func:`logits_kl_loss`
    (equal to it to fp32 rounding, at 11x one logits tensor of memory above its inputs)."""
    return _WholeTensorKL.apply(student_logits, teacher_logits, temperature)
