"""The amax of N expert weights in one launch (``weight_amax_update: dynamic``): ``max |w|`` of each expert, or of
each row of each expert, NaN ignored, bit for bit equal to the torch maximum. No host synchronisation on the device
path.

Parts, in this order (the ``@triton.jit`` code is in :mod:`.weight_amax_kernels`, imported on the first launch):

1. launcher: :func:`grouped_weight_amax` validates its inputs with ``ValueError`` and runs the op;
   ``_launch_weight_amax`` runs the kernel;
2. the pure-torch fallback, used where :func:`~.launch.kernels_available` is False;
3. the ``torch.library.custom_op`` with ``register_fake``.

No autograd: an amax takes no gradient.
"""

import functools
from collections.abc import Sequence

import torch

from .checks import check_weights
from .launch import eager, kernels_available, launch_kwargs, weight_plan

__all__ = ["grouped_weight_amax"]


@functools.lru_cache(maxsize=1)
def _kernels():
    from . import weight_amax_kernels

    return weight_amax_kernels


# ----------------------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------------------
def grouped_weight_amax(weights: Sequence[torch.Tensor], per_channel: bool = False) -> torch.Tensor:
    """``max |w|`` of each of N expert weights (NaN ignored) in one launch, bit-exact with the torch reference.

    Args:
        weights: N (1 <= N <= 512) contiguous tensors of one float dtype on one device (shapes may differ).
        per_channel: one amax per row (output channel) of each 2-D ``[C, K]`` expert instead of one per expert.

    Returns:
        float32 ``[N]``, or ``[N, C]`` with ``per_channel`` (an empty expert's amax is 0).

    Raises:
        ValueError: on an empty or too long list, mixed dtypes or devices, non-contiguous experts, or (per channel)
            experts that are not 2-D with the same number of rows.
    """
    weights, _, sig = check_weights(weights, "grouped_weight_amax", None, None, None)
    if per_channel:
        rows = {w.shape[0] if w.dim() == 2 else None for w in weights}
        if len(rows) != 1 or None in rows:
            raise ValueError(f"grouped_weight_amax: per_channel needs 2-D experts with one row count, got shapes "
                             f"{[tuple(w.shape) for w in weights]}")
    if eager():  # the op's body without the dispatcher round trip
        return _weight_amax_impl(weights, bool(per_channel), sig)
    return torch.ops.modelopt_moe.grouped_weight_amax(weights, bool(per_channel))


def _launch_weight_amax(weights, per_channel: bool, sig=None) -> torch.Tensor:
    n = len(weights)
    out = torch.zeros((n, weights[0].shape[0]) if per_channel else (n,), dtype=torch.float32,
                      device=weights[0].device)
    plan = weight_plan(weights, None, 16, two_d=per_channel, sig=sig)
    if plan.n_tiles == 0:
        return out
    _kernels().grouped_weight_amax_kernel[(plan.n_tiles,)](
        weights[plan.base], out, plan.table, n, plan.u_tiles, plan.u_rows, plan.u_cols, plan.u_ctiles,
        PER_ROW=per_channel, TILE_R=plan.tile_r, TILE_NB=plan.tile_nb, BS=plan.bs, VEC=plan.vec,
        SEARCH_STEPS=plan.steps, UNIFORM=plan.uniform, num_warps=launch_kwargs(out.device)["num_warps"],
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Torch fallback
# ----------------------------------------------------------------------------------------------------------------
def _abs_max(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    a = w.detach().abs().float()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    if per_channel:
        return a.reshape(a.shape[0], -1).amax(dim=1) if a.numel() else torch.zeros(a.shape[0], device=a.device)
    return a.amax() if a.numel() else torch.zeros((), device=a.device)


def _torch_weight_amax(weights, per_channel: bool) -> torch.Tensor:
    return torch.stack([_abs_max(w, per_channel) for w in weights])


# ----------------------------------------------------------------------------------------------------------------
# Custom op
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_moe::grouped_weight_amax", mutates_args=())
def _grouped_weight_amax_op(weights: list[torch.Tensor], per_channel: bool) -> torch.Tensor:
    return _weight_amax_impl(weights, per_channel)


def _weight_amax_impl(weights, per_channel: bool, sig=None) -> torch.Tensor:
    if kernels_available(weights[0].device):
        return _launch_weight_amax(weights, per_channel, sig)
    return _torch_weight_amax(weights, per_channel)


@_grouped_weight_amax_op.register_fake
def _(weights, per_channel):
    shape = (len(weights), weights[0].shape[0]) if per_channel else (len(weights),)
    return weights[0].new_empty(shape, dtype=torch.float32)
