"""Hugging Face export and import of Megatron-Core GPT MoE models, at any tensor / expert / expert-tensor / pipeline
parallel layout: the Megatron adapter of :mod:`modelopt_moe.export`.

Both directions walk the family's table (:mod:`modelopt_moe.export.mapping`): every Megatron parameter by path, the
canonical tensors it holds and its gather rule; nothing here is written per family.

Export streams one layer at a time: every rank gathers the layer's tensor-parallel shards (``all_gather`` over TP,
column-parallel along rows, row-parallel along columns) and each expert slot's weights over expert-TP and EP (local
expert ``i`` of EP rank ``r`` is global expert ``r * N_local + i``, :class:`~modelopt_moe.quantization.ExpertGrid`'s
rule), with every expert's weight and input amax gathered the same way; fused QKV splits into ``q/k/v`` (Megatron
interleaves them per query group), fused ``fc1`` into ``gate/up`` (gate rows first; under expert-TP each rank holds
its slice of both); experts stored fused as 3-D tensors (gpt-oss) gather every expert into one tensor per layer
(the table's ``stacked`` rules; expert-TP 1; unquantized, or MXFP4 weights in the published layout with
``format="hf-mxfp4"``). Rank 0 encodes and writes through
:func:`modelopt_moe.export.hf_checkpoint.write_hf_checkpoint`; the others drop what they gathered. At most one
layer's dense weights and ``EP`` experts are in flight at a time. With pipeline parallelism each group (embedding,
layer, final) is gathered on the stage that holds it and its records travel to the writer's stage one at a time
(:mod:`.hf_pipeline`); the checkpoint is the one pipeline size 1 writes, byte for byte.

Import reads each rank's slices straight from the safetensors files (no collective, no full tensor in memory), after
checking the whole checkpoint from its files' headers; it writes the parameters only once every slice is read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from modelopt_moe.export import fused_mxfp4
from modelopt_moe.export.errors import ExportError
from modelopt_moe.export.families import MoEArch, family_for_architecture, get_family, read_hf_config
from modelopt_moe.export.hf_checkpoint import (
    FusedMxfp4Record,
    HfCheckpointReader,
    LinearRecord,
    TensorRecord,
    write_hf_checkpoint,
)
from modelopt_moe.export.mapping import STACKED, Param, gdn_sections
from modelopt_moe.export.schemes import LinearQuant, QuantSpec
from modelopt_moe.quantization.conversion import unwrap_model
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

from .attention import kv_cache_quants
from .hf_model import build_megatron_model, megatron_arch
from .hf_pipeline import PipelineExport, Stage, dotted_get, pipeline_world
from .pipeline_state import stage_chunks

__all__ = ["MegatronExportAdapter", "export_megatron", "import_megatron"]

_QUANTIZERS = ("weight_quantizer", "input_quantizer", "output_quantizer")


class _Layout:
    """This rank's groups and places (sizes 1 when Megatron's parallel state is not initialised)."""

    def __init__(self):
        init = parallel_state.model_parallel_is_initialized()
        self.tp = parallel_state.get_tensor_model_parallel_group() if init else None
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size() if init else 1
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank() if init else 0
        self.ep = parallel_state.get_expert_model_parallel_group() if init else None
        self.ep_size = parallel_state.get_expert_model_parallel_world_size() if init else 1
        self.ep_rank = parallel_state.get_expert_model_parallel_rank() if init else 0
        self.etp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False) if init else None
        self.etp_size = parallel_state.get_expert_tensor_parallel_world_size() if init else 1
        self.etp_rank = parallel_state.get_expert_tensor_parallel_rank() if init else 0


def _all_gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's ``t`` (equal shapes), bit for bit: the bytes travel (gloo gathers no 16-bit floats)."""
    x = t.detach().contiguous()
    if size == 1:
        return [x]
    wire = x.reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(wire) for _ in range(size)]
    dist.all_gather(parts, wire, group=group)
    return [p.view(x.dtype).reshape(x.shape) for p in parts]


def _gather_cat(t: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    return torch.cat(_all_gather(t, group, size), dim) if size > 1 else t.detach()


def _glu_gather(t: torch.Tensor, group, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated fc1 tensor split over expert-TP (each rank ``[gate_r; up_r]`` along dim 0) -> full (gate, up)."""
    parts = [p.chunk(2, dim=0) for p in _all_gather(t, group, size)]
    return torch.cat([g for g, _ in parts], 0), torch.cat([u for _, u in parts], 0)


def _quantizer(holder, kind: str) -> TensorQuantizer | None:
    q = getattr(holder, kind, None) if holder is not None else None
    return q if isinstance(q, TensorQuantizer) else None


def _linear_quant(holder) -> LinearQuant:
    """The enabled (quantizing) quantizers of a linear or expert-GEMM holder."""
    specs = []
    for kind in _QUANTIZERS:
        q = _quantizer(holder, kind)
        specs.append(QuantSpec(q.fmt, q.axis, q.block_size, q.per_token, q.is_dynamic)
                     if q is not None and q.is_quantizing else None)
    return LinearQuant(*specs)


def _amax(holder, kind: str) -> torch.Tensor | None:
    q = _quantizer(holder, kind)
    return q.amax.detach().float() if q is not None and q.is_quantizing and q.amax is not None else None


def _block_amax(holder) -> tuple[torch.Tensor, float] | None:
    """Static two-level block scales of the weight quantizer: its block amaxes (``[rows, K // 16]``, or ``[N, rows,
    K // 16]`` for experts) and their normalization; None where the block scales come from the data. The same
    answer on every rank (the config, and calibration gives every rank its blocks)."""
    q = _quantizer(holder, "weight_quantizer")
    if q is None or not q.is_quantizing or not q.static_block_scales or q.block_amax is None:
        return None
    return q.block_amax.detach().float(), q.cfg.block_scale_max


def _num_local_experts(experts) -> int:
    if hasattr(experts, "local_experts"):
        return len(experts.local_experts)
    return experts.num_local_experts


def _split_qkv(t: torch.Tensor, arch: MoEArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's per-query-group ``[q heads; k; v]`` rows -> (q, k, v), each in head order."""
    ng, d = arch.num_kv_heads, arch.head_dim
    hpg = arch.num_attention_heads // ng
    grouped = t.reshape(ng, (hpg + 2) * d, *t.shape[1:])
    q, k, v = grouped.split([hpg * d, d, d], dim=1)
    return (q.reshape(ng * hpg * d, *t.shape[1:]), k.reshape(ng * d, *t.shape[1:]),
            v.reshape(ng * d, *t.shape[1:]))


def _split_qkv_gate(t: torch.Tensor, arch: MoEArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's per-query-group ``[q heads; gate heads; k; v]`` rows -> (q_proj with each head's ``[q_h; gate_h]``
    rows, as Qwen3.5 stores it, k, v)."""
    ng, d, rest = arch.num_kv_heads, arch.head_dim, t.shape[1:]
    hpg = arch.num_attention_heads // ng
    q, gate, k, v = t.reshape(ng, (2 * hpg + 2) * d, *rest).split([hpg * d, hpg * d, d, d], dim=1)
    per_head = torch.stack([q.reshape(ng * hpg, d, *rest), gate.reshape(ng * hpg, d, *rest)], 1)
    return per_head.reshape(2 * ng * hpg * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def _gdn_gather(t: torch.Tensor, group, size: int, arch: MoEArch, rule: str) -> list[torch.Tensor]:
    """A Gated DeltaNet parameter whose every rank holds its slice of each section (``gdn_sections``) -> the
    canonical parts: ``[q; k; v]`` and, for the input projection, z, b, a."""
    sections = gdn_sections(arch, rule)
    local = [n // size for n in sections]
    per_rank = [p.split(local, 0) for p in _all_gather(t, group, size)]
    full = [torch.cat([parts[i] for parts in per_rank], 0) for i in range(len(sections))]
    return [torch.cat(full[:3], 0), *full[3:]]


def _row_amax_split(amax, rows: list[torch.Tensor]):
    """A per-tensor amax for every part, or a per-channel one split like the rows."""
    if amax is None or amax.numel() == 1:
        return [amax if amax is None else amax.reshape(())] * len(rows)
    flat = amax.reshape(-1)
    out, start = [], 0
    for r in rows:
        out.append(flat[start:start + r.shape[0]])
        start += r.shape[0]
    return out


# --- the table's paths ------------------------------------------------------------------------------------------------
def _get(root, path: str):
    """The attribute at a dotted ``path`` (``weight3`` / ``local_experts.3`` alike), None where absent; a
    :class:`~.hf_pipeline.Stage` root is addressed by global layer index."""
    if isinstance(root, Stage):
        root, path = root.locate(path)
    return dotted_get(root, path)


def _resolve(m, param: Param, L: int | None, i: int | None = None) -> tuple[str, torch.Tensor]:
    """A table parameter's (path, tensor): the first of its alternative paths present."""
    for path in param.path:
        path = path.format(L=L, i=i)
        t = _get(m, path)
        if isinstance(t, torch.Tensor):
            return path, t
    raise ExportError(f"Megatron model has no parameter {param.path[0].format(L=L, i=i)!r} "
                      f"(nor {[p.format(L=L, i=i) for p in param.path[1:]]})")


def _holder(m, param: Param, L: int | None):
    """Where a linear's quantizers live, and its path (None for an unquantized one)."""
    if not param.linear or not param.quantized:
        return None, None
    if param.holder is not None:
        path = param.holder.format(L=L)
    else:
        path = _resolve(m, param, L, 0)[0].rpartition(".")[0]
    return path, _get(m, path)


def _names(param: Param, L: int | None, E: int | None = None) -> list[str]:
    return [c.format(L=L, E=E) for c in param.canonical]


def _group(param: Param, lay: _Layout, split: bool = True):
    """A parameter's sharding group, size and rank: tensor-parallel, or expert-TP for an expert's; size 1 where the
    parameter is whole on every rank (``split`` False)."""
    if not split:
        return None, 1, 0
    if param.expert:
        return lay.etp, lay.etp_size, lay.etp_rank
    return lay.tp, lay.tp_size, lay.tp_rank


def _split(t: torch.Tensor, param: Param, arch: MoEArch) -> bool:
    """Whether this rank holds a shard of the parameter rather than all of it (Transformer Engine keeps MLA's down
    projections whole on every rank, Megatron's own modules split them): its shape against the canonical tensors'."""
    if param.rule == "replicated":
        return False
    shapes = get_family(arch.family).shapes(arch)
    parts = [shapes[c.rsplit(".", 1)[-1]] for c in param.canonical]
    dim = 1 if param.rule == "row" else 0
    full = list(parts[0])
    full[dim] = sum(p[dim] for p in parts)
    return tuple(t.shape) != tuple(full)


def _gather(t: torch.Tensor, param: Param, lay: _Layout, arch: MoEArch, split: bool = True) -> list[torch.Tensor]:
    """A parameter's (or per-channel amax's) full tensor, split into its canonical parts."""
    group, size, _ = _group(param, lay, split)
    if param.rule == "replicated":
        return [t.detach()]
    if param.rule == "row":
        return [_gather_cat(t, group, size, 1)]
    if param.rule == "glu":
        return list(_glu_gather(t, group, size))
    if param.rule in ("gdn_in", "gdn_conv"):
        return _gdn_gather(t, group, size, arch, param.rule)
    full = _gather_cat(t, group, size, 0)
    if param.rule == "qkv_gate":
        return list(_split_qkv_gate(full, arch))
    return list(_split_qkv(full, arch)) if param.rule == "qkv" else [full]


def _dense_records(m, param: Param, L: int | None, arch: MoEArch, lay: _Layout) -> Iterator:
    _, t = _resolve(m, param, L)
    split = _split(t, param, arch)
    parts, names = _gather(t, param, lay, arch, split), _names(param, L)
    if not param.linear:
        yield from (TensorRecord(n, w) for n, w in zip(names, parts, strict=True))
        return
    _, holder = _holder(m, param, L)
    w_amax = _amax(holder, "weight_quantizer")
    if w_amax is not None and w_amax.numel() > 1 and param.rule != "row":  # per channel: the output rows
        w_amax = torch.cat(_gather(w_amax, param, lay, arch, split), 0)
    in_amax = _amax(holder, "input_quantizer")
    quant = _linear_quant(holder)
    amaxes = [w_amax] if len(parts) == 1 else _row_amax_split(w_amax, parts)
    blocks = _block_amax(holder)  # gathered like the weight: the same rows and (over 16) columns
    block_parts = ([None] * len(parts) if blocks is None else
                   [(b, blocks[1]) for b in _gather(blocks[0], param, lay, arch, split)])
    for name, w, a, b in zip(names, parts, amaxes, block_parts, strict=True):
        yield LinearRecord(name, w, quant, a, in_amax, b)


def _gather_expert_amax(holder, kind: str, lay: _Layout, param: Param, where: str) -> torch.Tensor | None:
    """All experts' amax ``[E]`` / ``[E, C]`` (C the full channel count), in global expert order."""
    q = _quantizer(holder, kind)
    if q is None or not q.is_quantizing:
        return None
    amax = q.amax.detach().float() if q.amax is not None else None
    if amax is None and (q.is_dynamic or not q.needs_amax):
        return None  # every scale comes from the data (the same on every rank: the config)
    if amax is None:
        raise ExportError(f"{where}.{kind}: no amax (calibrate the model before exporting)")
    if amax.dim() == 2 and kind == "weight_quantizer" and param.rule in ("glu", "column"):
        # per channel: output channels split over expert-TP (row-parallel ones are whole)
        amax = torch.cat(_gather(amax.t(), param, lay, None), 0).t()
    return _gather_cat(amax, lay.ep, lay.ep_size, 0)


def _to_stacked(t: torch.Tensor, rule: str) -> torch.Tensor:
    """One expert's Megatron tensor (``[out, in]`` weight or ``[out]`` bias) in the fused 3-D layout: transposed to
    ``[in, out]``; a gated fc1's ``[gate; up]`` interleaved (gate even, up odd)."""
    if rule == "stacked_glu":
        gate, up = t.chunk(2, 0)
        t = torch.stack([gate, up], 1).reshape(t.shape)  # rows gate0, up0, gate1, up1, ...
    return t.t() if t.dim() == 2 else t


def _from_stacked(t: torch.Tensor, rule: str) -> torch.Tensor:
    """Inverse of :func:`_to_stacked`."""
    t = t.t() if t.dim() == 2 else t
    if rule == "stacked_glu":
        t = torch.cat([t[0::2], t[1::2]], 0)
    return t.contiguous()


def _stacked_records(m, params: list[Param], L: int, arch: MoEArch, lay: _Layout, n: int,
                     fmt: str) -> Iterator[TensorRecord | FusedMxfp4Record]:
    """A layer's experts fused into one tensor per parameter (every expert, in global order); expert-TP must be 1.
    With ``format="hf-mxfp4"`` the weights go to the writer as ``[E, out, in]`` (rows in the file's order), which
    encodes them in MXFP4."""
    for param in params:
        if lay.etp_size != 1:
            raise ExportError(f"{param.path[0].format(L=L, i=0)}: fused 3-D experts need expert tensor parallel size "
                              f"1, got {lay.etp_size}")
        local = torch.stack([_to_stacked(_resolve(m, param, L, i)[1].detach(), param.rule) for i in range(n)])
        full = torch.cat(_all_gather(local, lay.ep, lay.ep_size), 0)
        if fmt == fused_mxfp4.FILE_FORMAT and param.holder is not None:
            yield FusedMxfp4Record(_names(param, L)[0], full.transpose(1, 2).contiguous())
        else:
            yield TensorRecord(_names(param, L)[0], full)


def _expert_records(m, params: list[Param], L: int, arch: MoEArch, lay: _Layout, fmt: str) -> Iterator:
    """The layer's experts, one local expert slot at a time over expert-TP and EP, in global expert order."""
    n = _num_local_experts(_get(m, get_family(arch.family).megatron.experts.format(L=L)))
    if n * lay.ep_size != arch.num_experts:
        raise ExportError(f"layer {L}: {n} local experts x EP {lay.ep_size} != {arch.num_experts} experts")
    yield from _stacked_records(m, [p for p in params if p.rule in STACKED], L, arch, lay, n, fmt)
    params = [p for p in params if p.rule not in STACKED]
    plans = []
    for param in params:
        where, holder = _holder(m, param, L)
        amax = {k: _gather_expert_amax(holder, k, lay, param, where)
                for k in ("weight_quantizer", "input_quantizer")}
        plans.append((param, _linear_quant(holder), amax, _block_amax(holder)))
    for i in range(n):
        gathered, gathered_blocks = [], []
        for param, _, _, blocks in plans:
            full = torch.cat(_gather(_resolve(m, param, L, i)[1], param, lay, arch), 0)
            gathered.append(_all_gather(full, lay.ep, lay.ep_size))
            if blocks is not None:  # expert i's block amaxes, gathered like its weight
                full = torch.cat(_gather(blocks[0][i], param, lay, arch), 0)
                gathered_blocks.append(_all_gather(full, lay.ep, lay.ep_size))
            else:
                gathered_blocks.append(None)
        for r in range(lay.ep_size):
            e = r * n + i
            for (param, quant, amax, blocks), full, block_full in zip(plans, gathered, gathered_blocks, strict=True):
                parts = full[r].chunk(len(param.canonical), 0)
                block_parts = ([None] * len(parts) if block_full is None else
                               [(b, blocks[1]) for b in block_full[r].chunk(len(param.canonical), 0)])
                w_amax, x_amax = amax["weight_quantizer"], amax["input_quantizer"]
                # the parts share one amax per expert (the same NVFP4 second-level scale, as engines require)
                w_amax = None if w_amax is None else w_amax[e]
                x_amax = None if x_amax is None else x_amax[e]
                w_amaxes = (list(w_amax.chunk(len(parts), 0)) if w_amax is not None and w_amax.dim() == 1
                            else [w_amax] * len(parts))
                for name, w, a, b in zip(_names(param, L, e), parts, w_amaxes, block_parts, strict=True):
                    yield LinearRecord(name, w, quant, a, x_amax, b)


def _layer_records(m, L: int, arch: MoEArch, lay: _Layout, fmt: str) -> Iterator:
    params = get_family(arch.family).megatron.params(arch, L)
    for param in params:
        if not param.expert:
            yield from _dense_records(m, param, L, arch, lay)
    experts = [p for p in params if p.expert]
    if experts:
        yield from _expert_records(m, experts, L, arch, lay, fmt)


def _check_stacked_quant(m, param: Param, L: int, arch: MoEArch, fmt: str) -> None:
    """Fused 3-D experts are written in MXFP4 with ``format="hf-mxfp4"`` (which needs MXFP4 weight-only experts)
    and unquantized otherwise: refuses any other quantization, naming the module (nothing dropped)."""
    if param.holder is None:
        return
    where = param.holder.format(L=L)
    holder = _get(m, where)
    if fmt == fused_mxfp4.FILE_FORMAT:
        fused_mxfp4.check_expert_quant(where, _linear_quant(holder))
    elif any(q is not None and q.is_quantizing for q in (_quantizer(holder, k) for k in _QUANTIZERS)):
        raise ExportError(f"{where}: quantized experts stored fused as 3-D tensors ({arch.family}) export only as "
                          f"MXFP4 weights in the published layout (format={fused_mxfp4.FILE_FORMAT!r}, got "
                          f"format={fmt!r} and {_linear_quant(holder)}); for format={fmt!r} disable their "
                          "quantizers, e.g. mtq.disable_quantizer(model, '*experts*')")


def _group_keys(arch: MoEArch) -> list[tuple]:
    """``(key, L)`` of every group: the embedding, each layer, the final ones."""
    return [("embedding", None)] + [(L, L) for L in range(arch.num_layers)] + [("final", None)]


def _linear_quants(m: Stage, arch: MoEArch, fmt: str) -> dict[str, LinearQuant]:
    """Every exported linear of this stage's groups: its quantizers, by canonical name (local state only: no
    collective); refuses a quantizer without amax, and quantized fused 3-D experts, naming the Megatron module."""
    return {name: q for group in _linear_quants_by_group(m, arch, fmt).values() for name, q in group.items()}


def _linear_quants_by_group(m: Stage, arch: MoEArch, fmt: str) -> dict:
    """:func:`_linear_quants` by group key, in checkpoint order."""
    table = get_family(arch.family).megatron
    by_group: dict = {}
    lay = _Layout()
    for key, L in _group_keys(arch):
        if not m.owns(key):
            continue
        quants = by_group.setdefault(key, {})
        for param in table.params(arch, key):
            if param.rule in STACKED:
                _check_stacked_quant(m, param, L, arch, fmt)
            if not param.linear:
                continue
            where, holder = _holder(m, param, L)
            quant = _linear_quant(holder)
            experts = range(arch.num_experts) if param.expert else (None,)
            quants.update({name: quant for E in experts for name in _names(param, L, E)})
            for kind in ("weight_quantizer", "input_quantizer"):
                q = _quantizer(holder, kind)
                if q is not None and q.is_quantizing and q.needs_amax and not q.is_dynamic and q.amax is None:
                    raise ExportError(f"{where}.{kind}: no amax (calibrate the model before exporting)")
            _check_weight_row_blocks(m, param, L, where, holder, arch, lay)
    return by_group


def _check_weight_row_blocks(m, param: Param, L: int | None, where: str | None, holder, arch: MoEArch,
                             lay: _Layout) -> None:
    """2-D weight blocks (FP8 128x128) are taken over each rank's fused weight in training; the exported q/k/v, gate
    and up are re-blocked on their own, so every place where one exported matrix ends inside a trained weight (and
    where ranks' row shards are joined) must be a row-block boundary, or the stored scales would not be training's.

    Raises:
        ExportError: naming the module, the block and the rows that cut a block.
    """
    q = _quantizer(holder, "weight_quantizer")
    if q is None or not q.is_quantizing or not isinstance(q.block_size, tuple):
        return
    rows = q.block_size[0]
    _, t = _resolve(m, param, L, 0)
    _, size, _ = _group(param, lay, _split(t, param, arch))
    what, n = None, None
    if param.rule in ("qkv", "qkv_gate"):
        what, n = "head_dim (the q / k / v rows of each query group)", arch.head_dim
    elif param.rule in ("gdn_in", "gdn_conv"):
        what, n = f"the Gated DeltaNet's sections per TP rank ({size})", min(gdn_sections(arch, param.rule)) // size
    elif param.rule == "glu":
        ffn, group = ("moe_ffn_hidden_size", "expert-TP") if param.expert else ("ffn_hidden_size", "TP")
        what, n = f"{ffn} / {group} {size} (gate | up rows)", t.shape[0] // 2
    elif param.rule == "column" and size > 1:
        what, n = f"the rows per {'expert-TP' if param.expert else 'TP'} rank ({size})", t.shape[0]
    if n is not None and n % rows:
        raise ExportError(f"{where}.weight_quantizer: {q.block_size} weight blocks span {what} = {n}, not a "
                          f"multiple of {rows}: the exported matrices would be blocked differently than "
                          "training's fused weight (their scales would not be the trained ones); train "
                          "per-channel FP8 weights (FP8_DYNAMIC) instead, or a model whose sizes are multiples "
                          "of the block")


def _groups(m: Stage, arch: MoEArch, lay: _Layout, pipe: PipelineExport | None,
            fmt: str) -> Iterator[tuple[str, Iterator]]:
    """``(label, records)`` of every group, in checkpoint order; with pipeline stages each group is made on the stage
    that holds it and its records reach the writer through ``pipe``."""
    table = get_family(arch.family).megatron

    def top(key):
        for param in table.params(arch, key):
            yield from _dense_records(m, param, None, arch, lay)

    for label, key in [("embedding", "embedding"), *((f"layer {L}", L) for L in range(arch.num_layers)),
                       ("output", "final")]:
        make = (lambda key=key: top(key)) if key in ("embedding", "final") else \
            (lambda key=key: _layer_records(m, key, arch, lay, fmt))
        yield label, make() if pipe is None else pipe.records(key, make)


def _stage_quants(stage: Stage, arch: MoEArch,
                  fmt: str) -> tuple[dict[str, LinearQuant], list, PipelineExport | None]:
    """Every exported linear's quantizers and every layer's KV-cache quantizers, over all pipeline stages (one
    ``all_gather_object`` over the pipeline group when there are several, made by every rank; none otherwise), and
    the pipeline's view of the export (None without pipeline stages)."""
    if pipeline_world() == 1:
        return _linear_quants(stage, arch, fmt), kv_cache_quants(stage.model), None
    pipe = PipelineExport(stage, arch.num_layers)
    local, error = {"quants": {}, "kv": {}}, None
    try:  # KV-cache quantizers by global layer: a stage's chunks hold layers that are not contiguous
        kv = {offset + i: q for chunk, (offset, _) in zip(stage.chunks, stage.places, strict=True)
              for i, q in enumerate(kv_cache_quants(chunk, offset))}
        local = {"quants": _linear_quants_by_group(stage, arch, fmt), "kv": kv}
    except ExportError as e:
        error = str(e)
    parts = pipe.agree(local, error)
    # in checkpoint order, whichever stage holds each group (a stage's chunks hold layers that are not contiguous)
    quants = {name: q for key, _ in _group_keys(arch) for part in parts
              for name, q in part["quants"].get(key, {}).items()}
    kv_cache = {layer: q for part in parts for layer, q in part["kv"].items()}
    return quants, [kv_cache[layer] for layer in sorted(kv_cache)], pipe


def export_megatron(model, out_dir: str | os.PathLike, *, format: str = "compressed-tensors",
                    family: str | None = None, dtype: torch.dtype | None = None, hf_config=None,
                    progress: bool = True, base_model: str | None = None,
                    calibration_tokens: dict[str, dict[int, int]] | None = None,
                    min_calib_tokens: int | None = None) -> Path:
    """:func:`modelopt_moe.export.export_hf` for a Megatron-Core GPTModel (see there). Every rank calls it.
    ``calibration_tokens``: ``{input quantizer name: {global expert: tokens}}`` of the whole model, written per
    expert linear with ``min_calib_tokens``. ``model``: a stage's model, or the list of its chunks (virtual pipeline
    stages)."""
    chunks = [unwrap_model(c) for c in model] if isinstance(model, list | tuple) else [unwrap_model(model)]
    m = chunks[0]
    template = read_hf_config(hf_config) if hf_config is not None else None
    if family is None and template is not None:
        family = family_for_architecture(template).name
    arch = megatron_arch(m, family)
    if template is not None:
        _check_same_arch(get_family(arch.family).arch_from_hf(template), arch, "hf_config")
    lay = _Layout()
    stage = Stage(chunks)
    quants, kv_cache, pipe = _stage_quants(stage, arch, format)
    return write_hf_checkpoint(
        out_dir, arch=arch, family=get_family(arch.family), fmt=format, linear_quants=quants,
        groups=_groups(stage, arch, lay, pipe, format), num_groups=arch.num_layers + 2, dtype=dtype, template=template,
        progress=progress, base_model=base_model, kv_cache=kv_cache,
        calibration_tokens=_expert_linear_tokens(calibration_tokens or {}), min_calib_tokens=min_calib_tokens)


_EXPERT_INPUT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.(linear_fc1|linear_fc2)\.input_quantizer")
_FED_BY = {"linear_fc1": ("gate", "up"), "linear_fc2": ("down",)}  # the canonical linears each GEMM's input feeds


def _expert_linear_tokens(counts: dict[str, dict[int, int]]) -> dict[str, int]:
    """Calibration tokens by canonical expert linear (``layers.0.experts.3.gate``) from the expert input
    quantizers' counts (routed experts; other names are not expert linears of the Hugging Face layout)."""
    out = {}
    for name, cells in counts.items():
        m = _EXPERT_INPUT.fullmatch(name)
        if m is None:
            continue
        for e, n in cells.items():
            out.update({f"layers.{m.group(1)}.experts.{e}.{k}": n for k in _FED_BY[m.group(2)]})
    return out


_IGNORED_FIELDS = ("dtype", "router_aux_loss_coef", "family")


def _check_same_arch(theirs: MoEArch, ours: MoEArch, what: str) -> None:
    a, b = asdict(theirs), asdict(ours)
    diff = {k: (a[k], b[k]) for k in a if k not in _IGNORED_FIELDS and a[k] != b[k]}
    if diff:
        detail = ", ".join(f"{k}: {what} {x!r}, model {y!r}" for k, (x, y) in diff.items())
        raise ExportError(f"{what} does not match the Megatron model: {detail}")


class _Staged:
    """Every parameter's new value, read and shape-checked before any parameter is written (all or nothing)."""

    def __init__(self):
        self.items: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ExportError(f"{name}: Hugging Face slice of shape {tuple(value.shape)} does not fit the Megatron "
                              f"parameter of shape {tuple(param.shape)}")
        self.items.append((param, value))

    def write(self) -> None:
        for param, value in self.items:
            param.data.copy_(value)


def _read_slice(reader: HfCheckpointReader, param: Param, target: torch.Tensor, names: list[str],
                rank: int, arch: MoEArch, tp_size: int) -> torch.Tensor:
    """This rank's slice of a parameter, read from the checkpoint by the table's rule."""
    if param.rule == "replicated":
        return reader.get(names[0])
    if param.rule == "row":
        cols = target.shape[1]
        return reader.get_cols(names[0], rank * cols, (rank + 1) * cols)
    if param.rule == "glu":
        rows = target.shape[0] // 2
        return torch.cat([reader.get_rows(n, rank * rows, (rank + 1) * rows) for n in names])
    if param.rule == "qkv":
        ng, d, hpg = arch.num_kv_heads, arch.head_dim, arch.num_attention_heads // arch.num_kv_heads
        ng_local = ng // tp_size
        g0 = rank * ng_local
        q = reader.get_rows(names[0], g0 * hpg * d, (g0 + ng_local) * hpg * d).reshape(ng_local, hpg * d, -1)
        k = reader.get_rows(names[1], g0 * d, (g0 + ng_local) * d).reshape(ng_local, d, -1)
        v = reader.get_rows(names[2], g0 * d, (g0 + ng_local) * d).reshape(ng_local, d, -1)
        return torch.cat([q, k, v], 1).reshape(target.shape)
    if param.rule == "qkv_gate":  # q_proj holds each head's [q_h; gate_h]; Megatron each group's [q; gate; k; v]
        ng, d, hpg = arch.num_kv_heads, arch.head_dim, arch.num_attention_heads // arch.num_kv_heads
        ng_local = ng // tp_size
        g0 = rank * ng_local
        qg = reader.get_rows(names[0], g0 * hpg * 2 * d, (g0 + ng_local) * hpg * 2 * d).reshape(ng_local, hpg, 2,
                                                                                                   d, -1)
        k = reader.get_rows(names[1], g0 * d, (g0 + ng_local) * d).reshape(ng_local, d, -1)
        v = reader.get_rows(names[2], g0 * d, (g0 + ng_local) * d).reshape(ng_local, d, -1)
        q, gate = (qg[:, :, i].reshape(ng_local, hpg * d, -1) for i in (0, 1))
        return torch.cat([q, gate, k, v], 1).reshape(target.shape)
    if param.rule in ("gdn_in", "gdn_conv"):  # this rank's slice of every section, q / k / v from the first tensor
        sections = gdn_sections(arch, param.rule)
        qk = sections[0]
        sources = [(0, 0), (0, qk), (0, 2 * qk), (1, 0), (2, 0), (3, 0)][:len(sections)]
        parts = []
        for (src, offset), size in zip(sources, sections, strict=True):
            local = size // tp_size
            parts.append(reader.get_rows(names[src], offset + rank * local, offset + (rank + 1) * local))
        return torch.cat(parts, 0).reshape(target.shape)
    rows = target.shape[0]
    return reader.get_rows(names[0], rank * rows, (rank + 1) * rows)


def _label(names: list[str]) -> str:
    """``layers.0.q/k/v_proj`` for the parts of one parameter."""
    if len(names) == 1:
        return names[0]
    prefix = names[0].rpartition(".")[0] + "."
    return prefix + "/".join(n.removeprefix(prefix) for n in names)


@torch.no_grad()
def import_megatron(model, hf_dir: str | os.PathLike) -> None:
    """:func:`modelopt_moe.export.import_hf` for a Megatron-Core GPTModel: each rank reads its own slices.
    ``model``: a stage's model, or the list of its chunks (virtual pipeline stages, in ``vp_stage`` order): each
    chunk gets its own layers, the embedding goes to the chunk that holds it and the final norm and output layer to
    the chunk that holds them.

    All or nothing: the checkpoint's files are checked from their headers (:class:`HfCheckpointReader`), and every
    slice this rank needs (for all of its chunks) is read and shape-checked, before the first parameter of any chunk
    is written. The check covers the whole checkpoint on every rank, so every rank reaches the same verdict without a
    collective.
    """
    chunks = [unwrap_model(c) for c in model] if isinstance(model, list | tuple) else unwrap_model(model)
    try:
        chunks = stage_chunks(chunks, "import_hf")
    except ValueError as e:
        raise ExportError(str(e)) from None
    m = Stage(chunks)
    reader = HfCheckpointReader(hf_dir)
    archs = [megatron_arch(chunk, reader.family.name) for chunk in chunks]
    for i, chunk_arch in enumerate(archs):  # every chunk: one built from another config would take other slices
        _check_same_arch(reader.arch, chunk_arch, f"{hf_dir}/config.json" if len(chunks) == 1 else
                         f"{hf_dir}/config.json (model chunk {i})")
    arch = archs[0]
    lay = _Layout()
    staged = _Staged()
    table = reader.family.megatron
    for key, L in _group_keys(arch):
        if not m.owns(key):  # another pipeline stage's
            continue
        if key == "final" and arch.tie_word_embeddings and not m.first:
            # the last stage's copy of the tied embedding (Megatron keeps it in sync through its gradients)
            param = table.params(arch, "embedding")[0]
            target, names = _get(m, "output_layer.weight"), _names(param, None)
            _, tp_size, rank = _group(param, lay)
            staged.add(target, _read_slice(reader, param, target, names, rank, arch, tp_size), "lm_head (tied)")
        for param in table.params(arch, key):
            _, tp_size, rank = _group(param, lay)
            if not param.expert:
                target = _resolve(m, param, L)[1]
                _, tp_size, rank = _group(param, lay, _split(target, param, arch))
                names = _names(param, L)
                staged.add(target, _read_slice(reader, param, target, names, rank, arch, tp_size), _label(names))
                continue
            n = _num_local_experts(_get(m, table.experts.format(L=L)))
            if param.rule in STACKED:
                if lay.etp_size != 1:
                    raise ExportError(f"{param.path[0].format(L=L, i=0)}: fused 3-D experts need expert tensor "
                                      f"parallel size 1, got {lay.etp_size}")
                name = _names(param, L)[0]
                for i in range(n):
                    e = lay.ep_rank * n + i
                    value = _from_stacked(reader.get_rows(name, e, e + 1)[0], param.rule)
                    staged.add(_resolve(m, param, L, i)[1], value, f"{name}[{e}]")
                continue
            for i in range(n):
                target = _resolve(m, param, L, i)[1]
                names = _names(param, L, lay.ep_rank * n + i)
                staged.add(target, _read_slice(reader, param, target, names, rank, arch, tp_size), _label(names))
    staged.write()


class MegatronExportAdapter:
    """The Megatron-Core adapter of :mod:`modelopt_moe.export` (registered by the Megatron plugin)."""

    name = "megatron"

    def owns(self, model) -> bool:
        """Whether ``model`` (inside any wrappers) is a Megatron ``GPTModel``."""
        return isinstance(unwrap_model(model), GPTModel)

    def export_hf(self, model, out_dir, *, format: str, family: str | None, **options) -> Path:
        """Writes ``model`` as a Hugging Face checkpoint in ``out_dir`` (:func:`export_megatron`); returns the
        directory."""
        return export_megatron(model, out_dir, format=format, family=family, **options)

    def import_hf(self, model, hf_dir) -> None:
        """Loads the Hugging Face checkpoint ``hf_dir`` into the built ``model`` or list of a stage's model chunks
        (:func:`import_megatron`)."""
        import_megatron(model, hf_dir)

    def build_model(self, hf_dir_or_config, *, spec: str = "local", **overrides):
        """Builds the Megatron ``GPTModel`` of a Hugging Face config (:func:`build_megatron_model`)."""
        return build_megatron_model(hf_dir_or_config, spec=spec, **overrides)
