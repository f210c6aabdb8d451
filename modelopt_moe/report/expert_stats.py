"""Per-expert numbers of a quantized model under GLOBAL expert indices, gathered to rank 0: the same table at any
tensor/expert-parallel layout (framework-free: the expert grid comes from each module's ``expert_grid()``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.state import iter_expert_quantizers
from ..numerics import fake_quant, get_format

__all__ = ["ExpertStats", "gather_expert_stats"]


@dataclass
class ExpertStats:
    """Per expert GEMM (keyed by the quantizers' module path, e.g. ``decoder.layers.0.mlp.experts.linear_fc1``), one
    value per global expert.

    Attributes:
        num_experts: global experts per GEMM.
        weight_amax: the weight amax (the max over channels for a per-channel amax).
        input_amax: the input amax.
        input_seen: whether the expert calibrated on at least one token (None where the layout does not count).
        weight_error_own: relative squared error of the weights fake-quantized with the expert's own amax.
        weight_error_shared: the same with one amax for the GEMM (the max over all its experts).
        weight_format: the weight quantizer's format (``nvfp4``, ``e4m3``, ``int8``, ...).
        weight_block_size: its block size (None: per tensor or channel). With blocks, each block has its own scale
            and the amax only sets the range of those scales (NVFP4) or is not used (INT blocks): one amax for all
            experts then costs little.
    """

    num_experts: dict[str, int] = field(default_factory=dict)
    weight_amax: dict[str, list[float]] = field(default_factory=dict)
    input_amax: dict[str, list[float]] = field(default_factory=dict)
    input_seen: dict[str, list[bool] | None] = field(default_factory=dict)
    weight_error_own: dict[str, list[float]] = field(default_factory=dict)
    weight_error_shared: dict[str, list[float]] = field(default_factory=dict)
    weight_format: dict[str, str] = field(default_factory=dict)
    weight_block_size: dict[str, int | None] = field(default_factory=dict)


def _gather(local: dict) -> list[dict]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [local]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)  # every rank, the same call, whatever its data
    return parts


def _max_abs(a: torch.Tensor | None) -> float | None:
    return None if a is None else float(a.detach().float().abs().max())


def gather_expert_stats(model: nn.Module, errors: bool = True) -> ExpertStats | None:
    """Collects :class:`ExpertStats` on rank 0 (returns None on the other ranks).

    Every rank must call it: it makes two ``all_gather_object`` over the default group (one with ``errors=False``).

    Args:
        model: a quantized model (wrappers are fine).
        errors: also compute each expert weight's quantization error with its own and with the shared amax.
    """
    local_amax, local_rows = {}, {}
    gemms = {}
    for e in iter_expert_quantizers(model):
        gemm_name = e.name[: -len(e.kind) - 1]
        grid = e.owner.expert_grid()
        gemms[gemm_name] = (e.gemm, grid)
        q = e.quantizer
        for i in range(e.gemm.num_local):
            g = grid.global_index(e.gemm.num_local, i)
            local_amax[(gemm_name, e.kind, g)] = _max_abs(q.expert_amax(i))
            if e.kind == "input_quantizer" and q.calibrated_rows is not None:
                local_rows[(gemm_name, g, grid.etp_rank, grid.edp_rank)] = int(q.calibrated_rows[i])
    amax, rows = {}, {}
    for part in _gather({"amax": local_amax, "rows": local_rows}):
        amax.update(part["amax"])
        rows.update(part["rows"])
    local_err = {}
    if errors:
        for gemm_name, (gemm, grid) in gemms.items():
            q = gemm.quantizers.weight_quantizer
            if not q.is_enabled or gemm.weights is None or not q.needs_amax:
                continue
            shared = max(v for (n, k, _), v in amax.items() if n == gemm_name and k == "weight_quantizer")
            for i, w in enumerate(gemm.weights):
                w = w.detach()
                own = fake_quant(w, q.fmt, q.expert_amax(i).to(w.device), q.block_size).float()
                one = fake_quant(w, q.fmt, torch.tensor(shared, device=w.device), q.block_size).float()
                ref = w.float()
                key = (gemm_name, grid.global_index(gemm.num_local, i), grid.etp_rank)
                local_err[key] = (float((own - ref).square().sum()), float((one - ref).square().sum()),
                                  float(ref.square().sum()))
    errs = {}
    for part in _gather(local_err):
        errs.update(part)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    stats = ExpertStats()
    for gemm_name, (gemm, grid) in gemms.items():
        n = grid.ep_size * gemm.num_local
        stats.num_experts[gemm_name] = n
        wq = gemm.quantizers.weight_quantizer
        if wq.is_enabled:
            stats.weight_format[gemm_name] = wq.fmt
            stats.weight_block_size[gemm_name] = wq.block_size or get_format(wq.fmt).block_length
        for kind, table in (("weight_quantizer", stats.weight_amax), ("input_quantizer", stats.input_amax)):
            values = [amax.get((gemm_name, kind, g)) for g in range(n)]
            if all(v is not None for v in values):
                table[gemm_name] = values
        counted = [[c for (nm, g, _, _), c in rows.items() if nm == gemm_name and g == e] for e in range(n)]
        stats.input_seen[gemm_name] = [sum(c) > 0 for c in counted] if all(counted) else None
        if errs:
            own, shared = [], []
            for g in range(n):
                parts = [v for (nm, ge, _), v in errs.items() if nm == gemm_name and ge == g]
                total = sum(p[2] for p in parts) or 1.0
                own.append(sum(p[0] for p in parts) / total)
                shared.append(sum(p[1] for p in parts) / total)
            stats.weight_error_own[gemm_name], stats.weight_error_shared[gemm_name] = own, shared
    return stats
