"""Fake quantization of the tokens of N experts in one launch, each row group with its expert's amax, bit-exact with
``formats.fake_quant``; optionally times a per-row scale; and the clipped straight-through gradients.

Tokens: ``x`` [T, K], rows ``[sum(m_splits[:i]), sum(m_splits[:i+1]))`` belonging to expert ``i``; the kernels find
a row's expert from ``m_splits`` on the device (no host sync).

Row-scaled variant: an expert down projection's operand ``prob * Q(act)``. Serving engines quantize the down
projection's input ``act`` and apply the router probability to its output; the training forward feeds the GEMM
``numerics.scale_rows(Q(act), prob)``, which is the same up to the GEMM's rounding (a per-row scale commutes with it).
:func:`grouped_input_fake_quant_scaled` computes that operand in the pass that fake-quantizes the tokens, bit for bit
equal to ``scale_rows(grouped_input_fake_quant(x, ...), row_scale)``.

Parts, in this order (the ``@triton.jit`` code is in :mod:`.input_fake_quant_kernels`, imported on the first
launch):

1. launchers: :func:`grouped_input_fake_quant`, :func:`grouped_input_clip_grad`,
   :func:`grouped_input_fake_quant_scaled`, :func:`grouped_input_scaled_clip_grad` validate their inputs with
   ``ValueError`` and run the op; ``_launch_*`` run the kernels;
2. pure-torch fallbacks (``_torch_*``), used where :func:`~.launch.kernels_available` is False;
3. ``torch.library.custom_op`` s with ``register_fake``;
4. autograd: :class:`GroupedInputFakeQuant` and :class:`GroupedInputSTE` (pass-through or clipped straight-through
   estimator), :class:`GroupedScaledInputFakeQuant` (gradients to the tokens, ``row_scale * grad`` through the
   estimator, one launch for the clipped one, and to the row scale, ``sum(grad * Q(x))`` per row with ``Q(x)``
   recomputed from the saved tokens: nothing token-sized but the tokens themselves is kept).
"""

import functools
from typing import Optional

import torch

from ..numerics import clip_limit, fake_quant, scale_rows, scale_rows_backward
from . import fp8_block_fake_quant as fp8_blocks
from .checks import FLOAT_DTYPES, check_input, check_input_fake_quant, check_ste
from .fallback import int_kwargs, per_row_amax
from .launch import (
    cdiv,
    eager,
    format_constexprs,
    inner_block,
    input_tiling,
    kernels_available,
    kernels_take,
    launch_kwargs,
    next_pow2,
    rounding_options,
    token_tiling,
)
from .tuning import weight_kernel_config

__all__ = [
    "grouped_input_fake_quant",
    "grouped_input_clip_grad",
    "grouped_input_fake_quant_scaled",
    "grouped_input_scaled_clip_grad",
    "GroupedInputFakeQuant",
    "GroupedInputSTE",
    "GroupedScaledInputFakeQuant",
    "grouped_input_fake_quant_ste",
    "grouped_input_fake_quant_scaled_ste",
]


@functools.lru_cache(maxsize=1)
def _kernels():
    from . import input_fake_quant_kernels

    return input_fake_quant_kernels


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def grouped_input_fake_quant(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    narrow_range: bool = True,
) -> torch.Tensor:
    """Fake-quantizes the concatenated tokens of N experts in one launch, each row group with its expert's amax.

    Args:
        x: ``[T, K]`` contiguous bf16/fp16/fp32; rows ``[sum(m_splits[:i]), sum(m_splits[:i+1]))`` belong to expert
            ``i``. ``sum(m_splits)`` must equal ``T`` (not checked: that would need a host sync); rows past it are
            quantized with the last expert's amax.
        m_splits: ``[N]`` integer tensor on ``x``'s device (offsets are computed on the device, no sync), or a list
            of ints (then copied to the device).
        amax: ``[N]`` per expert or a scalar shared by all; ``None`` only for int formats with ``block_size``.
        fmt: a registered format name (:data:`modelopt_moe.numerics.FORMATS`).
        block_size: int formats only: dynamic per-block amax along the last dim (power of two; a last dim that is
            not a multiple is zero-padded).
        narrow_range: int formats only: levels ``[-B, B]`` (True) or ``[-B-1, B]``.

    Returns:
        ``y`` shaped and typed like ``x``.

    Raises:
        ValueError: on a bad shape, dtype, device, contiguity, amax shape, format or block size.
    """
    m_splits, amax = check_input_fake_quant(x, m_splits, amax, fmt, block_size, "grouped_input_fake_quant")
    op = _input_fake_quant_impl if eager() else torch.ops.modelopt_moe.grouped_input_fake_quant
    return op(x, m_splits, amax, fmt, block_size, bool(narrow_range))


def grouped_input_clip_grad(grad: torch.Tensor, x: torch.Tensor, m_splits, amax: torch.Tensor) -> torch.Tensor:
    """Clipped straight-through gradient of :func:`grouped_input_fake_quant`: ``grad * (|x| <= amax_of_row)``.

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or a bad amax.
    """
    what = "grouped_input_clip_grad"
    if amax is None:
        raise ValueError(f"{what}: amax is required (use the gradient unchanged for no clipping)")
    m_splits, amax = check_input(x, m_splits, amax, what)
    if not isinstance(grad, torch.Tensor) or grad.shape != x.shape or grad.device != x.device:
        raise ValueError(f"{what}: grad must be a tensor shaped like x {tuple(x.shape)} on {x.device}")
    if grad.dtype not in FLOAT_DTYPES or not grad.is_contiguous():
        raise ValueError(f"{what}: grad must be a contiguous bf16/fp16/fp32 tensor, got {grad.dtype}")
    op = _input_clip_grad_impl if eager() else torch.ops.modelopt_moe.grouped_input_clip_grad
    return op(grad, x, m_splits, amax)


def grouped_input_fake_quant_scaled(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, row_scale: torch.Tensor,
    block_size: int | None = None, narrow_range: bool = True,
) -> torch.Tensor:
    """``scale_rows(grouped_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range), row_scale)`` in one
    launch, bit-exact with that composition (the fake-quantized value is rounded to ``x``'s dtype before the fp32
    product, as :func:`~modelopt_moe.numerics.scale_rows` of it does).

    Args:
        x: ``[T, K]`` tokens of N experts, as :func:`grouped_input_fake_quant`.
        m_splits: rows per expert, as :func:`grouped_input_fake_quant`.
        amax: ``[N]`` per expert or a scalar, as :func:`grouped_input_fake_quant`.
        fmt: the format, as :func:`grouped_input_fake_quant`.
        block_size: int formats' block length, as :func:`grouped_input_fake_quant`.
        narrow_range: int formats' level range, as :func:`grouped_input_fake_quant`.
        row_scale: ``[T]`` (fp32, bf16 or fp16) on ``x``'s device: row ``t`` of the output is multiplied by it.

    Returns:
        ``y`` shaped and typed like ``x``.

    Raises:
        ValueError: as :func:`grouped_input_fake_quant`, or a ``row_scale`` of the wrong shape, dtype or device.
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


def _check_row_scale(row_scale, x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(row_scale, torch.Tensor) or row_scale.shape != x.shape[:1]:
        found = tuple(row_scale.shape) if isinstance(row_scale, torch.Tensor) else type(row_scale).__name__
        raise ValueError(f"{what}: row_scale must be a [{x.shape[0]}] tensor (one value per row of x), got {found}")
    if row_scale.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: row_scale has dtype {row_scale.dtype}; expected one of {FLOAT_DTYPES}")
    if row_scale.device != x.device:
        raise ValueError(f"{what}: row_scale is on {row_scale.device} but x is on {x.device}")
    return row_scale.contiguous()


def _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range=True, row_scale=None) -> torch.Tensor:
    """The input kernel; with ``row_scale`` [T] each output row is also multiplied by its scale (same launch)."""
    k = _kernels()
    y = torch.empty_like(x)
    t, kdim = x.shape
    if x.numel() == 0:
        return y
    bs, _ = inner_block(fmt, block_size)
    tile_r, tile_nb, tile_w, kwargs = token_tiling(fmt, kdim, bs, x.device)
    n = m_splits.numel()
    per_expert = amax is not None and amax.dim() == 1
    amax_arg = amax if amax is not None else m_splits  # never read for block int formats
    k.grouped_input_fake_quant_kernel[(cdiv(t, tile_r), cdiv(kdim, tile_w))](
        x, y, m_splits, amax_arg, row_scale if row_scale is not None else m_splits, t, kdim, n,
        **format_constexprs(fmt, block_size), PER_EXPERT=per_expert,
        N_PAD=next_pow2(n), TILE_R=tile_r, TILE_NB=tile_nb, BS=bs, NARROW=bool(narrow_range),
        HAS_SCALE=row_scale is not None, **rounding_options(weight_kernel_config(fmt), x.device),
        **kwargs,
    )
    return y


def _launch_input_clip_grad(grad, x, m_splits, amax, row_scale=None) -> torch.Tensor:
    """The clipped-STE kernel; with ``row_scale`` [T] the gradient is first multiplied by its row's scale."""
    k = _kernels()
    out = torch.empty_like(grad)
    t, kdim = x.shape
    if x.numel() == 0:
        return out
    tile_r, tile_nb, tile_w = input_tiling(kdim, 16)
    n = m_splits.numel()
    k.grouped_input_clip_grad_kernel[(cdiv(t, tile_r), cdiv(kdim, tile_w))](
        grad, x, out, m_splits, amax, row_scale if row_scale is not None else amax, t, kdim, n,
        PER_EXPERT=amax.dim() == 1, N_PAD=next_pow2(n), TILE_R=tile_r, TILE_NB=tile_nb, BS=16,
        HAS_SCALE=row_scale is not None, **launch_kwargs(x.device),
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Torch fallbacks
# ----------------------------------------------------------------------------------------------------------------
def _torch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    # Per-row amax gives the same bits as fake_quant per row group: every format's arithmetic is row-local.
    return fake_quant(x, fmt, per_row_amax(x, m_splits, amax), block_size, **int_kwargs(fmt, narrow_range))


def _torch_input_clip_grad(grad, x, m_splits, amax) -> torch.Tensor:
    return grad * (x.abs() <= clip_limit(per_row_amax(x, m_splits, amax)))


def _torch_input_fake_quant_scaled(x, m_splits, amax, fmt, block_size, narrow_range, row_scale) -> torch.Tensor:
    return scale_rows(_torch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range), row_scale)


def _torch_input_scaled_clip_grad(grad, x, m_splits, amax, row_scale) -> torch.Tensor:
    grad_y, _ = scale_rows_backward(grad, x, row_scale, need_scale_grad=False)
    return _torch_input_clip_grad(grad_y, x, m_splits, amax)


# ----------------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile; register_fake gives the output metadata). No host sync inside.
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_moe::grouped_input_fake_quant", mutates_args=())
def _grouped_input_fake_quant_op(
    x: torch.Tensor, m_splits: torch.Tensor, amax: Optional[torch.Tensor], fmt: str,  # noqa: UP045
    block_size: Optional[int], narrow_range: bool = True,  # noqa: UP045
) -> torch.Tensor:
    return _input_fake_quant_impl(x, m_splits, amax, fmt, block_size, narrow_range)


def _input_fake_quant_impl(x, m_splits, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    if kernels_available(x.device) and kernels_take(fmt, block_size):
        return _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)
    if kernels_available(x.device) and fp8_blocks.takes_tokens(fmt, block_size):
        return fp8_blocks.token_groups_fake_quant(x, fmt, block_size)
    return _torch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)


@_grouped_input_fake_quant_op.register_fake
def _(x, m_splits, amax, fmt, block_size, narrow_range=True):
    return torch.empty_like(x)


@torch.library.custom_op("modelopt_moe::grouped_input_clip_grad", mutates_args=())
def _grouped_input_clip_grad_op(
    grad: torch.Tensor, x: torch.Tensor, m_splits: torch.Tensor, amax: torch.Tensor
) -> torch.Tensor:
    return _input_clip_grad_impl(grad, x, m_splits, amax)


def _input_clip_grad_impl(grad, x, m_splits, amax) -> torch.Tensor:
    if kernels_available(x.device):
        return _launch_input_clip_grad(grad, x, m_splits, amax)
    return _torch_input_clip_grad(grad, x, m_splits, amax)


@_grouped_input_clip_grad_op.register_fake
def _(grad, x, m_splits, amax):
    return torch.empty_like(grad)


@torch.library.custom_op("modelopt_moe::grouped_input_fake_quant_scaled", mutates_args=())
def _grouped_input_fake_quant_scaled_op(
    x: torch.Tensor, m_splits: torch.Tensor, amax: Optional[torch.Tensor], fmt: str,  # noqa: UP045
    row_scale: torch.Tensor, block_size: Optional[int], narrow_range: bool = True,  # noqa: UP045
) -> torch.Tensor:
    return _input_fake_quant_scaled_impl(x, m_splits, amax, fmt, row_scale, block_size, narrow_range)


def _input_fake_quant_scaled_impl(x, m_splits, amax, fmt, row_scale, block_size, narrow_range=True) -> torch.Tensor:
    if kernels_available(x.device) and kernels_take(fmt, block_size):
        return _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range, row_scale)
    if kernels_available(x.device) and fp8_blocks.takes_tokens(fmt, block_size):
        return scale_rows(fp8_blocks.token_groups_fake_quant(x, fmt, block_size), row_scale)
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
class GroupedInputFakeQuant(torch.autograd.Function):
    """``apply(x, m_splits, amax, fmt, block_size, ste, narrow_range=True) -> y``: per-expert input fake quant with
    an STE."""

    @staticmethod
    def forward(ctx, x, m_splits, amax, fmt, block_size, ste, narrow_range=True):
        """Fake-quantizes ``x`` (:func:`grouped_input_fake_quant`), keeping what the clipped STE's backward needs."""
        check_ste(ste)
        y = grouped_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)
        ctx.clipped = ste == "clipped" and amax is not None
        if ctx.clipped:
            m = m_splits if isinstance(m_splits, torch.Tensor) else torch.tensor(list(m_splits), device=x.device)
            ctx.save_for_backward(x, m, amax)
        return y

    @staticmethod
    def backward(ctx, grad):
        """The gradient of ``x``: unchanged (``pass_through``) or zeroed where ``|x| > amax`` (``clipped``)."""
        if not ctx.clipped:
            return grad, None, None, None, None, None, None
        x, m_splits, amax = ctx.saved_tensors
        return grouped_input_clip_grad(grad.contiguous(), x, m_splits, amax), None, None, None, None, None, None


class GroupedInputSTE(torch.autograd.Function):
    """``apply(x, m_splits, amax, ste, values) -> values`` (as a view): fake-quantized tokens computed earlier (e.g.
    with :func:`~.quant_stats.grouped_input_fake_quant_stats`) put into the graph with the straight-through gradient
    of :class:`GroupedInputFakeQuant` (pass-through, or clipped where ``|x| > amax``)."""

    @staticmethod
    def forward(ctx, x, m_splits, amax, ste, values):
        """Returns ``values`` as a view, keeping what the clipped STE's backward needs."""
        ctx.clipped = ste == "clipped" and amax is not None
        if ctx.clipped:
            ctx.save_for_backward(x, m_splits, amax)
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        """The gradient of ``x``: unchanged (``pass_through``) or zeroed where ``|x| > amax`` (``clipped``); ``values``
        gets none."""
        if not ctx.clipped:
            return grad, None, None, None, None
        x, m_splits, amax = ctx.saved_tensors
        return grouped_input_clip_grad(grad.contiguous(), x, m_splits, amax), None, None, None, None


class GroupedScaledInputFakeQuant(torch.autograd.Function):
    """``apply(x, m_splits, amax, fmt, row_scale, block_size, ste, narrow_range=True) -> y``: per-expert input fake
    quant times a per-row scale, with the gradients of ``scale_rows(Q(x), row_scale)`` and an STE through ``Q``.

    Backward: ``x`` gets ``(grad * row_scale).to(x.dtype)`` (zeroed where ``|x| > amax`` with ``ste="clipped"``, one
    launch); ``row_scale`` gets ``sum(grad * Q(x), -1)`` (``Q(x)`` recomputed, one launch). amax gets no gradient.
    """

    @staticmethod
    def forward(ctx, x, m_splits, amax, fmt, row_scale, block_size, ste, narrow_range=True):
        """``scale_rows(Q(x), row_scale)`` in one launch; keeps the tokens only where the backward needs them."""
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
        """The gradients of ``x`` and ``row_scale`` (class docstring), each computed only when it is needed."""
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


def grouped_input_fake_quant_ste(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    ste: str = "pass_through", narrow_range: bool = True,
) -> torch.Tensor:
    """Differentiable :func:`grouped_input_fake_quant` (see :class:`GroupedInputFakeQuant`)."""
    return GroupedInputFakeQuant.apply(x, m_splits, amax, fmt, block_size, ste, narrow_range)


def grouped_input_fake_quant_scaled_ste(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, row_scale: torch.Tensor,
    block_size: int | None = None, ste: str = "pass_through", narrow_range: bool = True,
) -> torch.Tensor:
    """Differentiable :func:`grouped_input_fake_quant_scaled` (see :class:`GroupedScaledInputFakeQuant`)."""
    return GroupedScaledInputFakeQuant.apply(x, m_splits, amax, fmt, row_scale, block_size, ste, narrow_range)
