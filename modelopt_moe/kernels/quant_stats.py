"""Fake quant of N experts with quantization-error sums, in one launch (precision autoswitch).

Contracts: the fake-quantized values equal :func:`~modelopt_moe.numerics.fake_quant` bit for bit (the same tile code
as the plain kernels of :mod:`.weight_fake_quant` and :mod:`.input_fake_quant`). The statistics are
:func:`~modelopt_moe.numerics.quant_error_sums` per expert: counts exact, the two sums of squares to a relative 1e-5
(fp32 tile sums, then float64). No host synchronisation on the device paths.

Parts, in this order (the ``@triton.jit`` code is in :mod:`.quant_stats_kernels`, imported on the first launch):

1. launchers: :func:`grouped_weight_fake_quant_stats` and :func:`grouped_input_fake_quant_stats` validate their
   inputs with ``ValueError`` and run the op; ``_launch_*`` run the kernels;
2. pure-torch fallbacks (``_torch_*``), used where :func:`~.launch.kernels_available` is False, and
   :func:`expert_row_sums`;
3. ``torch.library.custom_op`` s with ``register_fake``.

No autograd of its own: the values go into the graph through :class:`~.weight_fake_quant.GroupedWeightSTE` and
:class:`~.input_fake_quant.GroupedInputSTE`.
"""

import functools
from collections.abc import Sequence
from typing import Optional

import torch

from ..numerics import fake_quant, quant_error_sums
from .checks import check_input_fake_quant, check_weight_fake_quant
from .fallback import expert_amax, int_kwargs, per_row_amax
from .launch import (
    COL_TILE0,
    amax_mode,
    cdiv,
    eager,
    format_constexprs,
    inner_block,
    input_tiling,
    kernels_available,
    kernels_take,
    launch_kwargs,
    next_pow2,
    padded,
    split_views,
    weight_plan,
)
from .tuning import weight_kernel_config

__all__ = ["grouped_weight_fake_quant_stats", "grouped_input_fake_quant_stats", "expert_row_sums"]


@functools.lru_cache(maxsize=1)
def _kernels():
    from . import quant_stats_kernels

    return quant_stats_kernels


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------
def grouped_weight_fake_quant_stats(
    weights: Sequence[torch.Tensor], amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    narrow_range: bool = True,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`~.weight_fake_quant.grouped_weight_fake_quant` (same arguments, same bits) that also returns each
    expert's quantization-error sums (:func:`~modelopt_moe.numerics.quant_error_sums`), from the same launch.

    Returns:
        (N fake-quantized tensors, views of one new buffer; float64 ``[N, 4]`` sums).

    Raises:
        ValueError: as :func:`~.weight_fake_quant.grouped_weight_fake_quant`.
    """
    weights, amax, sig = check_weight_fake_quant(weights, amax, fmt, block_size, "grouped_weight_fake_quant_stats")
    if eager():
        flat, stats = _weight_stats_impl(weights, amax, fmt, block_size, bool(narrow_range), sig)
    else:
        flat, stats = torch.ops.modelopt_moe.grouped_weight_fake_quant_stats(weights, amax, fmt, block_size,
                                                                             bool(narrow_range))
    return split_views(flat, weights, sig), stats


def grouped_input_fake_quant_stats(
    x: torch.Tensor, m_splits, amax: torch.Tensor | None, fmt: str, block_size: int | None = None,
    narrow_range: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.input_fake_quant.grouped_input_fake_quant` (same arguments, same bits) that also returns each
    expert's quantization-error sums over its rows, from the same launch.

    Returns:
        (``y`` shaped like ``x``; float64 ``[N, 4]`` sums).

    Raises:
        ValueError: as :func:`~.input_fake_quant.grouped_input_fake_quant`.
    """
    m_splits, amax = check_input_fake_quant(x, m_splits, amax, fmt, block_size, "grouped_input_fake_quant_stats")
    op = _input_stats_impl if eager() else torch.ops.modelopt_moe.grouped_input_fake_quant_stats
    return op(x, m_splits, amax, fmt, block_size, bool(narrow_range))


def _tile_counts(plan, n: int) -> list[int]:
    """Tiles of each expert, from the host copy of the plan's table (no device sync)."""
    tile0 = plan.host[:, COL_TILE0].tolist()
    return [b - a for a, b in zip(tile0, [*tile0[1:], plan.n_tiles], strict=True)][:n]


def _launch_weight_stats(weights, amax, fmt, block_size, narrow_range=True,
                         sig=None) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(weights)
    mode, amax_stride = amax_mode(amax, n)
    bs, _ = inner_block(fmt, block_size)
    plan = weight_plan(weights, None, bs, two_d=mode == 2 or padded(weights, fmt, block_size),
                       tile_elems=weight_kernel_config(fmt)["tile"], sig=sig)
    device = weights[0].device
    out = torch.empty(plan.total, dtype=weights[0].dtype, device=device)
    partial = torch.zeros(plan.n_tiles, 4, dtype=torch.float32, device=device)
    if plan.n_tiles:
        _kernels().grouped_weight_fake_quant_stats_kernel[(plan.n_tiles,)](
            weights[plan.base], out, partial, plan.table, amax if amax is not None else plan.table, n, amax_stride,
            plan.u_tiles, plan.u_rows, plan.u_cols, plan.u_ctiles,
            **format_constexprs(fmt, block_size),
            AMAX_MODE=mode, TWO_D=plan.two_d, TILE_R=plan.tile_r, TILE_NB=plan.tile_nb, BS=plan.bs,
            VEC=plan.vec, SEARCH_STEPS=plan.steps, UNIFORM=plan.uniform, NARROW=bool(narrow_range),
            **launch_kwargs(device),
        )
    partial = partial.double()
    if plan.uniform:
        stats = partial.view(n, plan.u_tiles, 4).sum(1)
    else:
        stats = torch.stack([p.sum(0) for p in partial.split(_tile_counts(plan, n))])
    return out, stats


def _launch_input_stats(x, m_splits, amax, fmt, block_size, narrow_range=True) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x)
    t, kdim = x.shape
    bs, _ = inner_block(fmt, block_size)
    tile_r, tile_nb, tile_w = input_tiling(kdim, bs)
    n_ctiles = max(1, cdiv(kdim, tile_w))
    partial = torch.zeros(t, n_ctiles, 4, dtype=torch.float32, device=x.device)
    n = m_splits.numel()
    if x.numel():
        _kernels().grouped_input_fake_quant_stats_kernel[(cdiv(t, tile_r), n_ctiles)](
            x, y, partial, m_splits, amax if amax is not None else m_splits, t, kdim, n, n_ctiles,
            **format_constexprs(fmt, block_size),
            PER_EXPERT=amax is not None and amax.dim() == 1, N_PAD=next_pow2(n), TILE_R=tile_r, TILE_NB=tile_nb,
            BS=bs, NARROW=bool(narrow_range), **launch_kwargs(x.device),
        )
    return y, _rows_to_experts(partial.sum(1, dtype=torch.float64), m_splits)


# ----------------------------------------------------------------------------------------------------------------
# Torch fallbacks
# ----------------------------------------------------------------------------------------------------------------
def _torch_weight_stats(weights, amax, fmt, block_size, narrow_range=True) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype, device=weights[0].device)
    stats, o = [], 0
    for i, w in enumerate(weights):
        y = fake_quant(w, fmt, expert_amax(amax, i), block_size, **int_kwargs(fmt, narrow_range))
        out[o : o + w.numel()] = y.reshape(-1)
        stats.append(quant_error_sums(w, y))
        o += w.numel()
    return out, torch.stack(stats)


def _torch_input_stats(x, m_splits, amax, fmt, block_size, narrow_range=True) -> tuple[torch.Tensor, torch.Tensor]:
    y = fake_quant(x, fmt, per_row_amax(x, m_splits, amax), block_size, **int_kwargs(fmt, narrow_range))
    return y, _rows_to_experts(quant_error_sums(x, y, keep_rows=True), m_splits)


def expert_row_sums(x: torch.Tensor, y: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """Per-expert quantization-error sums of a token matrix ``x`` and its fake quant ``y`` (rows grouped by the
    device tensor ``m_splits``), in torch: float64 ``[N, 4]``."""
    return _rows_to_experts(quant_error_sums(x, y, keep_rows=True), m_splits)


def _rows_to_experts(row_stats: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
    """``[T, 4]`` float64 per-row sums -> ``[N, 4]`` per expert (rows grouped by ``m_splits``, on the device)."""
    n = m_splits.numel()
    owner = torch.repeat_interleave(torch.arange(n, device=row_stats.device), m_splits.long(),
                                    output_size=row_stats.shape[0])
    return torch.zeros(n, 4, dtype=torch.float64, device=row_stats.device).index_add_(0, owner, row_stats)


# ----------------------------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("modelopt_moe::grouped_weight_fake_quant_stats", mutates_args=())
def _grouped_weight_fake_quant_stats_op(
    weights: list[torch.Tensor], amax: Optional[torch.Tensor], fmt: str, block_size: Optional[int],  # noqa: UP045
    narrow_range: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _weight_stats_impl(weights, amax, fmt, block_size, narrow_range)


def _weight_stats_impl(weights, amax, fmt, block_size, narrow_range=True, sig=None):
    if kernels_available(weights[0].device) and kernels_take(fmt, block_size):
        return _launch_weight_stats(weights, amax, fmt, block_size, narrow_range, sig)
    return _torch_weight_stats(weights, amax, fmt, block_size, narrow_range)


@_grouped_weight_fake_quant_stats_op.register_fake
def _(weights, amax, fmt, block_size, narrow_range=True):
    return (weights[0].new_empty(sum(w.numel() for w in weights)),
            weights[0].new_empty((len(weights), 4), dtype=torch.float64))


@torch.library.custom_op("modelopt_moe::grouped_input_fake_quant_stats", mutates_args=())
def _grouped_input_fake_quant_stats_op(
    x: torch.Tensor, m_splits: torch.Tensor, amax: Optional[torch.Tensor], fmt: str,  # noqa: UP045
    block_size: Optional[int], narrow_range: bool = True,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor]:
    return _input_stats_impl(x, m_splits, amax, fmt, block_size, narrow_range)


def _input_stats_impl(x, m_splits, amax, fmt, block_size, narrow_range=True) -> tuple[torch.Tensor, torch.Tensor]:
    if kernels_available(x.device) and kernels_take(fmt, block_size):
        return _launch_input_stats(x, m_splits, amax, fmt, block_size, narrow_range)
    return _torch_input_stats(x, m_splits, amax, fmt, block_size, narrow_range)


@_grouped_input_fake_quant_stats_op.register_fake
def _(x, m_splits, amax, fmt, block_size, narrow_range=True):
    return torch.empty_like(x), x.new_empty((m_splits.shape[0], 4), dtype=torch.float64)
