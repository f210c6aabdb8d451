"""Backward modes of a quantized GEMM, applied around any layer's own GEMM (with its own communication).

``apply_quantized_gemm(module, x, weight, gemm)`` runs ``gemm(x_op, w_op)`` with the module's quantizers and
its :class:`BackwardConfig`:

* ``dequantized``: ``gemm(Q(x), Q(w))``; autograd sees the fake-quantized operands (STE through Q).
* ``high_precision``: the forward value is ``gemm(Q(x), Q(w))`` (bit for bit), but the backward runs through
  ``gemm(x, w)``: the backward GEMMs use the original operands. This costs a second forward GEMM.
* ``quantized``: like ``dequantized``, and the gradient arriving at the GEMM output is fake-quantized first
  (``grad_num_bits``, per-tensor scale from the gradient's own amax), emulating FP8 training.

Clipped STE zeroes the gradient of every operand element with ``|x| > amax`` in all three modes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..formats import fake_quant
from ..tensor_quantizer import TensorQuantizer, clip_mask, nan_ignoring_abs_max

__all__ = ["apply_quantized_gemm", "quantize_grad", "mask_grad", "forward_value_of"]


class _ForwardValueOf(torch.autograd.Function):
    """Returns ``value`` in the forward; sends the whole gradient to ``grad_path``."""

    @staticmethod
    def forward(ctx, grad_path, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _QuantizeGrad(torch.autograd.Function):
    """Identity in the forward; fake-quantizes the incoming gradient (dynamic per-tensor amax)."""

    @staticmethod
    def forward(ctx, x, fmt):
        ctx.fmt = fmt
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return fake_quant(grad, ctx.fmt, nan_ignoring_abs_max(grad)), None


class _MaskGrad(torch.autograd.Function):
    """Identity in the forward; multiplies the gradient by a saved 0/1 mask."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def forward_value_of(grad_path: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return _ForwardValueOf.apply(grad_path, value)


def quantize_grad(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return _QuantizeGrad.apply(x, fmt)


def mask_grad(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else _MaskGrad.apply(x, mask)


def _active(q: TensorQuantizer | None) -> bool:
    return q is not None and q.is_enabled and q._if_quant


def _clip_mask_of(q: TensorQuantizer | None, x: torch.Tensor) -> torch.Tensor | None:
    if not _active(q) or q.ste != "clipped" or not q.needs_amax:
        return None
    return clip_mask(x, q.amax.to(x.device) if q.amax is not None else None, q.fmt)


def apply_quantized_gemm(module, x: torch.Tensor, weight: torch.Tensor, gemm: Callable):
    """Runs ``gemm(x_operand, weight_operand)`` per the module's backward mode.

    Args:
        module: has ``input_quantizer``, ``weight_quantizer``, ``output_quantizer`` and ``quant_backward``
            (a :class:`BackwardConfig`).
        x, weight: the original operands.
        gemm: the layer's own GEMM; returns a tensor or a tuple whose first element is the output.

    Returns:
        What ``gemm`` returns, with the output passed through ``output_quantizer``.
    """
    cfg = module.quant_backward
    xq = module.input_quantizer(x)
    wq = module.weight_quantizer(weight)
    if cfg.mode == "high_precision" and (xq is not x or wq is not weight):
        with torch.no_grad():
            quantized = gemm(xq.detach(), wq.detach())
        x_hp = mask_grad(x, _clip_mask_of(module.input_quantizer, x))
        w_hp = mask_grad(weight, _clip_mask_of(module.weight_quantizer, weight))
        precise = gemm(x_hp, w_hp)
        out_q, out_hp = _first(quantized), _first(precise)
        result = _replace_first(precise, forward_value_of(out_hp, out_q))
    else:
        result = gemm(xq, wq)
        if cfg.mode == "quantized":
            result = _replace_first(result, quantize_grad(_first(result), cfg.grad_format))
    return _replace_first(result, module.output_quantizer(_first(result)))


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _replace_first(result, value):
    return (value, *result[1:]) if isinstance(result, tuple) else value
