"""The N expert weights of a grouped GEMM through their one :class:`~..expert_quantizer.ExpertQuantizer`.

What happens is the quantizer's :attr:`~..tensor_quantizer.TensorQuantizer.mode`, decided where its inputs change:

* ``OFF``: the weights themselves.
* ``CALIBRATING``, ``DYNAMIC``, ``UNCALIBRATED``: expert by expert (:meth:`ExpertQuantizer.forward_experts`).
* ``STATIC``, ``REFRESHED``, ``LEARNED`` (the amax is settled before the call): one kernel launch for all N experts
  (the reference expert by expert with ``kernel: torch``); static NVFP4 block scales take their own kernel
  (:mod:`~modelopt_moe.kernels.static_blocks_fake_quant`); learned ones too, with the reference's backward expert
  by expert (:class:`_LearnedBlocksSTE`). The mode picks the launch's amax (:data:`_LAUNCH_AMAX`:
  the stored one, or one refreshed from the weights) and how the values enter the graph (:data:`_GRADIENT`: the
  straight-through estimator, or with the learned amax's gradient).

A cache policy wraps the settled launch (:func:`_values`):

* none: no module to cache under, or ``torch.compile`` tracing / CUDA graph capture (a replay runs no host code);
* recompute: ``backward.weight_operands: recompute`` outside a reuse scope: the values are launched again in the
  backward instead of being kept (:mod:`.weight_recompute`);
* reuse: inside a :func:`~..weight_reuse.reuse_quantized_weights` scope covering the module, the values of its first
  forward (outside any scope this computes every time).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...kernels import (
    GroupedStaticBlocksSTE,
    GroupedWeightSTE,
    grouped_static_blocks_fake_quant,
    grouped_static_blocks_fake_quant_ste,
    grouped_weight_fake_quant,
    grouped_weight_fake_quant_stats,
    grouped_weight_fake_quant_ste,
)
from ...numerics import fake_quant, get_format, quant_error_sums
from ...numerics.nvfp4 import within_block_amax
from ..expert_quantizer import ExpertQuantizer
from ..quant_mode import QuantMode
from ..tensor_quantizer import clip_mask, learned_block_amax_grad
from ..weight_amax import LearnedAmaxSTE, learned_amax_ste, refresh_weight_amax
from ..weight_reuse import in_reuse_scope, reused_or_computed, weight_key
from .experts import use_kernels
from .weight_recompute import RecomputedWeights

__all__ = ["quantize_expert_weights", "expert_weight_clip_mask"]


def quantize_expert_weights(q: ExpertQuantizer, weights: list[torch.Tensor], kernel: str = "auto",
                            owner: nn.Module | None = None, *, rel_name: str = "weight_quantizer",
                            with_stats: bool = False, recompute_into: list | None = None):
    """Fake-quantizes (and calibrates) N expert weights, differentiably, as ``q``'s mode says (module docstring).

    Args:
        q: the weight quantizer.
        weights: the N expert weights.
        kernel: ``config.kernel``: how fake quant is computed (``auto``, ``triton``, ``torch``).
        owner: the module holding ``q``, which also names the groups a refreshed or learned amax is reduced over,
            and under which the values are reused.
        rel_name: ``q``'s name in ``owner``.
        with_stats: also return each expert's quantization-error sums (precision autoswitch), from the same launch.
        recompute_into: when given, and the values are one fresh launch outside a reuse scope, a
            :class:`.weight_recompute.RecomputedWeights` is appended: the recipe the backward runs again instead of
            keeping the values (``backward.weight_operands: recompute``).

    Returns:
        The N weight operands; with ``with_stats``, ``(operands, float64 [N, 4] sums or None)``.
    """
    mode = q.mode
    if mode is QuantMode.OFF:
        return (weights, None) if with_stats else weights
    device = weights[0].device
    fast = use_kernels(kernel, device)
    if mode is QuantMode.STATIC and q.learns_block_amax and fast:
        out = list(_LearnedBlocksSTE.apply(q.block_amax, q.amax.detach(), q.fmt, q.cfg.block_scale_max,
                                           q.ste == "clipped", *weights))
        return (out, _weight_sums(weights, out)) if with_stats else out
    if not mode.settled or q.learns_block_amax:  # learned block scales: each expert's gradient, expert by expert
        out = q.forward_experts(weights)
        return (out, _weight_sums(weights, out) if q.is_quantizing else None) if with_stats else out
    untracked = owner is None or _traced(device)
    if untracked and mode is QuantMode.STATIC and not with_stats:
        return _static_ste(q, weights, fast)
    values, sums, amax = _values(q, mode, weights, fast, owner, rel_name, with_stats, recompute_into, untracked)
    out = _GRADIENT[mode](q, owner, rel_name, weights, values, amax)
    return (out, sums) if with_stats else out


class _LearnedBlocksSTE(torch.autograd.Function):
    """Learned static block scales: the forward in one launch, the backward :class:`StaticBlocksSTE`'s expert by
    expert (the same tensors and ops, so the same bits; the block gradient's sums are torch's own, which no kernel
    reproduces on every device). ``apply(block_amax, amax, fmt, scale_max, clipped, *weights)``."""

    @staticmethod
    def forward(ctx, block_amax, amax, fmt, scale_max, clipped, *weights):
        """The N fake-quantized weights, in one launch."""
        blocks = block_amax.detach()
        values = grouped_static_blocks_fake_quant(list(weights), amax, blocks, fmt, scale_max)
        ctx.clipped, ctx.n = clipped, len(weights)
        spec = get_format(fmt)
        ctx.block, ctx.bound = spec.block_length, spec.element_max
        ctx.save_for_backward(blocks, *weights, *values)
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads):
        """Each expert's weight gradient (clipped at its block amaxes, or passed through) and block amax gradient."""
        blocks, *rest = ctx.saved_tensors
        weights, values = rest[: ctx.n], rest[ctx.n :]
        grad_blocks, grad_weights = [], []
        for i, (g, w, v) in enumerate(zip(grads, weights, values, strict=True)):
            g = torch.zeros_like(w) if g is None else g
            grad_blocks.append(learned_block_amax_grad(g, w, v, blocks[i], ctx.block, ctx.bound))
            if ctx.clipped:
                g = g * within_block_amax(w, blocks[i], ctx.block)
            grad_weights.append(g)
        grad_blocks = torch.stack(grad_blocks)
        if ctx.n > 1:  # expert by expert, autograd sums N gradients of the whole table: 0 + (-0.0) is +0.0
            grad_blocks = grad_blocks + 0.0
        return (grad_blocks, None, None, None, None, *grad_weights)


def _traced(device: torch.device) -> bool:
    """``torch.compile`` tracing or CUDA graph capture (the CPU build has no capture query)."""
    return torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _static_ste(q: ExpertQuantizer, weights, fast: bool) -> list[torch.Tensor]:
    """A stored amax and nothing to cache or measure: one autograd op around the kernel (or the reference)."""
    if fast and q.block_amax is not None:
        return grouped_static_blocks_fake_quant_ste(list(weights), q.amax, q.block_amax, q.fmt, q.cfg.block_scale_max,
                                                    q.ste)
    if fast:
        return grouped_weight_fake_quant_ste(list(weights), q.amax if q.needs_amax else None, q.fmt, q.block_size,
                                             q.ste, q.narrow_range)
    return [q.fake_quant_expert(i, w) for i, w in enumerate(weights)]


# --- the settled launch, per mode -----------------------------------------------------------------------------------
def _stored_amax(q: ExpertQuantizer, weights, owner, rel_name: str, fast: bool) -> torch.Tensor | None:
    return q.amax.detach() if q.needs_amax else None


def _refreshed_amax(q: ExpertQuantizer, weights, owner, rel_name: str, fast: bool) -> torch.Tensor:
    # The reduction groups are the owner's; without an owner, this call's weights under the layout's rule.
    return refresh_weight_amax(owner, rel_name, q, weights, fast) if owner is not None else q.dynamic_amax(weights)


_LAUNCH_AMAX: dict[QuantMode, Callable] = {
    QuantMode.STATIC: _stored_amax,
    QuantMode.LEARNED: _stored_amax,  # a constant of the launch; its gradient comes from _GRADIENT
    QuantMode.REFRESHED: _refreshed_amax,
}


def _launch(q: ExpertQuantizer, weights, amax: torch.Tensor | None, fast: bool, with_stats: bool):
    """``(values, sums or None)``: one launch for all experts, or the reference expert by expert."""
    if fast and q.block_amax is not None:
        values = _static_blocks_launch(q, weights, amax)
        return values, (_weight_sums(weights, values) if with_stats else None)
    if fast and with_stats:
        return grouped_weight_fake_quant_stats(weights, amax, q.fmt, q.block_size, q.narrow_range)
    if fast:
        return grouped_weight_fake_quant(weights, amax, q.fmt, q.block_size, q.narrow_range), None
    if q.block_amax is not None:
        spec, blocks, scale_max = get_format(q.fmt), q.block_amax.detach(), q.cfg.block_scale_max
        values = [spec.fake_quant_static(w, q.row_of(amax, i), blocks[i], scale_max) for i, w in enumerate(weights)]
    else:
        values = [fake_quant(w, q.fmt, None if amax is None else q.row_of(amax, i), q.block_size, **q.int_kwargs)
                  for i, w in enumerate(weights)]
    return values, (_weight_sums(weights, values) if with_stats else None)


def _static_blocks_launch(q: ExpertQuantizer, weights, amax) -> list[torch.Tensor]:
    return grouped_static_blocks_fake_quant(weights, amax, q.block_amax.detach(), q.fmt, q.cfg.block_scale_max)


def _ste(q: ExpertQuantizer, owner, rel_name: str, weights, values, amax) -> list[torch.Tensor]:
    if q.block_amax is not None:  # clipped where |w| exceeds its block's amax, as StaticBlocksSTE
        return list(GroupedStaticBlocksSTE.apply(q.block_amax.detach(), q.fmt, q.ste, values, *weights))
    return list(GroupedWeightSTE.apply(amax, q.ste, values, *weights))


def _learned_ste(q: ExpertQuantizer, owner, rel_name: str, weights, values, amax) -> list[torch.Tensor]:
    if owner is not None:
        return learned_amax_ste(owner, rel_name, q, q.amax, weights, values)
    return list(LearnedAmaxSTE.apply(q.amax, get_format(q.fmt).bound, [], q.ste == "clipped", list(values), *weights))


_GRADIENT: dict[QuantMode, Callable] = {
    QuantMode.STATIC: _ste,
    QuantMode.REFRESHED: _ste,
    QuantMode.LEARNED: _learned_ste,
}


# --- the cache policy -----------------------------------------------------------------------------------------------
def _values(q: ExpertQuantizer, mode: QuantMode, weights, fast: bool, owner, rel_name: str, with_stats: bool,
            recompute_into: list | None, untracked: bool):
    """``(values, sums, amax)`` of the settled launch, computed, recomputed in the backward, or reused."""

    def compute():
        with torch.no_grad():
            amax = _LAUNCH_AMAX[mode](q, weights, owner, rel_name, fast)
            values, sums = _launch(q, weights, amax, fast, with_stats)
        return values, sums, amax

    if untracked:
        return compute()
    if recompute_into is not None and fast and not with_stats and mode is not QuantMode.LEARNED and \
            not in_reuse_scope(owner):
        values, sums, amax = compute()
        if q.block_amax is not None:
            blocks = q.block_amax.detach()

            def again():
                return grouped_static_blocks_fake_quant(weights, amax, blocks, q.fmt, q.cfg.block_scale_max)
        else:
            def again():
                return grouped_weight_fake_quant(weights, amax, q.fmt, q.block_size, q.narrow_range)
        recompute_into.append(RecomputedWeights(values, again, weights, amax, f"{type(owner).__name__}.{rel_name}"))
        return values, sums, amax
    # A refreshed amax is a function of the weights (and of the same weights on the other ranks of its reduction
    # group), so the weights' key covers it; the collective inside compute() runs on the first forward of the
    # scope on every rank alike.
    stored = None if mode is QuantMode.REFRESHED else (q.amax if q.needs_amax else None)
    blocks = q.block_amax  # static block scales: a sweep or a load changes them in place (version) or anew (id)
    block_key = None if blocks is None else (id(blocks), blocks.data_ptr(), blocks._version)
    return reused_or_computed(owner, lambda: weight_key(weights, stored, q.cfg, q.ste, fast, mode, with_stats,
                                                        block_key), compute)


def _weight_sums(weights, values) -> torch.Tensor:
    return torch.stack([quant_error_sums(w, v) for w, v in zip(weights, values, strict=True)])


def expert_weight_clip_mask(q: ExpertQuantizer, weights: list[torch.Tensor]):
    """``mask(w)`` -> the clipped-STE mask of expert weight ``w`` (one of ``weights``) or None."""
    index: dict[int, int] = {}  # built on first use (high-precision backward only): no per-expert work otherwise

    def mask(w: torch.Tensor) -> torch.Tensor | None:
        if not q.clips:
            return None
        if not index:
            index.update((id(e), i) for i, e in enumerate(weights))
        return clip_mask(w, q.expert_amax(index[id(w)]))

    return mask
