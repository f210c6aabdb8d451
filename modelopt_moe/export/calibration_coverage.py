"""Which experts calibrated their input amax on few tokens, named by global expert index at export.

An expert that few calibration tokens reached has an input scale from little data (and one no token reached, the
layer's shared input amax): engines serve it with that scale. :func:`warn_cold_experts` names them, once on rank 0,
from the token counts calibration keeps on each expert input quantizer (``calibrated_rows``; layouts that quantize
the inputs of all experts as one tensor, ``input_amax: shared``, do not count).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..quantization.quant_module import is_quantized, unwrap_model
from ..quantization.utils import is_rank0, warn_once

__all__ = ["DEFAULT_MIN_CALIB_TOKENS", "expert_token_counts", "warn_cold_experts"]

# Fewer calibration tokens than this make an expert's input amax a guess from a handful of activations.
DEFAULT_MIN_CALIB_TOKENS = 32


def _local_counts(model: nn.Module) -> dict[tuple[str, int, int], int]:
    """``{(input quantizer name, global expert, expert-TP rank): tokens}`` of this rank's experts; expert-data-parallel
    ranks saw other tokens (their counts add up), expert-TP ranks the same ones."""
    out: dict[tuple[str, int, int], int] = {}
    for mod_name, module in unwrap_model(model).named_modules():
        if not is_quantized(module):
            continue
        grid = module.expert_grid()
        for gemm in module.expert_gemms():
            q = gemm.quantizers.input_quantizer
            if not q.is_enabled or q.calibrated_rows is None:
                continue
            name = ".".join(p for p in (mod_name, gemm.name, "input_quantizer") if p)
            for i in range(gemm.num_local):
                key = (name, grid.global_index(gemm.num_local, i), grid.etp_rank)
                out[key] = out.get(key, 0) + int(q.calibrated_rows[i])
    return out


def expert_token_counts(model: nn.Module) -> dict[str, dict[int, int]]:
    """``{input quantizer name: {global expert: calibration tokens}}`` over every rank. A collective when
    ``torch.distributed`` is initialized with more than one rank: every rank calls it (one ``all_gather_object``)."""
    parts = [_local_counts(model)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, _local_counts(model))
    totals: dict[str, dict[int, int]] = {}
    for part in parts:
        for (name, g, etp_rank), count in part.items():
            if etp_rank == 0:
                cells = totals.setdefault(name, {})
                cells[g] = cells.get(g, 0) + count
    return totals


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
