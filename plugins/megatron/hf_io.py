"""Hugging Face export and import of Megatron-Core GPT MoE models, at any tensor / expert / expert-tensor parallel
layout (pipeline parallelism 1): the Megatron adapter of :mod:`modelopt_moe.export`.

Export streams one layer at a time: every rank gathers the layer's tensor-parallel shards (``all_gather`` over TP,
column-parallel along rows, row-parallel along columns) and each expert slot's weights over expert-TP and EP (local
expert ``i`` of EP rank ``r`` is global expert ``r * N_local + i``, :class:`~modelopt_moe.quantization.ExpertGrid`'s
rule), with every expert's weight and input amax gathered the same way; fused QKV splits into ``q/k/v`` (Megatron
interleaves them per query group), fused ``fc1`` into ``gate/up`` (gate rows first; under expert-TP each rank holds
its slice of both). Rank 0 encodes and writes through :func:`modelopt_moe.export.hf_checkpoint.write_hf_checkpoint`;
the others drop what they gathered. At most one layer's dense weights and ``EP`` experts are in flight at a time.

Import reads each rank's slices straight from the safetensors files (no collective, no full tensor in memory), after
checking the whole checkpoint from its files' headers; it writes the parameters only once every slice is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from modelopt_moe.export.errors import ExportError
from modelopt_moe.export.families import MoEArch, family_for_architecture, get_family, read_hf_config
from modelopt_moe.export.hf_checkpoint import HfCheckpointReader, LinearRecord, TensorRecord, write_hf_checkpoint
from modelopt_moe.export.schemes import LinearQuant, QuantSpec
from modelopt_moe.quantization.conversion import unwrap_model
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

from .attention import kv_cache_quants
from .hf_model import build_megatron_model, megatron_arch

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
        specs.append(QuantSpec(q.fmt, q.axis, q.block_size) if q is not None and q.is_quantizing else None)
    return LinearQuant(*specs)


def _amax(holder, kind: str) -> torch.Tensor | None:
    q = _quantizer(holder, kind)
    return q.amax.detach().float() if q is not None and q.is_quantizing and q.amax is not None else None


def _experts_holder(experts, gemm: str):
    """Where an expert GEMM's quantizers live: ``SequentialMLP.linear_fc1`` (layer-level expert quantizers) or the
    grouped linear ``TEGroupedMLP.linear_fc1``; None for unquantized sequential experts."""
    return getattr(experts, gemm, None)


def _expert_weight(experts, gemm: str, i: int) -> torch.Tensor:
    if hasattr(experts, "local_experts"):
        return getattr(experts.local_experts[i], gemm).weight
    return getattr(getattr(experts, gemm), f"weight{i}")


def _num_local_experts(experts) -> int:
    if hasattr(experts, "local_experts"):
        return len(experts.local_experts)
    return experts.num_local_experts


def _input_norm(layer) -> torch.Tensor:
    """The attention's input RMSNorm weight: the layer's own, or fused into TE's ``linear_qkv``."""
    qkv = layer.self_attention.linear_qkv
    if getattr(qkv, "layer_norm_weight", None) is not None:
        return qkv.layer_norm_weight
    return layer.input_layernorm.weight


def _split_qkv(t: torch.Tensor, arch: MoEArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's per-query-group ``[q heads; k; v]`` rows -> (q, k, v), each in head order."""
    ng, d = arch.num_kv_heads, arch.head_dim
    hpg = arch.num_attention_heads // ng
    grouped = t.reshape(ng, (hpg + 2) * d, *t.shape[1:])
    q, k, v = grouped.split([hpg * d, d, d], dim=1)
    return (q.reshape(ng * hpg * d, *t.shape[1:]), k.reshape(ng * d, *t.shape[1:]),
            v.reshape(ng * d, *t.shape[1:]))


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


def _gather_expert_amax(holder, kind: str, lay: _Layout, gemm: str, num_local: int) -> torch.Tensor | None:
    """All experts' amax ``[E]`` / ``[E, C]`` (C the full channel count), in global expert order."""
    q = _quantizer(holder, kind)
    if q is None or not q.is_quantizing:
        return None
    amax = q.amax.detach().float() if q.amax is not None else None
    if amax is None:
        raise ExportError(f"{gemm}.{kind}: no amax (calibrate the model before exporting)")
    if amax.dim() == 2 and kind == "weight_quantizer":  # per channel: output channels split over expert-TP
        if gemm == "linear_fc1":
            gate, up = _glu_gather(amax.t(), lay.etp, lay.etp_size)
            amax = torch.cat([gate, up], 0).t()
        # fc2's output channels are not split (row-parallel); its amax is already whole
    return _gather_cat(amax, lay.ep, lay.ep_size, 0)


def _expert_records(layer, L: int, arch: MoEArch, lay: _Layout) -> Iterator[LinearRecord]:
    experts = layer.mlp.experts
    n = _num_local_experts(experts)
    if n * lay.ep_size != arch.num_experts:
        raise ExportError(f"layer {L}: {n} local experts x EP {lay.ep_size} != {arch.num_experts} experts")
    fc1, fc2 = _experts_holder(experts, "linear_fc1"), _experts_holder(experts, "linear_fc2")
    quant1, quant2 = _linear_quant(fc1), _linear_quant(fc2)
    amax = {(g, k): _gather_expert_amax(h, k, lay, g, n) for g, h in (("linear_fc1", fc1), ("linear_fc2", fc2))
            for k in ("weight_quantizer", "input_quantizer")}
    inter = arch.moe_ffn_hidden_size
    for i in range(n):
        gate, up = _glu_gather(_expert_weight(experts, "linear_fc1", i), lay.etp, lay.etp_size)
        down = _gather_cat(_expert_weight(experts, "linear_fc2", i), lay.etp, lay.etp_size, 1)
        fc1_all = _all_gather(torch.cat([gate, up], 0), lay.ep, lay.ep_size)
        down_all = _all_gather(down, lay.ep, lay.ep_size)
        for r in range(lay.ep_size):
            e = r * n + i
            w1a, i1a = amax["linear_fc1", "weight_quantizer"], amax["linear_fc1", "input_quantizer"]
            w2a, i2a = amax["linear_fc2", "weight_quantizer"], amax["linear_fc2", "input_quantizer"]
            # gate and up share fc1's amax (one per expert): the same NVFP4 second-level scale, as engines require
            g_amax = u_amax = None if w1a is None else w1a[e]
            if w1a is not None and w1a.dim() == 2:
                g_amax, u_amax = w1a[e, :inter], w1a[e, inter:]
            p = f"layers.{L}.experts.{e}."
            x1 = None if i1a is None else i1a[e]
            yield LinearRecord(p + "gate", fc1_all[r][:inter], quant1, g_amax, x1)
            yield LinearRecord(p + "up", fc1_all[r][inter:], quant1, u_amax, x1)
            yield LinearRecord(p + "down", down_all[r], quant2, None if w2a is None else w2a[e],
                               None if i2a is None else i2a[e])


def _layer_records(layer, L: int, arch: MoEArch, lay: _Layout) -> Iterator:
    p = f"layers.{L}."
    attn = layer.self_attention
    yield TensorRecord(p + "input_norm", _input_norm(layer).detach())
    qkv = attn.linear_qkv
    q, k, v = _split_qkv(_gather_cat(qkv.weight, lay.tp, lay.tp_size, 0), arch)
    w_amax = _amax(qkv, "weight_quantizer")
    if w_amax is not None and w_amax.numel() > 1:  # per channel: this rank's channels, in Megatron's row order
        w_amax = torch.cat(_split_qkv(_gather_cat(w_amax, lay.tp, lay.tp_size, 0), arch), 0)
    in_amax = _amax(qkv, "input_quantizer")
    quant = _linear_quant(qkv)
    for name, w, a in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), _row_amax_split(w_amax, [q, k, v]),
                          strict=True):
        yield LinearRecord(p + name, w, quant, a, in_amax)
    proj = attn.linear_proj
    yield LinearRecord(p + "o_proj", _gather_cat(proj.weight, lay.tp, lay.tp_size, 1), _linear_quant(proj),
                       _amax(proj, "weight_quantizer"), _amax(proj, "input_quantizer"))
    if arch.qk_norm:
        yield TensorRecord(p + "q_norm", attn.q_layernorm.weight.detach())
        yield TensorRecord(p + "k_norm", attn.k_layernorm.weight.detach())
    yield TensorRecord(p + "post_attn_norm", layer.pre_mlp_layernorm.weight.detach())
    yield LinearRecord(p + "router", layer.mlp.router.weight.detach())
    yield from _expert_records(layer, L, arch, lay)


def _linear_quants(m: GPTModel, arch: MoEArch) -> dict[str, LinearQuant]:
    """Every exported linear's quantizers, by canonical name (local state only: no collective)."""
    quants: dict[str, LinearQuant] = {}
    for L, layer in enumerate(m.decoder.layers):
        p = f"layers.{L}."
        attn = layer.self_attention
        qkv = _linear_quant(attn.linear_qkv)
        quants.update({p + n: qkv for n in ("q_proj", "k_proj", "v_proj")})
        quants[p + "o_proj"] = _linear_quant(attn.linear_proj)
        quants[p + "router"] = LinearQuant()
        experts = layer.mlp.experts
        fc1 = _linear_quant(_experts_holder(experts, "linear_fc1"))
        fc2 = _linear_quant(_experts_holder(experts, "linear_fc2"))
        for e in range(arch.num_experts):
            quants.update({f"{p}experts.{e}.gate": fc1, f"{p}experts.{e}.up": fc1, f"{p}experts.{e}.down": fc2})
    if not arch.tie_word_embeddings:
        quants["lm_head"] = _linear_quant(m.output_layer)
    for name, holder in _dense_holders(m):
        for kind in ("weight_quantizer", "input_quantizer"):
            q = _quantizer(holder, kind)
            if q is not None and q.is_quantizing and q.needs_amax and q.amax is None:
                raise ExportError(f"{name}.{kind}: no amax (calibrate the model before exporting)")
    return quants


def _dense_holders(m: GPTModel):
    """Every quantizer holder of the model, by Megatron module name (for the calibration check)."""
    for L, layer in enumerate(m.decoder.layers):
        p = f"decoder.layers.{L}."
        yield p + "self_attention.linear_qkv", layer.self_attention.linear_qkv
        yield p + "self_attention.linear_proj", layer.self_attention.linear_proj
        for gemm in ("linear_fc1", "linear_fc2"):
            yield f"{p}mlp.experts.{gemm}", _experts_holder(layer.mlp.experts, gemm)
    yield "output_layer", m.output_layer


def _groups(m: GPTModel, arch: MoEArch, lay: _Layout) -> Iterator[tuple[str, Iterator]]:
    def embedding():
        yield TensorRecord("embed_tokens", _gather_cat(m.embedding.word_embeddings.weight, lay.tp, lay.tp_size, 0))

    def final():
        yield TensorRecord("norm", m.decoder.final_layernorm.weight.detach())
        if not arch.tie_word_embeddings:
            out = m.output_layer
            yield LinearRecord("lm_head", _gather_cat(out.weight, lay.tp, lay.tp_size, 0), _linear_quant(out),
                               _amax_lm_head(out, lay), _amax(out, "input_quantizer"))

    yield "embedding", embedding()
    for L, layer in enumerate(m.decoder.layers):
        yield f"layer {L}", _layer_records(layer, L, arch, lay)
    yield "output", final()


def _amax_lm_head(out, lay: _Layout) -> torch.Tensor | None:
    a = _amax(out, "weight_quantizer")
    return _gather_cat(a, lay.tp, lay.tp_size, 0) if a is not None and a.numel() > 1 else a


def export_megatron(model, out_dir: str | os.PathLike, *, format: str = "compressed-tensors",
                    family: str | None = None, dtype: torch.dtype | None = None, hf_config=None,
                    progress: bool = True, base_model: str | None = None) -> Path:
    """:func:`modelopt_moe.export.export_hf` for a Megatron-Core GPTModel (see there). Every rank calls it."""
    m = unwrap_model(model)
    template = read_hf_config(hf_config) if hf_config is not None else None
    if family is None and template is not None:
        family = family_for_architecture(template).name
    arch = megatron_arch(m, family)
    if template is not None:
        _check_same_arch(get_family(arch.family).arch_from_hf(template), arch, "hf_config")
    lay = _Layout()
    return write_hf_checkpoint(
        out_dir, arch=arch, family=get_family(arch.family), fmt=format, linear_quants=_linear_quants(m, arch),
        groups=_groups(m, arch, lay), num_groups=arch.num_layers + 2, dtype=dtype, template=template,
        progress=progress, base_model=base_model, kv_cache=kv_cache_quants(m))


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


@torch.no_grad()
def import_megatron(model, hf_dir: str | os.PathLike) -> None:
    """:func:`modelopt_moe.export.import_hf` for a Megatron-Core GPTModel: each rank reads its own slices.

    All or nothing: the checkpoint's files are checked from their headers (:class:`HfCheckpointReader`), and every
    slice this rank needs is read and shape-checked, before the first parameter is written. The check covers the
    whole checkpoint on every rank, so every rank reaches the same verdict without a collective.
    """
    m = unwrap_model(model)
    reader = HfCheckpointReader(hf_dir)
    arch = megatron_arch(m, reader.family.name)
    _check_same_arch(reader.arch, arch, f"{hf_dir}/config.json")
    lay = _Layout()
    staged = _Staged()
    emb = m.embedding.word_embeddings
    staged.add(emb.weight, reader.get_rows("embed_tokens", emb.vocab_start_index, emb.vocab_end_index),
               "embed_tokens")
    ng, d, hpg = arch.num_kv_heads, arch.head_dim, arch.num_attention_heads // arch.num_kv_heads
    ng_local = ng // lay.tp_size
    g0 = lay.tp_rank * ng_local
    inter = arch.moe_ffn_hidden_size // lay.etp_size
    heads_cols = arch.num_attention_heads * d // lay.tp_size
    for L, layer in enumerate(m.decoder.layers):
        p = f"layers.{L}."
        attn = layer.self_attention
        staged.add(_input_norm(layer), reader.get(p + "input_norm"), p + "input_norm")
        q = reader.get_rows(p + "q_proj", g0 * hpg * d, (g0 + ng_local) * hpg * d).reshape(ng_local, hpg * d, -1)
        k = reader.get_rows(p + "k_proj", g0 * d, (g0 + ng_local) * d).reshape(ng_local, d, -1)
        v = reader.get_rows(p + "v_proj", g0 * d, (g0 + ng_local) * d).reshape(ng_local, d, -1)
        staged.add(attn.linear_qkv.weight, torch.cat([q, k, v], 1).reshape(-1, q.shape[-1]), p + "q/k/v_proj")
        c0 = lay.tp_rank * heads_cols
        staged.add(attn.linear_proj.weight, reader.get_cols(p + "o_proj", c0, c0 + heads_cols), p + "o_proj")
        if arch.qk_norm:
            staged.add(attn.q_layernorm.weight, reader.get(p + "q_norm"), p + "q_norm")
            staged.add(attn.k_layernorm.weight, reader.get(p + "k_norm"), p + "k_norm")
        staged.add(layer.pre_mlp_layernorm.weight, reader.get(p + "post_attn_norm"), p + "post_attn_norm")
        staged.add(layer.mlp.router.weight, reader.get(p + "router"), p + "router")
        experts = layer.mlp.experts
        n = _num_local_experts(experts)
        r0 = lay.etp_rank * inter
        for i in range(n):
            e = f"{p}experts.{lay.ep_rank * n + i}."
            fc1 = torch.cat([reader.get_rows(e + "gate", r0, r0 + inter), reader.get_rows(e + "up", r0, r0 + inter)])
            staged.add(_expert_weight(experts, "linear_fc1", i), fc1, e + "gate/up")
            staged.add(_expert_weight(experts, "linear_fc2", i), reader.get_cols(e + "down", r0, r0 + inter),
                       e + "down")
    staged.add(m.decoder.final_layernorm.weight, reader.get("norm"), "norm")
    if not arch.tie_word_embeddings:
        out = m.output_layer
        rows = out.weight.shape[0]
        staged.add(out.weight, reader.get_rows("lm_head", lay.tp_rank * rows, (lay.tp_rank + 1) * rows), "lm_head")
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
        """Loads the Hugging Face checkpoint ``hf_dir`` into the built ``model`` (:func:`import_megatron`)."""
        import_megatron(model, hf_dir)

    def build_model(self, hf_dir_or_config, *, spec: str = "local", **overrides):
        """Builds the Megatron ``GPTModel`` of a Hugging Face config (:func:`build_megatron_model`)."""
        return build_megatron_model(hf_dir_or_config, spec=spec, **overrides)
