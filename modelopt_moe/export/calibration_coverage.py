"""Which experts calibrated their input amax on few tokens, named by global expert index at export.

An expert that few calibration tokens reached has an input scale from little data (and one no token reached, the
layer's shared input amax): engines serve it with that scale. :func:`warn_cold_experts` names them, once on rank 0,
from the token counts calibration keeps (:mod:`modelopt_moe.quantization.calib.tokens`).
"""

from __future__ import annotations

from torch import nn

from ..quantization.calib.tokens import expert_token_counts
from ..quantization.utils import is_rank0, warn_once

__all__ = ["DEFAULT_MIN_CALIB_TOKENS", "warn_cold_experts"]

# Fewer calibration tokens than this make an expert's input amax a guess from a handful of activations.
DEFAULT_MIN_CALIB_TOKENS = 32


def warn_cold_experts(model: nn.Module, min_tokens: int) -> dict[str, dict[int, int]]:
    """Warns once on rank 0 naming every expert (global index, with its token count) whose input quantizer
    calibrated on fewer than ``min_tokens`` tokens; returns them. Every rank calls it (:func:`expert_token_counts`)."""
    cold = {name: {g: c for g, c in sorted(cells.items()) if c < min_tokens}
            for name, cells in expert_token_counts(model).items()}
    cold = {name: cells for name, cells in cold.items() if cells}
    if cold and is_rank0():
        lines = [f"{name}: experts {cells}" for name, cells in cold.items()]
        warn_once(f"export_hf: these experts calibrated their input amax on fewer than {min_tokens} tokens "
                  "(global expert: tokens; 0: the layer's shared input amax), so their input scales rest on little "
                  "data; calibrate with more data or algorithm.moe_calib_experts_ratio:\n  " + "\n  ".join(lines))
    return cold
