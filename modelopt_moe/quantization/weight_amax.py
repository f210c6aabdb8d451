"""How weight amaxes follow the weights while training: ``weight_amax_update: static | dynamic | learned``.

* ``static``: the amax calibrated by ``mtq.quantize`` stays. Weights that grow past it during training are clipped.
* ``dynamic``: every re-quantization of the weights (every forward, or the first forward inside a
  :func:`~.weight_reuse.reuse_quantized_weights` scope) first recomputes the amax from the current weights, the same
  rule calibration applies: ``max |w|`` per expert (one launch for all N experts,
  :func:`~modelopt_moe.kernels.grouped_weight_amax`), the layout's reduction (``shared``: max over experts), then a
  max all-reduce over the parallel groups calibration reduces over (``module.amax_reduction``: tensor-parallel ranks
  where the weight is TP-sharded and the amax is per tensor, or per channel along the unsharded axis; ``shared``
  expert amaxes also over expert-parallel ranks). Every rank of such a group makes that collective in every
  re-quantization: it depends on the config and the group sizes only, never on data. The canonical amax tensor of the
  quantizer is overwritten with the value the forward used, so checkpoints and export see it; after an optimizer
  step, :func:`update_weight_amax` recomputes it from the updated weights (checkpoint saves and ``fold_weight`` call
  it), so that ``dequantize(export)`` equals the fake quant of the next forward.
* ``learned``: the amax is the parameter ``_amax`` (trained by the model's optimizer), per tensor or per expert. The
  fake quant uses it as a constant; its gradient is LSQ-style (Esser et al. 2020): with ``s = amax / bound``,
  ``d q / d s = (q - w) / s`` where ``|w| <= amax`` and ``q / s`` where ``w`` saturates, i.e.
  ``d q / d amax = (q - w * [|w| <= amax]) / amax``, scaled by ``1 / sqrt(numel * bound)``. Where the amax is
  replicated across ranks (the groups above), its gradient is summed over them in the backward, so the replicas stay
  equal. The weights get the configured straight-through estimator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..kernels import grouped_weight_amax, use_kernels
from ..numerics import TINY_AMAX, clip_limit, fake_quant, get_format
from .expert_quantizer import ExpertQuantizer, ExpertView
from .process_groups import collective_device, default_groups
from .quant_mode import QuantMode
from .quant_module import is_quantized
from .tensor_quantizer import TensorQuantizer
from .weight_operands import learned_amax_attributes, set_weight_amax_update, weight_operands

__all__ = [
    "reduction_groups",
    "refresh_weight_amax",
    "LearnedAmaxSTE",
    "learned_amax_ste",
    "quantize_weight_operand",
    "update_weight_amax",
    "learned_amax_attributes",
    "set_weight_amax_update",
]


def reduction_groups(module: nn.Module, rel_name: str, groups: dict | None = None) -> list:
    """The process groups (of more than one rank) over which ``module``'s quantizer ``rel_name`` is replicated:
    those its module names for the amax reduction, taken from ``groups`` or the registered provider (Megatron)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    groups = default_groups() if groups is None else groups
    out = []
    for name in module.amax_reduction(rel_name):
        g = groups.get(name)
        if g is not None and dist.get_world_size(g) > 1:
            out.append(g)
    return out


def _all_reduce(t: torch.Tensor, op, groups: Sequence) -> torch.Tensor:
    for g in groups:
        buf = t.to(collective_device(g)).contiguous()
        dist.all_reduce(buf, op=op, group=g)
        t = buf.to(t.device)
    return t


def refresh_weight_amax(module: nn.Module, rel_name: str, q: TensorQuantizer, weights: Sequence[torch.Tensor],
                        fast: bool = False, groups: dict | None = None) -> torch.Tensor:
    """``dynamic``: recomputes ``q``'s amax from ``weights`` (N experts: one launch with ``fast``), reduces it like
    calibration does, stores it in ``q``'s canonical amax and returns it (a fresh tensor: autograd may keep it while a
    later forward overwrites the canonical one).

    Args:
        module: the quantized module that owns ``q`` (it names the reduction groups).
        rel_name: ``q``'s name relative to ``module``.
        q: a :class:`TensorQuantizer` (one weight) or an :class:`ExpertQuantizer` (``weights`` are its N experts).
        weights: the current weights.
        fast: use the one-launch Triton kernel (experts; one weight where its amax layout is the kernel's).
        groups: ``{name: ProcessGroup}`` (default: the registered provider's).
    """
    with torch.no_grad():
        if isinstance(q, ExpertQuantizer):
            if fast:
                amax = grouped_weight_amax([w.detach() for w in weights], per_channel=q.axis is not None)
            else:
                amax = torch.stack([q.amax_of(w) for w in weights])
            amax = q._reduced(amax)
        elif fast and _kernel_amax_takes(q, weights[0]):
            per_channel = q.axis is not None
            amax = grouped_weight_amax([weights[0].detach()], per_channel=per_channel)
            amax = amax.reshape(-1, 1) if per_channel else amax.reshape(())
        else:
            amax = q.amax_of(weights[0]).float()
        amax = _all_reduce(amax, dist.ReduceOp.MAX if dist.is_available() else None,
                           reduction_groups(module, rel_name, groups))
        q.amax = amax
    return amax


def _kernel_amax_takes(q: TensorQuantizer, w: torch.Tensor) -> bool:
    """Whether one weight's amax in ``q``'s layout is the weight-amax kernel's (per tensor, or per row of a 2-D
    weight), so that the launch gives :meth:`TensorQuantizer.amax_of`'s value."""
    if q.static_block_size is not None or q.per_token or not w.is_contiguous() or w.dim() == 0:
        return False
    return q.axis is None or (q.axis in (0, -2) and w.dim() == 2)


class LearnedAmaxSTE(torch.autograd.Function):
    """``apply(amax, bound, groups, clipped, values, *weights) -> values`` (as views): fake-quantized ``values``
    (computed with ``amax`` as a constant) put into the graph with the LSQ-style gradient for ``amax`` (``[N]`` for N
    experts, ``[]`` for one weight) and the straight-through gradient (pass-through, or ``clipped`` where
    ``|w| > amax``) for the weights. The amax gradient is summed over ``groups`` (where the amax is replicated)."""

    @staticmethod
    def forward(ctx, amax, bound, groups, clipped, values, *weights):
        """Returns ``values`` as views, keeping the amax, weights and values for the backward."""
        ctx.save_for_backward(amax, *weights, *values)
        ctx.n, ctx.bound, ctx.groups, ctx.clipped = len(weights), float(bound), list(groups), bool(clipped)
        return tuple(v.view_as(v) for v in values)

    @staticmethod
    def backward(ctx, *grads):
        """The amax's LSQ-style gradient (summed over ``groups``) and the weights' straight-through gradients."""
        amax, *rest = ctx.saved_tensors
        weights, values = rest[:ctx.n], rest[ctx.n:]
        a = amax.detach().float().reshape(-1)
        limit = clip_limit(a)  # +Inf where the amax is invalid: nothing saturates, the scale is 1
        valid = torch.isfinite(a) & (a > TINY_AMAX)
        safe = torch.where(valid, a, torch.ones_like(a))
        grad_amax, grad_w = [], []
        for i, (g, w, v) in enumerate(zip(grads, weights, values, strict=True)):
            g = torch.zeros_like(w) if g is None else g
            wf, vf = w.detach().float(), v.detach().float()
            inside = wf.abs() <= limit[i]
            # d q / d amax * amax: (q - w) inside the range, q where w saturates.
            d = torch.where(inside, vf - wf, vf)
            scale = 1.0 / math.sqrt(max(1, w.numel()) * ctx.bound)
            s = (g.float() * d).sum() / safe[i] * scale
            grad_amax.append(torch.where(valid[i], s, torch.zeros_like(s)))
            grad_w.append(g * inside if ctx.clipped else g)
        grad = torch.stack(grad_amax).reshape(amax.shape).to(amax.dtype)
        grad = _all_reduce(grad, dist.ReduceOp.SUM if dist.is_available() else None, ctx.groups)
        return (grad, None, None, None, None, *grad_w)


def learned_amax_ste(module: nn.Module, rel_name: str, q, amax: torch.Tensor, weights: Sequence[torch.Tensor],
                     values: Sequence[torch.Tensor], groups: dict | None = None) -> list[torch.Tensor]:
    """:class:`LearnedAmaxSTE` for quantizer ``q`` of ``module`` (its format's bound, STE and reduction groups)."""
    return list(LearnedAmaxSTE.apply(amax, get_format(q.fmt).bound, reduction_groups(module, rel_name, groups),
                                     q.ste == "clipped", list(values), *weights))


def quantize_weight_operand(module: nn.Module, q, w: torch.Tensor, rel_name: str = "weight_quantizer"):
    """One weight (a dense layer's, or one expert's through an :class:`ExpertView`) through quantizer ``q``, as its
    mode says. An expert view's refreshed amax was refreshed by its expert layer (all experts at once)."""
    mode = q.mode
    if mode is QuantMode.REFRESHED and not isinstance(q, ExpertView):
        fast = use_kernels(q.kernel, w.device)
        return q.fake_quant(w, refresh_weight_amax(module, rel_name, q, [w], fast))
    if mode is QuantMode.LEARNED:
        amax = q.amax
        with torch.no_grad():
            if isinstance(q, TensorQuantizer) and not isinstance(q, ExpertQuantizer):
                # The quantizer's own fake quant: its bits and int range (its kernels where they run).
                value = q.fake_quant(w.detach(), amax.detach())
            else:
                value = fake_quant(w.detach(), q.fmt, amax.detach(), q.block_size, **q.int_kwargs)
        return learned_amax_ste(module, rel_name, q, amax, [w], [value])[0]
    return q(w)


def update_weight_amax(model: nn.Module, groups: dict | None = None) -> int:
    """Recomputes every ``dynamic`` weight amax from the current weights (after an optimizer step: before a checkpoint
    or an export, so that the stored amax is the one the next forward uses). Every rank must call it (it makes the
    same max all-reduces as the forward, in module order).

    Returns:
        How many quantizers were updated.
    """
    n = 0
    for module in model.modules():
        if not is_quantized(module):
            continue
        for rel, q, weights in weight_operands(module):
            if q.refreshes_amax and weights:
                refresh_weight_amax(module, rel, q, weights, groups=groups)
                n += 1
    return n
