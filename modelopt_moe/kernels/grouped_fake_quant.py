"""Grouped fake quantization of MoE experts: all N experts in one launch, bit-exact with ``formats.fake_quant``.

Parts, in this order (the ``@triton.jit`` kernels themselves live in :mod:`.weight_fake_quant_kernels` and
:mod:`.input_fake_quant_kernels`, imported lazily so that this module imports with torch alone and so that
``TRITON_INTERPRET=1`` may be set any time before the first launch):

1. launchers (``_launch_*``) and pure-torch fallbacks (``_torch_*``, :func:`formats.fake_quant` per expert), chosen
   by :func:`kernels_available`;
2. public functions that validate their inputs with ``ValueError`` and call the custom ops:
   :func:`grouped_weight_fake_quant`, :func:`grouped_weight_clip_grad`, :func:`grouped_input_fake_quant`,
   :func:`grouped_input_clip_grad`;
3. ``torch.library.custom_op`` s in the ``modelopt_moe`` namespace, each with ``register_fake``;
4. autograd functions :class:`GroupedWeightFakeQuant` and :class:`GroupedInputFakeQuant` (pass-through or clipped
   straight-through estimator).

Weights: the N experts stay separate tensors (TE's ``weight0..weight{N-1}``). The kernel reads them through a device
table of int64 element offsets from a base tensor (the one with the lowest address), so nothing is stacked. The
output is ONE new buffer; the public function returns N views of it shaped like the inputs.

The pointer table, its cache and the backend choice are :mod:`.launch`'s; the shared checks :mod:`.checks`'.

Clipped straight-through estimator: ``grad * (|w| <= amax)`` with the same amax tensor as the forward (the expert's,
or the channel's for ``[N, C]``); NVFP4 clips against its global (expert/channel) amax, block int formats against
the amax passed in, if any (their dynamic block amax never clips). An invalid amax (formats.py's rule: <= 2**-24,
NaN, Inf) clips nothing. This matches ``tensor_quantizer.clip_mask`` (so a NaN weight gets a zero gradient, and a
NaN gradient stays NaN even where clipped).
"""

import functools
from collections.abc import Sequence
from typing import Optional

import torch

from ..numerics import clip_limit, fake_quant
from .checks import (
    FLOAT_DTYPES,
    check_input,
    check_input_fake_quant,
    check_ste,
    check_weight_fake_quant,
    check_weights,
)
from .fallback import expert_amax, int_kwargs, per_row_amax
from .launch import (
    Signature,
    amax_mode,
    cdiv,
    eager,
    format_constexprs,
    inner_block,
    input_tiling,
    kernels_available,
    launch_kwargs,
    next_pow2,
    padded,
    rounding_options,
    split_views,
    weight_plan,
)
from .tuning import weight_kernel_config

__all__ = [
    "grouped_weight_fake_quant",
    "grouped_weight_clip_grad",
    "grouped_input_fake_quant",
    "grouped_input_clip_grad",
    "GroupedWeightFakeQuant",
    "GroupedWeightSTE",
    "GroupedInputFakeQuant",
    "grouped_weight_fake_quant_ste",
    "grouped_input_fake_quant_ste",
]


@functools.lru_cache(maxsize=1)
def _weight_kernels():
    from . import weight_fake_quant_kernels

    return weight_fake_quant_kernels


@functools.lru_cache(maxsize=1)
def _input_kernels():
    from . import input_fake_quant_kernels

    return input_fake_quant_kernels


# ----------------------------------------------------------------------------------------------------------------
# Launchers (Triton) and fallbacks (pure torch); inputs are already validated
# ----------------------------------------------------------------------------------------------------------------


def _launch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=True, sig=None) -> torch.Tensor:
    k = _weight_kernels()
    mode, amax_stride = amax_mode(amax, len(weights))
    bs, _ = inner_block(fmt, block_size)
    cfg = weight_kernel_config(fmt)
    # Padded int blocks need the 2-D tiling: its tiles start at a row and mask the columns past the last one (loaded
    # as 0: the zero padding), so no block spans two rows.
    plan = weight_plan(weights, None, bs, two_d=mode == 2 or padded(weights, block_size),
                       tile_elems=cfg["tile"], sig=sig)
    out = torch.empty(plan.total, dtype=weights[0].dtype, device=weights[0].device)
    if plan.n_tiles == 0:
        return out
    amax_arg = amax if amax is not None else plan.table  # any tensor: never read when AMAX_MODE == 0
    uniform = bool(cfg["uniform"]) and plan.uniform
    kwargs = launch_kwargs(out.device)
    kwargs["num_warps"] = cfg["warps"]
    k.grouped_weight_fake_quant_kernel[(plan.n_tiles,)](
        weights[plan.base], out, plan.table, amax_arg, len(weights), amax_stride, plan.u_tiles,
        plan.u_rows, plan.u_cols, plan.u_ctiles,
        **format_constexprs(fmt, block_size), AMAX_MODE=mode,
        TWO_D=plan.two_d, TILE_R=plan.tile_r, TILE_NB=plan.tile_nb, BS=plan.bs, VEC=plan.vec,
        SEARCH_STEPS=plan.steps, UNIFORM=uniform, EVEN=uniform and bool(cfg["even"]) and plan.even,
        NARROW=bool(narrow_range), **rounding_options(cfg, out.device), **kwargs,
    )
    return out


def _torch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    out = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype, device=weights[0].device)
    o = 0
    kw = int_kwargs(fmt, narrow_range)
    for i, w in enumerate(weights):
        out[o : o + w.numel()] = fake_quant(w, fmt, expert_amax(amax, i), block_size, **kw).reshape(-1)
        o += w.numel()
    return out


def _launch_weight_clip_grad(grads, weights, amax, grads_sig=None, weights_sig=None) -> torch.Tensor:
    k = _weight_kernels()
    mode, amax_stride = amax_mode(amax, len(weights))
    plan = weight_plan(grads, weights, 16, two_d=mode == 2, sig=grads_sig, aux_sig=weights_sig)
    out = torch.empty(plan.total, dtype=grads[0].dtype, device=grads[0].device)
    if plan.n_tiles == 0:
        return out
    k.grouped_weight_clip_grad_kernel[(plan.n_tiles,)](
        grads[plan.base], weights[plan.aux_base], out, plan.table, amax, len(weights), amax_stride,
        AMAX_MODE=mode, TWO_D=plan.two_d, TILE_R=plan.tile_r, TILE_NB=plan.tile_nb, BS=plan.bs,
        VEC=plan.vec, SEARCH_STEPS=plan.steps, **launch_kwargs(out.device),
    )
    return out


def _torch_weight_clip_grad(grads, weights, amax) -> torch.Tensor:
    out = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
    o = 0
    for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
        keep = w.abs() <= clip_limit(expert_amax(amax, i))
        out[o : o + g.numel()] = (g * keep).reshape(-1)
        o += g.numel()
    return out


def _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range=True, row_scale=None) -> torch.Tensor:
    """The input kernel; with ``row_scale`` [T] each output row is also multiplied by its scale (same launch)."""
    k = _input_kernels()
    y = torch.empty_like(x)
    t, kdim = x.shape
    if x.numel() == 0:
        return y
    bs, _ = inner_block(fmt, block_size)
    tile_r, tile_nb, tile_w = input_tiling(kdim, bs)
    n = m_splits.numel()
    per_expert = amax is not None and amax.dim() == 1
    amax_arg = amax if amax is not None else m_splits  # never read for block int formats
    k.grouped_input_fake_quant_kernel[(cdiv(t, tile_r), cdiv(kdim, tile_w))](
        x, y, m_splits, amax_arg, row_scale if row_scale is not None else m_splits, t, kdim, n,
        **format_constexprs(fmt, block_size), PER_EXPERT=per_expert,
        N_PAD=next_pow2(n), TILE_R=tile_r, TILE_NB=tile_nb, BS=bs, NARROW=bool(narrow_range),
        HAS_SCALE=row_scale is not None, **rounding_options(weight_kernel_config(fmt), x.device),
        **launch_kwargs(x.device),
    )
    return y


def _torch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    # Per-row amax gives the same bits as fake_quant per row group: every format's arithmetic is row-local.
    return fake_quant(x, fmt, per_row_amax(x, m_splits, amax), block_size, **int_kwargs(fmt, narrow_range))


def _launch_input_clip_grad(grad, x, m_splits, amax, row_scale=None) -> torch.Tensor:
    """The clipped-STE kernel; with ``row_scale`` [T] the gradient is first multiplied by its row's scale."""
    k = _input_kernels()
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


def _torch_input_clip_grad(grad, x, m_splits, amax) -> torch.Tensor:
    return grad * (x.abs() <= clip_limit(per_row_amax(x, m_splits, amax)))


# ----------------------------------------------------------------------------------------------------------------
# Validation and public functions
# ----------------------------------------------------------------------------------------------------------------


def grouped_weight_fake_quant(
    weights: Sequence[torch.Tensor], amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    narrow_range: bool = True,
) -> list[torch.Tensor]:
    """Fake-quantizes N expert weights in one launch, bit-exact with ``formats.fake_quant`` per expert.

    Args:
        weights: N (1 <= N <= 512) contiguous tensors of one dtype (bf16, fp16 or fp32) on one device; shapes may
            differ (a last dim that is a multiple of the block size for block formats).
        amax: per expert ``[N]``, per expert and output channel ``[N, C]`` (2-D ``[C, K]`` experts), or a scalar
            shared by all experts; any float dtype (used as fp32). ``None`` only for int formats with
            ``block_size``. NVFP4 uses it as the global amax.
        fmt: ``"e4m3"``, ``"e5m2"``, ``"nvfp4"``, or ``"int2"`` .. ``"int8"``.
        block_size: int formats only: dynamic per-block amax over blocks of this many elements of the last dim (a
            power of two; a last dim that is not a multiple is zero-padded). NVFP4 always uses blocks of 16.
        narrow_range: int formats only: levels ``[-B, B]`` (True) or ``[-B-1, B]`` (formats.int_range).

    Returns:
        N tensors shaped like ``weights``: views of one new buffer.

    Raises:
        ValueError: on an empty or too long list, mixed dtypes or devices, non-contiguous experts, a bad amax shape,
            device or dtype, an unknown format, or a last dim that is not a multiple of the block size.
    """
    weights, amax, sig = check_weight_fake_quant(weights, amax, fmt, block_size, "grouped_weight_fake_quant")
    if eager():  # the op's body without the dispatcher round trip (list conversions, schema checks)
        flat = _weight_fake_quant_impl(weights, amax, fmt, block_size, bool(narrow_range), sig)
    else:
        flat = torch.ops.modelopt_moe.grouped_weight_fake_quant(weights, amax, fmt, block_size, bool(narrow_range))
    return split_views(flat, weights, sig)


def grouped_weight_clip_grad(
    grads: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], amax: torch.Tensor
) -> list[torch.Tensor]:
    """Clipped straight-through gradient of N experts in one launch: ``grad * (|w| <= amax)``.

    Args:
        grads: N contiguous gradients, shaped like ``weights``, one float dtype.
        weights: the N forward inputs.
        amax: the forward's amax (``[N]``, ``[N, C]`` or scalar); invalid entries clip nothing.

    Returns:
        N gradients, views of one new buffer, in the dtype of ``grads``.

    Raises:
        ValueError: on mismatched lists, shapes, devices, non-contiguous tensors or a bad amax.
    """
    what = "grouped_weight_clip_grad"
    weights, amax, weights_sig = check_weights(weights, what, amax, None, None)
    grads, _, grads_sig = check_weights(grads, what, None, None, None)
    if amax is None:
        raise ValueError(f"{what}: amax is required (use the gradients unchanged for no clipping)")
    if len(grads) != len(weights):
        raise ValueError(f"{what}: {len(grads)} gradients for {len(weights)} experts")
    if grads_sig is None or weights_sig is None or (grads_sig.shapes, grads_sig.devices) != (
            weights_sig.shapes, weights_sig.devices):
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            if g.shape != w.shape:
                raise ValueError(f"{what}: gradient {i} has shape {tuple(g.shape)}, weight has {tuple(w.shape)}")
            if g.device != w.device:
                raise ValueError(f"{what}: gradient {i} is on {g.device}, weight on {w.device}")
    if eager():
        flat = _weight_clip_grad_impl(grads, weights, amax, grads_sig, weights_sig)
    else:
        flat = torch.ops.modelopt_moe.grouped_weight_clip_grad(grads, weights, amax)
    return split_views(flat, grads, grads_sig)


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
        fmt: ``"e4m3"``, ``"e5m2"``, ``"nvfp4"``, or ``"int2"`` .. ``"int8"``.
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


# ----------------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile; register_fake gives the output metadata). No host sync inside.
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("modelopt_moe::grouped_weight_fake_quant", mutates_args=())
def _grouped_weight_fake_quant_op(
    weights: list[torch.Tensor], amax: Optional[torch.Tensor], fmt: str, block_size: Optional[int],  # noqa: UP045
    narrow_range: bool = True,
) -> torch.Tensor:
    return _weight_fake_quant_impl(weights, amax, fmt, block_size, narrow_range)


def _weight_fake_quant_impl(weights, amax, fmt, block_size, narrow_range, sig: Signature | None = None):
    if kernels_available(weights[0].device):
        return _launch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range, sig)
    return _torch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range)


@_grouped_weight_fake_quant_op.register_fake
def _(weights, amax, fmt, block_size, narrow_range=True):
    return weights[0].new_empty(sum(w.numel() for w in weights))


@torch.library.custom_op("modelopt_moe::grouped_weight_clip_grad", mutates_args=())
def _grouped_weight_clip_grad_op(
    grads: list[torch.Tensor], weights: list[torch.Tensor], amax: torch.Tensor
) -> torch.Tensor:
    return _weight_clip_grad_impl(grads, weights, amax)


def _weight_clip_grad_impl(grads, weights, amax, grads_sig=None, weights_sig=None) -> torch.Tensor:
    if kernels_available(weights[0].device):
        return _launch_weight_clip_grad(grads, weights, amax, grads_sig, weights_sig)
    return _torch_weight_clip_grad(grads, weights, amax)


@_grouped_weight_clip_grad_op.register_fake
def _(grads, weights, amax):
    return grads[0].new_empty(sum(g.numel() for g in grads))


@torch.library.custom_op("modelopt_moe::grouped_input_fake_quant", mutates_args=())
def _grouped_input_fake_quant_op(
    x: torch.Tensor, m_splits: torch.Tensor, amax: Optional[torch.Tensor], fmt: str,  # noqa: UP045
    block_size: Optional[int], narrow_range: bool = True,  # noqa: UP045
) -> torch.Tensor:
    return _input_fake_quant_impl(x, m_splits, amax, fmt, block_size, narrow_range)


def _input_fake_quant_impl(x, m_splits, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    if kernels_available(x.device):
        return _launch_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)
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


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------


class GroupedWeightFakeQuant(torch.autograd.Function):
    """``apply(amax, fmt, block_size, ste, narrow_range, *weights) -> tuple of N fake-quantized weights`` (views of
    one buffer).

    Backward: ``ste="pass_through"`` returns the gradients unchanged (no launch); ``"clipped"`` zeroes them where
    ``|w| > amax`` in one launch (no clipping without an amax). amax gets no gradient.
    """

    @staticmethod
    def forward(ctx, amax, fmt, block_size, ste, narrow_range, *weights):
        _save_weight_ste(ctx, ste, amax, weights)
        return tuple(grouped_weight_fake_quant(list(weights), amax, fmt, block_size, narrow_range))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None, *_weight_ste_grads(ctx, grads))


class GroupedWeightSTE(torch.autograd.Function):
    """``apply(amax, ste, values, *weights) -> values`` (as views): fake-quantized weights computed earlier (e.g. kept
    across gradient-accumulation micro-batches) put back into the graph with :class:`GroupedWeightFakeQuant`'s
    backward."""

    @staticmethod
    def forward(ctx, amax, ste, values, *weights):
        _save_weight_ste(ctx, ste, amax, weights)
        # New tensor objects for the same values (a reused list goes into several graphs), made in C, not per expert
        # in Python.
        return tuple(map(torch.Tensor.detach, values))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *_weight_ste_grads(ctx, grads))


def _save_weight_ste(ctx, ste: str, amax: torch.Tensor | None, weights) -> None:
    check_ste(ste)
    ctx.clipped = ste == "clipped" and amax is not None
    if ctx.clipped:
        ctx.save_for_backward(amax, *weights)


def _weight_ste_grads(ctx, grads) -> list:
    """Pass-through: the gradients unchanged (no launch); clipped: zero where ``|w| > amax`` (one launch)."""
    if not ctx.clipped:
        return list(grads)
    amax, *weights = ctx.saved_tensors
    grads = [torch.zeros_like(w) if g is None else g.contiguous() for g, w in zip(grads, weights, strict=True)]
    return grouped_weight_clip_grad(grads, weights, amax)


class GroupedInputFakeQuant(torch.autograd.Function):
    """``apply(x, m_splits, amax, fmt, block_size, ste, narrow_range=True) -> y``: per-expert input fake quant with
    an STE."""

    @staticmethod
    def forward(ctx, x, m_splits, amax, fmt, block_size, ste, narrow_range=True):
        check_ste(ste)
        y = grouped_input_fake_quant(x, m_splits, amax, fmt, block_size, narrow_range)
        ctx.clipped = ste == "clipped" and amax is not None
        if ctx.clipped:
            m = m_splits if isinstance(m_splits, torch.Tensor) else torch.tensor(list(m_splits), device=x.device)
            ctx.save_for_backward(x, m, amax)
        return y

    @staticmethod
    def backward(ctx, grad):
        if not ctx.clipped:
            return grad, None, None, None, None, None, None
        x, m_splits, amax = ctx.saved_tensors
        return grouped_input_clip_grad(grad.contiguous(), x, m_splits, amax), None, None, None, None, None, None


def grouped_weight_fake_quant_ste(
    weights: Sequence[torch.Tensor], amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    ste: str = "pass_through", narrow_range: bool = True,
) -> list[torch.Tensor]:
    """Differentiable :func:`grouped_weight_fake_quant` (see :class:`GroupedWeightFakeQuant`)."""
    return list(GroupedWeightFakeQuant.apply(amax, fmt, block_size, ste, narrow_range, *weights))


def grouped_input_fake_quant_ste(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    ste: str = "pass_through", narrow_range: bool = True,
) -> torch.Tensor:
    """Differentiable :func:`grouped_input_fake_quant` (see :class:`GroupedInputFakeQuant`)."""
    return GroupedInputFakeQuant.apply(x, m_splits, amax, fmt, block_size, ste, narrow_range)
