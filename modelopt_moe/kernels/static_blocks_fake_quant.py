"""Fake quantization of N expert weights with STATIC two-level block scales (NVFP4's ``block_sizes.type: static``) in
one launch, bit-exact with ``Format.fake_quant_static`` per expert, and its clipped straight-through gradient.

Each expert has its second-level amax (``amax[i]``) and one calibrated amax per block of the weight
(``block_amax[i]``, ``[..., K // block]``); the kernels are the grouped weight kernels' flat tiling and pointer table
(:mod:`.launch`) with the block amaxes read beside the weights (:mod:`.weight_fake_quant_kernels`).

Parts, in this order: launchers (:func:`grouped_static_blocks_fake_quant`, :func:`grouped_static_blocks_clip_grad`,
with their ``ValueError`` checks); pure-torch fallbacks (the reference per expert, used where
:func:`~.launch.kernels_available` is False); ``torch.library.custom_op`` s with ``register_fake``; autograd
(:class:`GroupedStaticBlocksFakeQuant`, :class:`GroupedStaticBlocksSTE`).

Backward: the straight-through estimator of ``StaticBlocksSTE`` (the quantizer's one-expert path): pass-through, or
clipped where ``|w|`` exceeds its block's amax. The block amaxes get no gradient here: for a LEARNED block amax
(``weight_amax_update: learned``) the quantizer takes this forward and computes the gradient with torch expert by
expert, since it sums each block's 16 terms with torch's own reduction, in an order that depends on the device and its
vector width, so no kernel can give its bits everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..numerics import KernelRoutine, get_format
from ..numerics.nvfp4 import within_block_amax
from .checks import check_ste, check_weight_fake_quant, check_weights
from .launch import (
    eager,
    kernels_available,
    launch_kwargs,
    rounding_options,
    split_views,
    weight_plan,
)
from .tuning import weight_kernel_config

__all__ = [
    "static_blocks_kernel_takes",
    "grouped_static_blocks_fake_quant",
    "grouped_static_blocks_clip_grad",
    "GroupedStaticBlocksFakeQuant",
    "GroupedStaticBlocksSTE",
    "grouped_static_blocks_fake_quant_ste",
]


@functools.lru_cache(maxsize=1)
def _kernels():
    from . import weight_fake_quant_kernels

    return weight_fake_quant_kernels


def static_blocks_kernel_takes(fmt: str) -> bool:
    """Whether format ``fmt``'s static block scales have a kernel (two-level E2M1 blocks)."""
    kernel = get_format(fmt).kernel
    return kernel is not None and kernel.routine == KernelRoutine.TWO_LEVEL_E2M1


def _check_blocks(weights: list[torch.Tensor], block_amax, fmt: str, what: str) -> torch.Tensor:
    """``block_amax`` as a contiguous fp32 ``[N, ..., K // block]`` after checking it against the experts."""
    if not isinstance(block_amax, torch.Tensor) or not block_amax.is_floating_point():
        raise ValueError(f"{what}: block_amax must be a floating tensor, got "
                         f"{getattr(block_amax, 'dtype', type(block_amax).__name__)}")
    w0 = weights[0]
    if block_amax.device != w0.device:
        raise ValueError(f"{what}: block_amax is on {block_amax.device} but the experts are on {w0.device}")
    b = get_format(fmt).block_length
    expected = (len(weights), *w0.shape[:-1], w0.shape[-1] // b) if w0.dim() else None
    if tuple(block_amax.shape) != expected or any(w.shape != w0.shape for w in weights):
        raise ValueError(f"{what}: block_amax of shape {tuple(block_amax.shape)} does not fit {len(weights)} experts "
                         f"of shape {tuple(w0.shape)}; expected {expected} (one amax per block of {b}, experts of "
                         "one shape)")
    return block_amax.float().contiguous()


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def grouped_static_blocks_fake_quant(weights: Sequence[torch.Tensor], amax: torch.Tensor, block_amax: torch.Tensor,
                                     fmt: str, scale_max: float) -> list[torch.Tensor]:
    """Fake-quantizes N expert weights with static block scales in one launch, bit-exact with
    ``get_format(fmt).fake_quant_static(weights[i], amax[i], block_amax[i], scale_max)``.

    Args:
        weights: N (1 <= N <= 512) contiguous experts of one shape and dtype (bf16, fp16 or fp32) on one device, the
            last dim a multiple of the format's block.
        amax: the second-level amax per expert ``[N]``, or a scalar shared by all.
        block_amax: ``[N, ..., K // block]``, one amax per block of each expert (any float dtype, used as fp32).
        fmt: a format with two-level E2M1 blocks (NVFP4).
        scale_max: the block scales' normalization: 448, or 256 for 4-over-6.

    Returns:
        N tensors shaped like ``weights``: views of one new buffer.

    Raises:
        ValueError: a bad list of experts, amax, block amax shape or device, or a format without static blocks.
    """
    what = "grouped_static_blocks_fake_quant"
    if not static_blocks_kernel_takes(fmt):
        raise ValueError(f"{what}: format {fmt!r} has no static two-level block scales")
    if amax is None or amax.dim() > 1:
        raise ValueError(f"{what}: amax must be [N] or a scalar, got "
                         f"{None if amax is None else tuple(amax.shape)}")
    weights, amax, sig = check_weight_fake_quant(weights, amax, fmt, None, what)
    blocks = _check_blocks(weights, block_amax, fmt, what)
    if eager():
        flat = _static_blocks_impl(weights, amax, blocks, fmt, float(scale_max), sig)
    else:
        flat = torch.ops.modelopt_moe.grouped_static_blocks_fake_quant(weights, amax, blocks, fmt, float(scale_max))
    return split_views(flat, weights, sig)


def grouped_static_blocks_clip_grad(grads: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                                    block_amax: torch.Tensor, fmt: str) -> list[torch.Tensor]:
    """The clipped straight-through gradient of static block scales in one launch: ``grad`` where ``|w|`` is at most
    its block's amax, else ``grad * 0``.

    Args:
        grads: N contiguous gradients shaped like ``weights``, one float dtype.
        weights: the N forward inputs.
        block_amax: the forward's ``[N, ..., K // block]``.
        fmt: the forward's format (its block length).

    Returns:
        N gradients, views of one new buffer, in the dtype of ``grads``.

    Raises:
        ValueError: on mismatched lists, shapes, devices or a bad block amax.
    """
    what = "grouped_static_blocks_clip_grad"
    weights, _, weights_sig = check_weights(weights, what, None, fmt, None)
    grads, _, grads_sig = check_weights(grads, what, None, None, None)
    if len(grads) != len(weights) or any(g.shape != w.shape for g, w in zip(grads, weights, strict=False)):
        raise ValueError(f"{what}: gradients of shapes {[tuple(g.shape) for g in grads]} do not match the weights' "
                         f"{[tuple(w.shape) for w in weights]}")
    if any(g.device != weights[0].device for g in grads):
        raise ValueError(f"{what}: gradients on {grads[0].device}, weights on {weights[0].device}")
    blocks = _check_blocks(weights, block_amax, fmt, what)
    if eager():
        flat = _clip_grad_impl(grads, weights, blocks, fmt, grads_sig, weights_sig)
    else:
        flat = torch.ops.modelopt_moe.grouped_static_blocks_clip_grad(grads, weights, blocks, fmt)
    return split_views(flat, grads, grads_sig)


def _launch_fake_quant(weights, amax, blocks, fmt, scale_max, sig=None) -> torch.Tensor:
    k = _kernels()
    spec = get_format(fmt)
    cfg = weight_kernel_config(fmt)
    plan = weight_plan(weights, None, spec.block_length, two_d=False, tile_elems=cfg["tile"], sig=sig)
    out = torch.empty(plan.total, dtype=weights[0].dtype, device=weights[0].device)
    if plan.n_tiles == 0:
        return out
    uniform = bool(cfg["uniform"]) and plan.uniform
    kwargs = launch_kwargs(out.device)
    kwargs["num_warps"] = cfg["warps"]
    opts = rounding_options(cfg, out.device)
    opts.pop("FAST_MAX")  # the block max is not taken: the block amaxes are given
    k.grouped_static_blocks_fake_quant_kernel[(plan.n_tiles,)](
        weights[plan.base], out, plan.table, amax, blocks, len(weights), 1 if amax.dim() else 0, plan.u_tiles,
        plan.u_rows, plan.u_cols, plan.u_ctiles, BOUND=spec.element_max * scale_max, TILE_R=plan.tile_r,
        TILE_NB=plan.tile_nb, BS=plan.bs, VEC=plan.vec, SEARCH_STEPS=plan.steps, UNIFORM=uniform,
        EVEN=uniform and bool(cfg["even"]) and plan.even, **opts, **kwargs,
    )
    return out


def _launch_clip_grad(grads, weights, blocks, fmt, grads_sig=None, weights_sig=None) -> torch.Tensor:
    k = _kernels()
    plan = weight_plan(grads, weights, get_format(fmt).block_length, two_d=False, sig=grads_sig,
                       aux_sig=weights_sig)
    out = torch.empty(plan.total, dtype=grads[0].dtype, device=grads[0].device)
    if plan.n_tiles == 0:
        return out
    k.grouped_static_blocks_clip_grad_kernel[(plan.n_tiles,)](
        grads[plan.base], weights[plan.aux_base], out, plan.table, blocks, len(weights), TILE_R=plan.tile_r,
        TILE_NB=plan.tile_nb, BS=plan.bs, VEC=plan.vec, SEARCH_STEPS=plan.steps, **launch_kwargs(out.device),
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Torch fallbacks: the reference, expert by expert
# ----------------------------------------------------------------------------------------------------------------
def _torch_fake_quant(weights, amax, blocks, fmt, scale_max) -> torch.Tensor:
    spec = get_format(fmt)
    return torch.cat([spec.fake_quant_static(w, amax[i] if amax.dim() else amax, blocks[i], scale_max).reshape(-1)
                      for i, w in enumerate(weights)])


def _torch_clip_grad(grads, weights, blocks, fmt) -> torch.Tensor:
    b = get_format(fmt).block_length
    out = []
    for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
        out.append((g * within_block_amax(w, blocks[i], b)).reshape(-1))
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile; register_fake gives the output metadata). No host sync inside.
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_moe::grouped_static_blocks_fake_quant", mutates_args=())
def _static_blocks_op(weights: list[torch.Tensor], amax: torch.Tensor, block_amax: torch.Tensor, fmt: str,
                      scale_max: float) -> torch.Tensor:
    return _static_blocks_impl(weights, amax, block_amax, fmt, scale_max)


def _static_blocks_impl(weights, amax, blocks, fmt, scale_max, sig=None) -> torch.Tensor:
    if kernels_available(weights[0].device):
        return _launch_fake_quant(weights, amax, blocks, fmt, scale_max, sig)
    return _torch_fake_quant(weights, amax, blocks, fmt, scale_max)


@_static_blocks_op.register_fake
def _(weights, amax, block_amax, fmt, scale_max):
    return weights[0].new_empty(sum(w.numel() for w in weights))


@torch.library.custom_op("modelopt_moe::grouped_static_blocks_clip_grad", mutates_args=())
def _clip_grad_op(grads: list[torch.Tensor], weights: list[torch.Tensor], block_amax: torch.Tensor,
                  fmt: str) -> torch.Tensor:
    return _clip_grad_impl(grads, weights, block_amax, fmt)


def _clip_grad_impl(grads, weights, blocks, fmt, grads_sig=None, weights_sig=None) -> torch.Tensor:
    if kernels_available(weights[0].device):
        return _launch_clip_grad(grads, weights, blocks, fmt, grads_sig, weights_sig)
    return _torch_clip_grad(grads, weights, blocks, fmt)


@_clip_grad_op.register_fake
def _(grads, weights, block_amax, fmt):
    return grads[0].new_empty(sum(g.numel() for g in grads))


# ----------------------------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------------------------
class GroupedStaticBlocksFakeQuant(torch.autograd.Function):
    """``apply(amax, block_amax, fmt, scale_max, ste, *weights) -> tuple of N fake-quantized weights`` (views of one
    buffer). Backward: ``ste="pass_through"`` the gradients unchanged (no launch); ``"clipped"`` zero where ``|w|``
    exceeds its block's amax (one launch). The amaxes get no gradient."""

    @staticmethod
    def forward(ctx, amax, block_amax, fmt, scale_max, ste, *weights):
        """Fake-quantizes the N weights in one launch, keeping what the clipped STE's backward needs."""
        _save_ste(ctx, ste, block_amax, fmt, weights)
        return tuple(grouped_static_blocks_fake_quant(list(weights), amax, block_amax, fmt, scale_max))

    @staticmethod
    def backward(ctx, *grads):
        """The weights' gradients through the STE; the other arguments get none."""
        return (None, None, None, None, None, *_ste_grads(ctx, grads))


class GroupedStaticBlocksSTE(torch.autograd.Function):
    """``apply(block_amax, fmt, ste, values, *weights) -> values`` (as views): values computed earlier (kept or
    reused) put back into the graph with :class:`GroupedStaticBlocksFakeQuant`'s backward."""

    @staticmethod
    def forward(ctx, block_amax, fmt, ste, values, *weights):
        """Returns ``values`` as new tensor objects, keeping what the clipped STE's backward needs."""
        _save_ste(ctx, ste, block_amax, fmt, weights)
        return tuple(map(torch.Tensor.detach, values))

    @staticmethod
    def backward(ctx, *grads):
        """The weights' gradients through the STE; ``values`` gets none."""
        return (None, None, None, None, *_ste_grads(ctx, grads))


def _save_ste(ctx, ste: str, block_amax: torch.Tensor, fmt: str, weights) -> None:
    check_ste(ste)
    ctx.clipped, ctx.fmt = ste == "clipped", fmt
    if ctx.clipped:
        ctx.save_for_backward(block_amax.detach(), *weights)


def _ste_grads(ctx, grads) -> list:
    if not ctx.clipped:
        return list(grads)
    blocks, *weights = ctx.saved_tensors
    grads = [torch.zeros_like(w) if g is None else g.contiguous() for g, w in zip(grads, weights, strict=True)]
    return grouped_static_blocks_clip_grad(grads, weights, blocks, ctx.fmt)


def grouped_static_blocks_fake_quant_ste(weights: Sequence[torch.Tensor], amax: torch.Tensor,
                                         block_amax: torch.Tensor, fmt: str, scale_max: float,
                                         ste: str = "pass_through") -> list[torch.Tensor]:
    """Differentiable :func:`grouped_static_blocks_fake_quant` (see :class:`GroupedStaticBlocksFakeQuant`)."""
    return list(GroupedStaticBlocksFakeQuant.apply(amax, block_amax.detach(), fmt, float(scale_max), ste, *weights))
