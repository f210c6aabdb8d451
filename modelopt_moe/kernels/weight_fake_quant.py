"""Fake quantization of N expert weights in one launch, bit-exact with ``formats.fake_quant`` per expert, and its
clipped straight-through gradient.

Parts, in this order (the ``@triton.jit`` code is in :mod:`.weight_fake_quant_kernels`, imported on the first launch
so that this module imports with torch alone and ``TRITON_INTERPRET=1`` may be set any time before):

1. launchers: :func:`grouped_weight_fake_quant` and :func:`grouped_weight_clip_grad` validate their inputs with
   ``ValueError`` and run the op (in eager mode without the dispatcher round trip); ``_launch_*`` run the kernels;
2. pure-torch fallbacks (``_torch_*``: :func:`formats.fake_quant` per expert), used where
   :func:`~.launch.kernels_available` is False;
3. ``torch.library.custom_op`` s in the ``modelopt_moe`` namespace, each with ``register_fake``;
4. autograd: :class:`GroupedWeightFakeQuant`, :class:`GroupedWeightSTE` (pass-through or clipped straight-through
   estimator).

The N experts stay separate tensors (TE's ``weight0..weight{N-1}``): the kernel reads them through the cached
pointer table of :mod:`.launch`, so nothing is stacked. The output is ONE new buffer; the launchers return N views of
it shaped like the inputs.

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
from . import fp8_block_fake_quant as fp8_blocks
from .checks import check_ste, check_weight_fake_quant, check_weights
from .fallback import expert_amax, int_kwargs
from .launch import (
    Signature,
    amax_mode,
    eager,
    format_constexprs,
    inner_block,
    kernels_available,
    kernels_take,
    launch_kwargs,
    padded,
    rounding_options,
    split_views,
    weight_plan,
)
from .tuning import weight_kernel_config

__all__ = [
    "grouped_weight_fake_quant",
    "grouped_weight_clip_grad",
    "GroupedWeightFakeQuant",
    "GroupedWeightSTE",
    "grouped_weight_fake_quant_ste",
]


@functools.lru_cache(maxsize=1)
def _kernels():
    from . import weight_fake_quant_kernels

    return weight_fake_quant_kernels


# ----------------------------------------------------------------------------------------------------------------
# Launchers
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
        fmt: a registered format name (:data:`modelopt_moe.numerics.FORMATS`).
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
    elif isinstance(block_size, tuple):  # 2-D blocks: the op schema's block size is an int
        flat = torch.ops.modelopt_moe.grouped_weight_block2d_fake_quant(weights, fmt, *block_size)
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


def _launch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=True, sig=None) -> torch.Tensor:
    k = _kernels()
    mode, amax_stride = amax_mode(amax, len(weights))
    bs, _ = inner_block(fmt, block_size)
    cfg = weight_kernel_config(fmt)
    # Padded int blocks need the 2-D tiling: its tiles start at a row and mask the columns past the last one (loaded
    # as 0: the zero padding), so no block spans two rows.
    plan = weight_plan(weights, None, bs, two_d=mode == 2 or padded(weights, fmt, block_size), tile_elems=cfg["tile"],
                       sig=sig)
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


def _launch_weight_clip_grad(grads, weights, amax, grads_sig=None, weights_sig=None) -> torch.Tensor:
    k = _kernels()
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


# ----------------------------------------------------------------------------------------------------------------
# Torch fallbacks
# ----------------------------------------------------------------------------------------------------------------
def _torch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range=True) -> torch.Tensor:
    out = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype, device=weights[0].device)
    o = 0
    kw = int_kwargs(fmt, narrow_range)
    for i, w in enumerate(weights):
        out[o : o + w.numel()] = fake_quant(w, fmt, expert_amax(amax, i), block_size, **kw).reshape(-1)
        o += w.numel()
    return out


def _torch_weight_clip_grad(grads, weights, amax) -> torch.Tensor:
    out = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
    o = 0
    for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
        keep = w.abs() <= clip_limit(expert_amax(amax, i))
        out[o : o + g.numel()] = (g * keep).reshape(-1)
        o += g.numel()
    return out


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
    if kernels_available(weights[0].device) and kernels_take(fmt, block_size):
        return _launch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range, sig)
    if kernels_available(weights[0].device) and fp8_blocks.takes_weights(fmt, block_size, weights):
        return fp8_blocks.weight_blocks_fake_quant(weights, fmt, block_size, sig)
    return _torch_weight_fake_quant(weights, amax, fmt, block_size, narrow_range)


@_grouped_weight_fake_quant_op.register_fake
def _(weights, amax, fmt, block_size, narrow_range=True):
    return weights[0].new_empty(sum(w.numel() for w in weights))


# The op above takes an int block size; traced calls with 2-D blocks (rows, cols) go through this one.
@torch.library.custom_op("modelopt_moe::grouped_weight_block2d_fake_quant", mutates_args=())
def _grouped_weight_block2d_op(weights: list[torch.Tensor], fmt: str, rows: int, cols: int) -> torch.Tensor:
    return _weight_fake_quant_impl(weights, None, fmt, (rows, cols), True)


@_grouped_weight_block2d_op.register_fake
def _(weights, fmt, rows, cols):
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
        """Fake-quantizes the N weights in one launch, keeping what the clipped STE's backward needs."""
        _save_weight_ste(ctx, ste, amax, weights)
        return tuple(grouped_weight_fake_quant(list(weights), amax, fmt, block_size, narrow_range))

    @staticmethod
    def backward(ctx, *grads):
        """The weights' gradients through the STE (class docstring); the other arguments get none."""
        return (None, None, None, None, None, *_weight_ste_grads(ctx, grads))


class GroupedWeightSTE(torch.autograd.Function):
    """``apply(amax, ste, values, *weights) -> values`` (as views): fake-quantized weights computed earlier (e.g. kept
    across gradient-accumulation micro-batches) put back into the graph with :class:`GroupedWeightFakeQuant`'s
    backward."""

    @staticmethod
    def forward(ctx, amax, ste, values, *weights):
        """Returns ``values`` as new tensor objects, keeping what the clipped STE's backward needs."""
        _save_weight_ste(ctx, ste, amax, weights)
        # New tensor objects for the same values (a reused list goes into several graphs), made in C, not per expert
        # in Python.
        return tuple(map(torch.Tensor.detach, values))

    @staticmethod
    def backward(ctx, *grads):
        """The weights' gradients through the STE, as :class:`GroupedWeightFakeQuant`'s; ``values`` gets none."""
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


def grouped_weight_fake_quant_ste(
    weights: Sequence[torch.Tensor], amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    ste: str = "pass_through", narrow_range: bool = True,
) -> list[torch.Tensor]:
    """Differentiable :func:`grouped_weight_fake_quant` (see :class:`GroupedWeightFakeQuant`)."""
    return list(GroupedWeightFakeQuant.apply(amax, fmt, block_size, ste, narrow_range, *weights))
