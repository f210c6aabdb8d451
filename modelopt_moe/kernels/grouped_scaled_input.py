"""Grouped input fake quant times a per-row scale, in one launch: an expert down projection's operand ``prob * Q(act)``.

Serving engines quantize the down projection's input ``act`` and apply the router probability to its output; the
training forward feeds the GEMM ``numerics.scale_rows(Q(act), prob)``, which is the same up to the GEMM's rounding
(a per-row scale commutes with it). This op computes that operand in the pass that fake-quantizes the tokens (the
input kernel of :mod:`.grouped_fake_quant` with its row-scale option), bit for bit equal to
``scale_rows(grouped_input_fake_quant(x, ...), row_scale)``.

Parts, in this order (the ``@triton.jit`` code is :mod:`.input_fake_quant_kernels`):

1. pure-torch references (``_torch_*``; the launchers are :mod:`.grouped_fake_quant`'s);
2. public functions that validate their inputs with ``ValueError``: :func:`grouped_input_fake_quant_scaled`,
   :func:`grouped_input_scaled_clip_grad`;
3. ``torch.library.custom_op`` s with ``register_fake``;
4. :class:`GroupedScaledInputFakeQuant`: gradients to the tokens (``row_scale * grad``, through the pass-through or
   clipped straight-through estimator, one launch for the clipped one) and to the row scale (``sum(grad * Q(x))``
   per row, with ``Q(x)`` recomputed from the saved tokens: nothing token-sized but the tokens themselves is kept).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..numerics import scale_rows, scale_rows_backward
from .checks import FLOAT_DTYPES, check_input, check_input_fake_quant, check_ste
from .grouped_fake_quant import (
    _launch_input_clip_grad,
    _launch_input_fake_quant,
    _torch_input_clip_grad,
    _torch_input_fake_quant,
    grouped_input_fake_quant,
)
from .launch import eager, kernels_available

__all__ = [
    "grouped_input_fake_quant_scaled",
    "grouped_input_scaled_clip_grad",
    "GroupedScaledInputFakeQuant",
    "grouped_input_fake_quant_scaled_ste",
]


# ----------------------------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------------------------
def _torch_input_fake_quant_scaled(x, m_splits, amax, fmt, block_size, narrow_range, row_scale) -> torch.Tensor:
    return scale_rows(_torch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range), row_scale)


def _torch_input_scaled_clip_grad(grad, x, m_splits, amax, row_scale) -> torch.Tensor:
    grad_y, _ = scale_rows_backward(grad, x, row_scale, need_scale_grad=False)
    return _torch_input_clip_grad(grad_y, x, m_splits, amax)


# ----------------------------------------------------------------------------------------------------------------
# Validation and public functions
# ----------------------------------------------------------------------------------------------------------------
def _check_row_scale(row_scale, x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(row_scale, torch.Tensor) or row_scale.shape != x.shape[:1]:
        found = tuple(row_scale.shape) if isinstance(row_scale, torch.Tensor) else type(row_scale).__name__
        raise ValueError(f"{what}: row_scale must be a [{x.shape[0]}] tensor (one value per row of x), got {found}")
    if row_scale.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: row_scale has dtype {row_scale.dtype}; expected one of {FLOAT_DTYPES}")
    if row_scale.device != x.device:
        raise ValueError(f"{what}: row_scale is on {row_scale.device} but x is on {x.device}")
    return row_scale.contiguous()


def grouped_input_fake_quant_scaled(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, row_scale: torch.Tensor,
    block_size: int | None = None, narrow_range: bool = True,
) -> torch.Tensor:
    """``scale_rows(grouped_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range), row_scale)`` in one
    launch, bit-exact with that composition (the fake-quantized value is rounded to ``x``'s dtype before the fp32
    product, as :func:`~modelopt_moe.numerics.scale_rows` of it does).

    Args:
        x, m_splits, amax, fmt, block_size, narrow_range: as :func:`~.grouped_fake_quant.grouped_input_fake_quant`.
        row_scale: ``[T]`` (fp32, bf16 or fp16) on ``x``'s device: row ``t`` of the output is multiplied by it.

    Returns:
        ``y`` shaped and typed like ``x``.

    Raises:
        ValueError: as :func:`~.grouped_fake_quant.grouped_input_fake_quant`, or a ``row_scale`` of the wrong shape,
            dtype or device.
    """
    what = "grouped_input_fake_quant_scaled"
    m_splits, amax = check_input_fake_quant(x, m_splits, amax, fmt, block_size, what)
    row_scale = _check_row_scale(row_scale, x, what)
    op = _input_fake_quant_scaled_impl if eager() else torch.ops.modelopt_moe.grouped_input_fake_quant_scaled
    return op(x, m_splits, amax, fmt, row_scale, block_size, bool(narrow_range))


def grouped_input_scaled_clip_grad(grad: torch.Tensor, x: torch.Tensor, m_splits, amax: torch.Tensor,
                                   row_scale: torch.Tensor) -> torch.Tensor:
    """The token gradient of :func:`grouped_input_fake_quant_scaled` with the clipped straight-through estimator:
    ``(grad * row_scale).to(x.dtype) * (|x| <= amax_of_row)``, in one launch.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices, a bad amax or row scale.
    """
    what = "grouped_input_scaled_clip_grad"
    if amax is None:
        raise ValueError(f"{what}: amax is required (without clipping the gradient is scale_rows_backward's)")
    m_splits, amax = check_input(x, m_splits, amax, what)
    if not isinstance(grad, torch.Tensor) or grad.shape != x.shape or grad.device != x.device:
        raise ValueError(f"{what}: grad must be a tensor shaped like x {tuple(x.shape)} on {x.device}")
    if grad.dtype != x.dtype or not grad.is_contiguous():
        raise ValueError(f"{what}: grad must be a contiguous {x.dtype} tensor (x's dtype), got {grad.dtype}")
    row_scale = _check_row_scale(row_scale, x, what)
    op = _input_scaled_clip_grad_impl if eager() else torch.ops.modelopt_moe.grouped_input_scaled_clip_grad
    return op(grad, x, m_splits, amax, row_scale)


# ----------------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile; register_fake gives the output metadata). No host sync inside.
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_moe::grouped_input_fake_quant_scaled", mutates_args=())
def _grouped_input_fake_quant_scaled_op(
    x: torch.Tensor, m_splits: torch.Tensor, amax: Optional[torch.Tensor], fmt: str,  # noqa: UP045
    row_scale: torch.Tensor, block_size: Optional[int], narrow_range: bool = True,  # noqa: UP045
) -> torch.Tensor:
    return _input_fake_quant_scaled_impl(x, m_splits, amax, fmt, row_scale, block_size, narrow_range)


def _input_fake_quant_scaled_impl(x, m_splits, amax, fmt, row_scale, block_size, narrow_range=True) -> torch.Tensor:
    if kernels_available(x.device):
        return _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range, row_scale)
    return _torch_input_fake_quant_scaled(x, m_splits, amax, fmt, block_size, narrow_range, row_scale)


@_grouped_input_fake_quant_scaled_op.register_fake
def _(x, m_splits, amax, fmt, row_scale, block_size, narrow_range=True):
    return torch.empty_like(x)


@torch.library.custom_op("modelopt_moe::grouped_input_scaled_clip_grad", mutates_args=())
def _grouped_input_scaled_clip_grad_op(
    grad: torch.Tensor, x: torch.Tensor, m_splits: torch.Tensor, amax: torch.Tensor, row_scale: torch.Tensor
) -> torch.Tensor:
    return _input_scaled_clip_grad_impl(grad, x, m_splits, amax, row_scale)


def _input_scaled_clip_grad_impl(grad, x, m_splits, amax, row_scale) -> torch.Tensor:
    if kernels_available(x.device):
        return _launch_input_clip_grad(grad, x, m_splits, amax, row_scale)
    return _torch_input_scaled_clip_grad(grad, x, m_splits, amax, row_scale)


@_grouped_input_scaled_clip_grad_op.register_fake
def _(grad, x, m_splits, amax, row_scale):
    return torch.empty_like(grad)


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------
class GroupedScaledInputFakeQuant(torch.autograd.Function):
    """``apply(x, m_splits, amax, fmt, row_scale, block_size, ste, narrow_range=True) -> y``: per-expert input fake
    quant times a per-row scale, with the gradients of ``scale_rows(Q(x), row_scale)`` and an STE through ``Q``.

    Backward: ``x`` gets ``(grad * row_scale).to(x.dtype)`` (zeroed where ``|x| > amax`` with ``ste="clipped"``, one
    launch); ``row_scale`` gets ``sum(grad * Q(x), -1)`` (``Q(x)`` recomputed, one launch). amax gets no gradient.
    """

    @staticmethod
    def forward(ctx, x, m_splits, amax, fmt, row_scale, block_size, ste, narrow_range=True):
        check_ste(ste)
        y = grouped_input_fake_quant_scaled(x, m_splits, amax, fmt, row_scale, block_size, narrow_range)
        ctx.clipped = ste == "clipped" and amax is not None
        ctx.fmt, ctx.block_size, ctx.narrow_range = fmt, block_size, narrow_range
        m = m_splits if isinstance(m_splits, torch.Tensor) else torch.tensor(list(m_splits), device=x.device)
        ctx.keeps_x = ctx.clipped or row_scale.requires_grad  # the tokens are needed for the mask or for Q(x)
        ctx.save_for_backward(x if ctx.keeps_x else None, m, amax, row_scale)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, m_splits, amax, row_scale = ctx.saved_tensors
        need_x, need_scale = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        grad = grad.contiguous()
        grad_x = grad_scale = None
        if need_x:
            if ctx.clipped:
                grad_x = grouped_input_scaled_clip_grad(grad, x, m_splits, amax, row_scale)
            else:
                grad_x, _ = scale_rows_backward(grad, grad, row_scale, need_scale_grad=False)
        if need_scale:
            q = grouped_input_fake_quant(x, m_splits, amax, ctx.fmt, ctx.block_size, ctx.narrow_range)
            _, grad_scale = scale_rows_backward(grad, q, row_scale, need_input_grad=False)
        return grad_x, None, None, None, grad_scale, None, None, None


def grouped_input_fake_quant_scaled_ste(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, row_scale: torch.Tensor,
    block_size: int | None = None, ste: str = "pass_through", narrow_range: bool = True,
) -> torch.Tensor:
    """Differentiable :func:`grouped_input_fake_quant_scaled` (see :class:`GroupedScaledInputFakeQuant`)."""
    return GroupedScaledInputFakeQuant.apply(x, m_splits, amax, fmt, row_scale, block_size, ste, narrow_range)
