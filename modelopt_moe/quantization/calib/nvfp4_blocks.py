"""Static NVFP4 block scales chosen by search (Model Optimizer 0.47's ``mse`` on static NVFP4 weight quantizers).

After max calibration every block of 16 of a weight with static block scales (``block_sizes.type: static``) has the
amax ``a = max |w_block|`` and the weight its per-tensor (second-level) amax ``A``, max-reduced over the weight's
shards. Each block then takes, of a list of candidate block amaxes, the one of least squared error
``sum over the block of (w - Q(w))**2`` (``Q`` the static NVFP4 fake quantization with that block amax; the first
of equal errors wins):

* ``fp8_scale_sweep: true``: the candidates are ``A * c``, ``c`` every finite positive E4M3 value divided by 448
  (126 of them, :func:`~modelopt_moe.numerics.nvfp4.fp8_scale_candidates`): with the block-scale normalization of
  448 the block scale of candidate ``c`` is ``c * 448`` exactly, so every E4M3 block scale is tried (Model
  Optimizer's ``NVFP4MSECalibrator``);
* otherwise the candidates are ``a * m``, ``m`` on the multiplier grid of ``mse``
  (:func:`~.mse.mse_multipliers`). Model Optimizer's 4-over-6 preset (``nvfp4_four_over_six``: ``four_over_six:
  true`` normalizes block scales to 256, grid ``start_multiplier: 1.0, stop_multiplier: 1.5, step_size: 0.5``)
  is this rule with ``m`` in ``{1, 1.5}``: each block's max maps to E2M1's 6 or to its 4, whichever quantizes the
  block better.

A block lies whole on one rank at every tensor / expert parallel layout (blocks run along the last dim, whose shards
are multiples of 16), and ``A`` is the same on every rank that holds a shard: the choice is local and every layout
chooses what one rank holding the whole weight chooses, without a collective. Expert quantizers choose per expert
(a block belongs to one expert's weight), whatever the amax layout.
"""

from __future__ import annotations

import torch

from ...numerics import get_format
from ...numerics.nvfp4 import fp8_scale_candidates

__all__ = ["searchable_blocks", "search_block_amax"]


def searchable_blocks(q) -> bool:
    """Whether quantizer ``q`` has static block scales to search: enabled, calibrated, not dynamic."""
    return (q.is_enabled and q.static_block_scales and not q.is_dynamic and q.amax is not None
            and q.block_amax is not None)


def _block_errors(spec, x: torch.Tensor, amax: torch.Tensor, block_amax: torch.Tensor,
                  scale_max: float) -> torch.Tensor:
    """``[..., K // 16]``: the squared error of each block of ``x`` under the block amaxes ``block_amax``."""
    xq = spec.fake_quant_static(x, amax, block_amax, scale_max)
    return ((x - xq) ** 2).unflatten(-1, (-1, spec.block_length)).sum(dim=-1)


def search_block_amax(fmt: str, x: torch.Tensor, amax: torch.Tensor, block_amax: torch.Tensor, scale_max: float,
                      fp8_scale_sweep: bool, multipliers: torch.Tensor) -> torch.Tensor:
    """The block amaxes of least error for one weight (see the module docstring).

    Args:
        fmt: the format (NVFP4).
        x: the weight (any float dtype; searched in fp32).
        amax: its per-tensor amax (a scalar).
        block_amax: its max-calibrated block amaxes ``[..., K // 16]``.
        scale_max: the block-scale normalization (448, or 256 for 4-over-6).
        fp8_scale_sweep: sweep every E4M3 block scale instead of multiples of ``block_amax``.
        multipliers: the multiplier grid (unused with ``fp8_scale_sweep``).

    Returns:
        fp32 block amaxes of ``block_amax``'s shape.
    """
    spec = get_format(fmt)
    x = x.detach().float()
    amax = amax.detach().float().to(x.device)
    start = block_amax.detach().float().to(x.device)
    if fp8_scale_sweep:
        candidates = [amax * c for c in fp8_scale_candidates(x.device)]
        make = lambda c: c.expand_as(start)  # noqa: E731
    else:
        candidates = list(multipliers.to(x.device))
        make = lambda m: start * m  # noqa: E731
    best = best_error = None
    for c in candidates:
        value = make(c)
        error = _block_errors(spec, x, amax, value, scale_max)
        if best is None:
            best, best_error = value.clone(), error
            continue
        better = error < best_error  # strict: the first of equal errors stays
        best = torch.where(better, value, best)
        best_error = torch.where(better, error, best_error)
    return best
