"""Max calibration: the amax is the largest magnitude seen. The one home of the max rule, which the quantizers
apply as they collect, expert layouts apply over experts, and :func:`~..calibration.sync_amax` applies across ranks.
"""

from __future__ import annotations

import torch

from ..config_schema import MaxCalibConfig
from .calibrator import Calibrator

__all__ = ["MaxCalibrator", "merge_max", "max_over_experts", "AMAX_REDUCE_OP"]

# How amaxes combine across ranks (tensor-parallel shards, data-parallel batches, expert-parallel experts).
AMAX_REDUCE_OP = "max"


def merge_max(current: torch.Tensor, new: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The amax after ``current`` has seen a tensor whose amax is ``new`` (broadcast to ``current``'s shape when
    ``out`` is given): their elementwise maximum, written into ``out`` when given."""
    if out is None:
        return torch.maximum(current, new)
    return torch.maximum(current, new.expand_as(current), out=out)


def max_over_experts(value: torch.Tensor) -> torch.Tensor:
    """One amax for every expert of an ``[N, ...]`` amax: the max over its leading (expert) axis, kept as size 1."""
    return value.amax(dim=0, keepdim=True)


class MaxCalibrator(Calibrator):
    """Max calibration (Model Optimizer's ``{"method": "max"}``): weights from themselves, activations from the
    forward loop, the elementwise max across ranks. Nothing to refine."""

    name = "max"
    options = MaxCalibConfig
