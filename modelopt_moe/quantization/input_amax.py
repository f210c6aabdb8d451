"""Learned input (activation) amaxes: ``input_amax_update: learned``.

The GEMM input quantizers' amax (``input_quantizer``; output and KV-cache quantizers stay calibrated) becomes the
parameter ``_amax``, started from the calibrated value and trained by the model's optimizer like any weight. It keeps
the layout serving engines keep: one per layer (``experts.input_amax: shared``, every entry of the ``[N]`` amax the
same value) or one per expert (``per_expert``); dense layers have one.

The gradient (straight-through, LSQ: Esser et al. 2020, "Learned Step Size Quantization"; its clipping part is PACT's,
Choi et al. 2018): with ``s = amax / bound`` and ``q = s * R(x / s)`` (``R`` the format's rounding, taken as the
identity inside the range and constant where ``x`` saturates),
``d q / d amax = (q - x * [|x| <= amax]) / amax``: the rounding error inside the range, the quantized value where
``x`` clips. Unlike the learned weight amax, no ``1 / sqrt(numel * bound)`` factor: the number of elements a rank sees
depends on the parallel layout and the routing, and the gradient must be the same whatever the layout. The input gets
the configured straight-through gradient (pass-through, or zero where ``|x| > amax`` when clipped).

Every replica of a learned input amax gets the same gradient, the sum over every element that used it:

* data-parallel ranks (other tokens): Megatron's DDP reduces it as it reduces the weights of its GEMM (a learned
  amax of an expert GEMM is an expert parameter, ``allreduce=False``);
* ranks that see other elements of the same tensor (a row-parallel input's other channels; a column-parallel input's
  other tokens under sequence parallelism; a ``shared`` expert input's other experts on other expert-parallel ranks):
  summed in the backward over the groups the module names
  (:meth:`~.quant_module.QuantModuleMixin.input_amax_grad_groups`), a collective every rank of those groups makes
  in every backward (it depends on the config and group sizes only);
* the ``[N]`` entries of a ``shared`` amax on one rank: each gets the total over the experts, so they stay one value.

The forward quantizes with ``max(amax, LEARNED_INPUT_AMAX_FLOOR)`` (its gradient passes the floor straight through,
so an amax pushed below it can come back): the scale stays positive and normal whatever an optimizer step does.
Export writes the learned amax itself (``input_scale = amax / bound``, as for a calibrated amax).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..numerics import clip_limit
from .expert_quantizer import ExpertView
from .process_groups import collective_device, default_groups
from .quant_mode import QuantMode

__all__ = ["LEARNED_INPUT_AMAX_FLOOR", "LearnedInputAmaxSTE", "input_grad_groups", "learned_input_amax",
           "quantize_input_operand", "learned_input_values"]

# Far below any activation amax (2**-20 ~ 1e-6) and far above fp32's subnormals once divided by a format's bound.
LEARNED_INPUT_AMAX_FLOOR = 2.0**-20


def learned_input_amax(amax: torch.Tensor) -> torch.Tensor:
    """The amax a learned input quantizer's forward uses: ``max(amax, floor)``, detached."""
    return amax.detach().float().clamp_min(LEARNED_INPUT_AMAX_FLOOR)


def input_grad_groups(module: nn.Module, rel_name: str, groups: dict | None = None) -> list:
    """The process groups (of more than one rank) over which the gradient of ``module``'s learned input amax
    ``rel_name`` is summed in the backward (see the module docstring).

    Raises:
        NotImplementedError: the module names expert tensor parallelism (``etp``) of more than one rank: there the
            tokens and channels an expert GEMM's input holds depend on the dispatcher, which is not modelled.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    groups = default_groups() if groups is None else groups
    out = []
    for name in module.input_amax_grad_groups(rel_name):
        g = groups.get(name)
        if g is None or dist.get_world_size(g) == 1:
            continue
        if name == "etp":
            raise NotImplementedError(f"{type(module).__name__}.{rel_name}: input_amax_update=learned with expert "
                                      f"tensor parallelism {dist.get_world_size(g)} is not supported; use "
                                      "expert_tensor_parallel_size=1 or input_amax_update=static")
        out.append(g)
    return out


class LearnedInputAmaxSTE(torch.autograd.Function):
    """``apply(amax, segments, tied, groups, clipped, x, values) -> values`` (a view): fake-quantized ``values``
    (computed from ``x`` with :func:`learned_input_amax` as a constant) put into the graph with the learned amax's
    gradient (module docstring) and the straight-through gradient for ``x``.

    ``segments`` says which amax entry each element of ``x`` used: None (a scalar amax), an int (expert ``i`` of an
    ``[N]`` amax) or a list of row counts (the rows of a token matrix, expert by expert). ``tied``: the ``[N]``
    entries hold one value (``shared``), each gets the total. The gradient is summed over ``groups``.
    """

    @staticmethod
    def forward(ctx, amax, segments, tied, groups, clipped, x, values):
        """Returns ``values`` as a view, keeping the amax, ``x`` and ``values`` for the backward."""
        ctx.save_for_backward(amax, x, values)
        ctx.segments, ctx.tied, ctx.groups, ctx.clipped = segments, bool(tied), list(groups), bool(clipped)
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        """The amax's gradient (summed over the segments' entries and ``groups``) and ``x``'s straight-through one."""
        amax, x, values = ctx.saved_tensors
        a = learned_input_amax(amax)
        seg = ctx.segments
        if seg is None:
            per_elem = a
        elif isinstance(seg, int):
            per_elem = a[seg]
        else:
            counts = torch.as_tensor(seg, device=a.device)
            per_elem = torch.repeat_interleave(a, counts, output_size=x.shape[0]).unsqueeze(-1)
        xf, vf = x.detach().float(), values.detach().float()
        inside = xf.abs() <= clip_limit(per_elem)
        valid = torch.isfinite(per_elem)
        safe = torch.where(valid, per_elem, torch.ones_like(per_elem))
        # d q / d amax: the rounding error inside the range, the quantized value where x clips.
        contrib = torch.where(valid, grad.float() * torch.where(inside, vf - xf, vf) / safe, torch.zeros_like(xf))
        if seg is None:
            g_amax = contrib.sum().reshape(a.shape)
        elif isinstance(seg, int):
            g_amax = torch.zeros_like(a)
            g_amax[seg] = contrib.sum()
        else:
            rows = torch.repeat_interleave(torch.arange(a.shape[0], device=a.device), counts, output_size=x.shape[0])
            g_amax = torch.zeros_like(a).index_add_(0, rows, contrib.sum(-1))  # a token matrix (2-D), maybe empty
        if ctx.tied:
            g_amax = g_amax.sum().expand_as(a).clone()
        g_amax = _all_reduce_sum(g_amax, ctx.groups).to(amax.dtype)
        grad_x = grad * inside.to(grad.dtype) if ctx.clipped else grad
        return g_amax, None, None, None, None, grad_x, None


def _all_reduce_sum(t: torch.Tensor, groups: Sequence) -> torch.Tensor:
    for g in groups:
        buf = t.to(collective_device(g)).contiguous()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=g)
        t = buf.to(t.device)
    return t


def learned_input_values(module: nn.Module | None, rel_name: str, q, x: torch.Tensor, values: torch.Tensor,
                         segments=None) -> torch.Tensor:
    """``values`` (``x`` fake-quantized by the learned input quantizer ``q``, an :class:`~.ExpertQuantizer` when
    ``segments`` is given, with :func:`learned_input_amax`) with the learned amax's gradient; ``module`` (None: no
    reduction) names the groups it is summed over."""
    groups = [] if module is None else input_grad_groups(module, rel_name)
    tied = getattr(q, "layout", None) == "shared"
    return LearnedInputAmaxSTE.apply(q._amax, segments, tied, groups, q.ste == "clipped", x, values)


def quantize_input_operand(module: nn.Module, q, x: torch.Tensor, rel_name: str = "input_quantizer") -> torch.Tensor:
    """``x`` through input quantizer ``q`` of ``module`` (a dense layer's, or one expert's :class:`ExpertView`): with
    the learned amax's gradient when ``q`` learns its amax, else ``q(x)``."""
    if q.mode is not QuantMode.LEARNED:
        return q(x)
    if isinstance(q, ExpertView):
        owner = q.owner
        with torch.no_grad():
            values = owner.fake_quant_expert(q.index, x.detach(), owner.row_of(learned_input_amax(owner._amax),
                                                                              q.index))
        groups = input_grad_groups(module, rel_name)
        return LearnedInputAmaxSTE.apply(owner._amax, q.index, owner.layout == "shared", groups,
                                         owner.ste == "clipped", x, values)
    with torch.no_grad():
        values = q.fake_quant(x.detach(), learned_input_amax(q._amax))
    return learned_input_values(module, rel_name, q, x, values)
