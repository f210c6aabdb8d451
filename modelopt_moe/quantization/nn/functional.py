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

from ...numerics import fake_quant
from ..tensor_quantizer import clip_mask, nan_ignoring_abs_max

__all__ = [
    "apply_quantized_gemm", "run_quantized_gemm", "clip_mask_of", "quantize_grad", "mask_grad", "forward_value_of",
]


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


def clip_mask_of(q, x: torch.Tensor) -> torch.Tensor | None:
    """The clipped-STE mask of quantizer ``q`` (a TensorQuantizer or an expert's view) for ``x``, or None."""
    if not q.is_quantizing or q.ste != "clipped" or not q.needs_amax:
        return None
    return clip_mask(x, q.amax.to(x.device) if q.amax is not None else None)


def _map(fn, value):
    return [fn(v) for v in value] if isinstance(value, list | tuple) else fn(value)


def run_quantized_gemm(cfg, x, weight, gemm: Callable, quantize_input: Callable, quantize_weight: Callable,
                       input_mask: Callable, weight_mask: Callable, output_quantizer: Callable):
    """The backward-mode machinery for one GEMM or a group of expert GEMMs.

    Args:
        cfg: a :class:`BackwardConfig`.
        x: the input; ``weight``: a weight tensor or a list of expert weights.
        gemm: ``gemm(x_operand, weight_operand)``; returns a tensor or a tuple whose first element is the output.
        quantize_input / quantize_weight: fake-quantize (and calibrate) the operands; identity when disabled.
        input_mask / weight_mask: ``mask(x)`` -> the clipped-STE mask or None (``weight_mask`` maps over lists).
        output_quantizer: applied to the GEMM output.
    """
    xq = quantize_input(x)
    wq = quantize_weight(weight)
    changed = xq is not x or (any(a is not b for a, b in zip(wq, weight, strict=True))
                             if isinstance(weight, list | tuple) else wq is not weight)
    if cfg.mode == "high_precision" and changed:
        with torch.no_grad():
            quantized = gemm(xq.detach(), _map(torch.Tensor.detach, wq))
        x_hp = mask_grad(x, input_mask(x))
        w_hp = _map(lambda w: mask_grad(w, weight_mask(w)), weight)
        precise = gemm(x_hp, w_hp)
        result = _replace_first(precise, forward_value_of(_first(precise), _first(quantized)))
    else:
        result = gemm(xq, wq)
        if cfg.mode == "quantized" and changed:  # a layer whose quantizers are all off stays a float layer
            result = _replace_first(result, quantize_grad(_first(result), cfg.grad_format))
    return _replace_first(result, output_quantizer(_first(result)))


def apply_quantized_gemm(module, x: torch.Tensor, weight: torch.Tensor, gemm: Callable):
    """Runs ``gemm(x_operand, weight_operand)`` with the module's quantizers and backward mode.

    Args:
        module: has ``input_quantizer``, ``weight_quantizer``, ``output_quantizer`` and ``quant_backward``
            (a :class:`BackwardConfig`); the quantizers may be experts' views (``SequentialMLP``).
        x, weight: the original operands.
        gemm: the layer's own GEMM; returns a tensor or a tuple whose first element is the output.

    Returns:
        What ``gemm`` returns, with the output passed through ``output_quantizer``.
    """
    iq, wq = module.input_quantizer, module.weight_quantizer
    return run_quantized_gemm(module.quant_backward, x, weight, gemm, iq, wq,
                              lambda t: clip_mask_of(iq, t), lambda t: clip_mask_of(wq, t), module.output_quantizer)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _replace_first(result, value):
    return (value, *result[1:]) if isinstance(result, tuple) else value
