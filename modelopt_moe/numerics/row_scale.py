"""A per-row scale of a fake-quantized GEMM operand: the router probability of an expert's down projection.

Serving engines quantize the down projection's input ``act`` and multiply each token's router probability into the
GEMM's output. A per-row scale commutes with the GEMM, so the training forward feeds the GEMM ``scale_rows(Q(act),
prob)``: one product per element, rounded once to fp32 and once to the operand's dtype. That is Megatron-Core's own
``(act * probs).to(act.dtype)`` applied to ``Q(act)`` (its probabilities are fp32 or the activation's dtype; a product
of two bf16 or fp16 values is exact in fp32), so only the place of the quantizer changes. The fused kernel
(:func:`modelopt_moe.kernels.grouped_input_fake_quant_scaled`) gives the same bits.

Gradients (:func:`scale_rows_backward`) are autograd's for the same expression: ``d/dy = (g * s).to(y.dtype)`` and
``d/ds = sum_k(g * y).to(s.dtype)`` (fp32 products and sum).
"""

from __future__ import annotations

import torch

__all__ = ["scale_rows", "scale_rows_backward"]


def _check(y: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    if not scale.is_floating_point():
        raise ValueError(f"{what}: the row scale must be a floating tensor, got {scale.dtype}")
    if y.dim() < 1 or scale.shape != y.shape[:-1]:
        raise ValueError(f"{what}: a row scale of shape {tuple(scale.shape)} does not fit an operand of shape "
                         f"{tuple(y.shape)} (expected {tuple(y.shape[:-1])}: one value per row)")


def scale_rows(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(y * scale[..., None])`` with the product in fp32, rounded to ``y``'s dtype; differentiable.

    Args:
        y: ``[..., K]`` (bf16, fp16 or fp32), typically a fake-quantized token matrix.
        scale: ``[...]``, one value per row of ``y`` (any float dtype).

    Raises:
        ValueError: ``scale`` is not floating or not shaped like ``y``'s rows.
    """
    _check(y, scale, "scale_rows")
    return (y.float() * scale.float().unsqueeze(-1)).to(y.dtype)


def scale_rows_backward(grad: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, need_input_grad: bool = True,
                        need_scale_grad: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of :func:`scale_rows` (those autograd computes for it, bit for bit).

    Returns:
        ``(grad_y, grad_scale)``: ``(grad * scale).to(y.dtype)`` and ``sum(grad * y, -1).to(scale.dtype)``; None
        for a gradient not asked for.
    """
    g = grad.float()
    grad_y = (g * scale.float().unsqueeze(-1)).to(y.dtype) if need_input_grad else None
    grad_scale = (g * y.float()).sum(-1).to(scale.dtype) if need_scale_grad else None
    return grad_y, grad_scale
