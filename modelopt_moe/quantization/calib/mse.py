"""Weight MSE search (Model Optimizer's ``{"method": "mse", ...}``): after max calibration, each weight amax becomes
the candidate ``amax_max * m`` that minimizes the squared error of the fake-quantized weight, ``m`` on Model
Optimizer 0.47's grid ``linspace(start_multiplier, stop_multiplier, ceil((stop - start) / step_size) + 1)``
(defaults 0.25, 4.0, 0.1: 39 candidates; the first of equal errors wins).

Per tensor, per channel, per static int block, and per expert for expert quantizers (each expert searches its own
row of the ``[N]`` / ``[N, C]`` amax; ``shared`` searches one value on the error summed over every expert). The
statistic is the error of every candidate, summed over the weight's shards: it reduces with ``sum`` over the groups
the amax itself is max-reduced over (tensor-parallel shards of a weight, and for ``shared`` every expert-parallel
rank), so every layout chooses what one rank holding the whole weight chooses. Activation amaxes keep their max
calibration, as in Model Optimizer.

Searched: quantizers whose amax is the element scale (FP8, INT per tensor / channel / static block), and the block
amaxes of static NVFP4 block scales (:mod:`.nvfp4_blocks`: the multiplier grid, or with ``fp8_scale_sweep`` every
E4M3 block scale; with ``fp8_scale_sweep`` only those, every other weight keeping its max calibration, as in Model
Optimizer). Left at max, as Model Optimizer leaves them: dynamic quantizers, formats whose scales come from the data
(int dynamic blocks, MX) and the second-level amax of two-level formats (NVFP4).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...numerics import fake_quant, get_format
from ..config_schema import MseCalibConfig
from ..expert_quantizer import ExpertQuantizer
from ..quant_module import is_quantized
from ..tensor_quantizer import TensorQuantizer
from ..utils import warn_once
from .calibrator import Calibrator, Statistic, reduce_statistics
from .nvfp4_blocks import search_block_amax, searchable_blocks

__all__ = ["MseCalibrator", "mse_multipliers", "searchable"]


def mse_multipliers(config: MseCalibConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """The candidate multipliers of the max amax, as Model Optimizer 0.47 makes them (float32)."""
    steps = math.ceil((config.stop_multiplier - config.start_multiplier) / config.step_size) + 1
    return torch.linspace(config.start_multiplier, config.stop_multiplier, steps=steps, device=device)


def searchable(q: TensorQuantizer) -> bool:
    """Whether the search applies to weight quantizer ``q``: enabled, calibrated, and its amax is the element scale
    (not dynamic, no data-derived or two-level block scales)."""
    # Blocks: static int blocks only (their amax is each block's scale); any other block layout takes scales
    # from the data or under a second level.
    blocks_ok = q.block_sizes is None or q.static_block_size is not None
    return (q.is_enabled and not q.is_dynamic and q.needs_amax and q.amax is not None and q.block_size is None
            and blocks_ok and get_format(q.fmt).block_scale is None)


def _squared_error(q: TensorQuantizer, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``sum (x - Q(x; amax))**2`` over each amax entry's elements (the shape of ``amax``); ``x`` in fp32."""
    xq = fake_quant(x, q.fmt, amax, None, **q.int_kwargs)
    error = F.mse_loss(x, xq, reduction="none")
    if amax.dim() == 0:
        return error.sum()
    return error.sum(dim=[d for d in range(error.dim()) if amax.shape[d] == 1], keepdim=True)


def _tensor_losses(q: TensorQuantizer, weight: torch.Tensor, initial: torch.Tensor,
                   multipliers: torch.Tensor) -> torch.Tensor:
    """``[S, *amax shape]``: the error of each candidate for a plain quantizer's weight."""
    x = weight.detach().float()
    if q.static_block_size is not None:
        x = q._blocks_view(x)
    return torch.stack([_squared_error(q, x, initial * m) for m in multipliers])


def _expert_losses(q: ExpertQuantizer, weights: list[torch.Tensor], initial: torch.Tensor,
                   multipliers: torch.Tensor) -> torch.Tensor:
    """``[S, N]`` / ``[S, N, C]``: the error of each candidate for each expert's weight (``shared``: ``[S]`` /
    ``[S, C]``, summed over the experts)."""
    rows = []
    for i, w in enumerate(weights):
        x = w.detach().float()
        row = q.row_of(initial, i)
        rows.append(torch.stack([_squared_error(q, x, row * m).reshape(initial.shape[1:]) for m in multipliers]))
    losses = torch.stack(rows, dim=1)
    return losses.sum(dim=1) if q.layout == "shared" else losses


def _choose(initial: torch.Tensor, multipliers: torch.Tensor, losses: torch.Tensor, shared: bool) -> torch.Tensor:
    """The amax of the least error: ``initial * multipliers[argmin]`` per entry (the first of equal errors)."""
    best = multipliers.to(losses.device)[torch.argmin(losses, dim=0)]
    if shared:
        best = best.unsqueeze(0).expand_as(initial)
    return initial * best.reshape(initial.shape)


def _search_blocks(q: TensorQuantizer, weights: list[torch.Tensor], config: MseCalibConfig,
                   multipliers: torch.Tensor) -> None:
    """Static block scales: each block's amax of least error, expert by expert (local: no collective)."""
    scale_max = q.cfg.block_scale_max
    with torch.no_grad():
        if isinstance(q, ExpertQuantizer):
            chosen = torch.stack([search_block_amax(q.fmt, w, q.row_of(q.amax, i), q.block_amax[i], scale_max,
                                                    config.fp8_scale_sweep, multipliers)
                                  for i, w in enumerate(weights)])
        else:
            chosen = search_block_amax(q.fmt, weights[0], q.amax, q.block_amax, scale_max, config.fp8_scale_sweep,
                                       multipliers)
    q.block_amax = chosen


class MseCalibrator(Calibrator):
    """Weight MSE search on top of max calibration (see the module docstring)."""

    name = "mse"
    options = MseCalibConfig

    def refine(self, model: torch.nn.Module, groups: dict, forward_loop=None, routing=None) -> None:
        """Searches every searchable weight amax: local errors per candidate, summed across the weight's shards
        (one collective per group name, the same on every rank), then the amax of the least error."""
        multipliers = mse_multipliers(self.config)
        statistics = []
        swept = 0
        for module in model.modules():
            if not is_quantized(module):
                continue
            for rel, q, weights in module.weights_to_calibrate():
                if searchable_blocks(q):
                    _search_blocks(q, weights, self.config, multipliers)
                    swept += 1
                    continue
                if self.config.fp8_scale_sweep or not searchable(q):
                    continue
                if q.refreshes_amax:
                    warn_once("calibrate(mse): weight_amax_update=dynamic recomputes the weight amaxes from the "
                              "weights at every re-quantization, replacing the searched ones; use static or learned")
                initial = q.amax.detach().clone()
                with torch.no_grad():
                    if isinstance(q, ExpertQuantizer):
                        losses = _expert_losses(q, weights, initial, multipliers.to(initial.device))
                    else:
                        losses = _tensor_losses(q, weights[0], initial, multipliers.to(initial.device))
                shared = isinstance(q, ExpertQuantizer) and q.layout == "shared"

                def store(total, q=q, initial=initial, shared=shared):
                    q.amax = _choose(initial, multipliers, total, shared)

                statistics.append(Statistic(losses, "sum", module.amax_reduction(rel), store))
        reduce_statistics(statistics, groups)
        if self.config.fp8_scale_sweep and not swept:
            warn_once("calibrate(mse, fp8_scale_sweep): no weight quantizer has static NVFP4 block scales "
                      "(block_sizes.type: static), so nothing was searched; every weight keeps its max calibration")
