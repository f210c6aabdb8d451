"""How many calibration tokens each expert saw, by global expert index: a statistic of calibration.

Each expert input quantizer counts the tokens of each of its experts as it calibrates (``calibrated_rows``; layouts
that quantize every expert's inputs as one tensor, ``input_amax: shared``, do not count). At the end of calibration
the counts are summed over the expert-data-parallel ranks (they feed other tokens; expert-TP ranks see the same ones),
so every replica of an expert holds the expert's total (:func:`sum_token_counts`). :func:`expert_token_counts`
gathers them by global expert index (the summary, the export's warning and the checkpoint's quantization state).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..chunk_names import global_name_of
from ..expert_quantizer import ExpertQuantizer
from ..quant_module import is_quantized, unwrap_model
from .calibrator import Statistic, reduce_statistics

__all__ = ["TOKEN_COUNT_GROUPS", "counts_tokens", "sum_token_counts", "expert_token_counts"]

# Ranks that feed an expert other calibration tokens: expert-data-parallel ones.
TOKEN_COUNT_GROUPS = ("edp",)


def counts_tokens(q) -> bool:
    """Whether expert input quantizer ``q`` counts its experts' tokens (from its config: the same on every rank)."""
    return isinstance(q, ExpertQuantizer) and q.is_enabled and not q.is_dynamic and q.layout != "shared"


def sum_token_counts(model: nn.Module, groups: dict) -> None:
    """Sums every expert input quantizer's token counts over :data:`TOKEN_COUNT_GROUPS` (zeros where a rank counted
    none), one collective per group on every rank."""
    statistics = []
    for module in unwrap_model(model).modules():
        if not is_quantized(module):
            continue
        for gemm in module.expert_gemms():
            q = gemm.quantizers.input_quantizer
            if counts_tokens(q):
                value = q.calibrated_rows if q.calibrated_rows is not None else torch.zeros(q.num_experts,
                                                                                             dtype=torch.int64)

                def store(total, q=q):
                    q.calibrated_rows = total.cpu()

                statistics.append(Statistic(value, "sum", TOKEN_COUNT_GROUPS, store))
    reduce_statistics(statistics, groups)


def _local_counts(model: nn.Module) -> dict[str, dict[int, int]]:
    """``{input quantizer name: {global expert: tokens}}`` of this rank's experts (every replica holds the totals;
    only expert-TP and expert-DP rank 0 report, so each expert is reported once)."""
    out: dict[str, dict[int, int]] = {}
    for mod_name, module in unwrap_model(model).named_modules():
        if not is_quantized(module):
            continue
        grid = module.expert_grid()
        if grid.etp_rank != 0 or grid.edp_rank != 0:
            continue
        for gemm in module.expert_gemms():
            q = gemm.quantizers.input_quantizer
            if not q.is_enabled or q.calibrated_rows is None:
                continue
            name = ".".join(p for p in (mod_name, gemm.name, "input_quantizer") if p)
            cells = out.setdefault(name, {})
            for i in range(gemm.num_local):
                cells[grid.global_index(gemm.num_local, i)] = int(q.calibrated_rows[i])
    return out


def expert_token_counts(model: nn.Module, rename: Callable[[str], str] | None = None) -> dict[str, dict[int, int]]:
    """``{input quantizer name: {global expert: calibration tokens}}`` over every rank. A collective when
    ``torch.distributed`` is initialized with more than one rank: every rank calls it (one ``all_gather_object``).

    ``rename`` maps each rank's quantizer names before they are merged (default: the whole model's names, so the
    layers of pipeline stages keep their global numbers; :mod:`..chunk_names`)."""
    local = _local_counts(model)
    rename = rename if rename is not None else global_name_of(model)
    local = {rename(name): cells for name, cells in local.items()}
    parts = [local]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    totals: dict[str, dict[int, int]] = {}
    for part in parts:
        for name, cells in part.items():
            totals.setdefault(name, {}).update(cells)
    return {name: dict(sorted(cells.items())) for name, cells in totals.items()}
