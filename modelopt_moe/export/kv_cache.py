"""The quantized KV cache in exported checkpoints: its config entries and its per-layer ``k_scale`` / ``v_scale``.

A framework adapter gives one :class:`KvCacheQuant` per layer (the format of ``k_bmm_quantizer`` /
``v_bmm_quantizer`` and their per-layer amaxes: plain values, no modules); :func:`kv_cache_plan` checks them before
anything is written. What the engines read:

=====================  =============================================  ============================================
                       compressed-tensors                             Model Optimizer
=====================  =============================================  ============================================
config                 ``kv_cache_scheme: {num_bits: 8, type: float,  ``kv_cache_quant_algo: FP8`` (``NVFP4``), in
                       strategy: tensor, dynamic: false, symmetric:   ``config.json`` and ``hf_quant_config.json``
                       true}``
tensors (fp32)         ``<attn>.k_scale`` / ``<attn>.v_scale`` ``[1]``  ``<attn>.k_proj.k_scale`` /
                                                                      ``<attn>.v_proj.v_scale`` ``[]``
=====================  =============================================  ============================================

(``<attn>`` = ``model.layers.<L>.self_attn``.) vLLM's and SGLang's loaders remap both spellings to their attention
layer's ``attn.k_scale`` (``maybe_remap_kv_scale_name``). The value is the dequantization scale the engines multiply
the stored FP8 codes by: ``1 / s`` with ``s = 448 / amax``, the divisor training's fake quant used (the same rule as
an FP8 ``input_scale``; ``amax / 448`` up to one rounding). Model Optimizer 0.47 writes ``amax / 448`` for NVFP4 KV
caches too, and so does this. It clamps FP8 KV scales to at least 1.0 by default; this does not (the model trained
with the calibrated scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..numerics import get_format
from ..numerics.format import Format, reciprocal
from ..numerics.fp8 import E4M3, fp8_scale
from ..numerics.nvfp4 import NVFP4
from .errors import ExportError

__all__ = ["KvCacheQuant", "KvCachePlan", "kv_cache_plan", "kv_scale_names", "read_kv_cache_scales"]

# format -> (compressed-tensors kv_cache_scheme or None where it has none, Model Optimizer's kv_cache_quant_algo)
_KV_FORMATS: dict[Format, tuple[dict | None, str]] = {
    E4M3: ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}, "FP8"),
    NVFP4: (None, "NVFP4"),
}


@dataclass(frozen=True)
class KvCacheQuant:
    """One layer's KV-cache quantizers: the format name of K and of V (None: not quantized) and their amaxes."""

    k_fmt: str | None = None
    v_fmt: str | None = None
    k_amax: torch.Tensor | None = None
    v_amax: torch.Tensor | None = None


@dataclass(frozen=True)
class KvCachePlan:
    """The checkpoint's KV cache: its format and each layer's amaxes."""

    fmt: Format
    amax: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def config_entries(self, file_format: str) -> dict:
        """The ``quantization_config`` (and ``hf_quant_config.json`` ``quantization``) keys of this KV cache."""
        ct_scheme, algo = _KV_FORMATS[self.fmt]
        return {"kv_cache_scheme": dict(ct_scheme)} if file_format == "compressed-tensors" else {
            "kv_cache_quant_algo": algo}

    def tensors(self, layer: int, k_module: str, v_module: str, file_format: str) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s ``k_scale`` / ``v_scale``, given the Hugging Face names of its ``k_proj`` and
        ``v_proj``."""
        k_amax, v_amax = self.amax[layer]
        names = kv_scale_names(k_module, v_module, file_format)
        return {name: E4M3.export.scalar(reciprocal(fp8_scale(amax)), file_format)
                for name, amax in zip(names, (k_amax, v_amax), strict=True)}


def kv_scale_names(k_module: str, v_module: str, file_format: str) -> tuple[str, str]:
    """The names of a layer's ``k_scale`` and ``v_scale`` in ``file_format``, given the Hugging Face names of its
    ``k_proj`` and ``v_proj`` (compressed-tensors: on the attention module; Model Optimizer: on the projections)."""
    if file_format == "compressed-tensors":
        return f"{k_module.rpartition('.')[0]}.k_scale", f"{v_module.rpartition('.')[0]}.v_scale"
    return f"{k_module}.k_scale", f"{v_module}.v_scale"


def read_kv_cache_scales(quant_config: dict, file_format: str, tensors: Mapping[str, torch.Tensor],
                         kv_modules: list[tuple[str, str]]) -> tuple[Format, list[tuple[torch.Tensor, torch.Tensor]]] \
        | None:
    """A checkpoint's KV cache as the engines read it: its format and every layer's ``(k_scale, v_scale)`` (fp32
    scalars, the dequantization scales: the engines store ``fp8(k / k_scale)``); None where the config quantizes no
    KV cache.

    Args:
        quant_config: the ``quantization_config`` (``kv_cache_scheme``) or Model Optimizer's ``quantization``
            (``kv_cache_quant_algo``).
        file_format: ``compressed-tensors`` or ``modelopt``.
        tensors: the checkpoint's tensors by name (at least the scales).
        kv_modules: every layer's ``(k_proj, v_proj)`` Hugging Face names.

    Raises:
        ExportError: a KV-cache scheme or algorithm no engine reads as one, or a missing or invalid scale (naming it).
    """
    if file_format == "compressed-tensors":
        scheme = quant_config.get("kv_cache_scheme")
        if scheme is None:
            return None
        fmt = next((f for f, (ct, _) in _KV_FORMATS.items() if ct is not None and all(
            scheme.get(k) == v for k, v in ct.items())), None)
        found, expected = f"kv_cache_scheme {scheme}", [ct for ct, _ in _KV_FORMATS.values() if ct]
    else:
        algo = quant_config.get("kv_cache_quant_algo")
        if algo is None:
            return None
        fmt = next((f for f, (_, a) in _KV_FORMATS.items() if a == algo), None)
        found, expected = f"kv_cache_quant_algo {algo!r}", [a for _, a in _KV_FORMATS.values()]
    if fmt is None:
        raise ExportError(f"quantization_config {found}: expected one of {expected}")
    scales = []
    for k_module, v_module in kv_modules:
        pair = []
        for name in kv_scale_names(k_module, v_module, file_format):
            t = tensors.get(name)
            if t is None or t.numel() != 1 or not t.is_floating_point() or not bool(torch.isfinite(t).all()) \
                    or not bool((t > 0).all()):
                got = "absent" if t is None else f"{t.dtype} {list(t.shape)} {t.flatten()[:2].tolist()}"
                raise ExportError(f"{name}: {got}; the {found} needs one finite positive fp32 scale per layer")
            pair.append(t.float().reshape(()))
        scales.append(tuple(pair))
    return fmt, scales


def kv_cache_plan(layers: list[KvCacheQuant], file_format: str) -> KvCachePlan | None:
    """The checkpoint's KV cache from every layer's quantizers; None where no layer quantizes K or V.

    Raises:
        ExportError: naming the layer: K or V quantized in some layers (or one of K, V) and not in others, formats
            that differ, a format no engine reads as a KV cache (or not in ``file_format``), a missing or invalid
            amax.
    """
    if not any(q.k_fmt or q.v_fmt for q in layers):
        return None
    first = next(q.k_fmt or q.v_fmt for q in layers if q.k_fmt or q.v_fmt)
    for i, q in enumerate(layers):
        if q.k_fmt != first or q.v_fmt != first:
            raise ExportError(f"layer {i}: KV cache quantized as K={q.k_fmt}, V={q.v_fmt}; a checkpoint's KV cache "
                              f"has one format for K and V in every layer (other layers: {first})")
    fmt = get_format(first)
    if fmt not in _KV_FORMATS or (file_format == "compressed-tensors" and _KV_FORMATS[fmt][0] is None):
        readable = [f.label for f, (ct, _) in _KV_FORMATS.items() if file_format != "compressed-tensors" or ct]
        others = "" if file_format != "compressed-tensors" else "; format='modelopt' also takes NVFP4"
        raise ExportError(f"KV cache in {fmt.label}: {file_format} checkpoints express a KV cache in {readable}"
                          f"{others}")
    amax = []
    for i, q in enumerate(layers):
        for kind, a in (("k", q.k_amax), ("v", q.v_amax)):
            if a is None or a.numel() != 1 or not bool(torch.isfinite(a).all()) or not bool((a > 0).all()):
                raise ExportError(f"layer {i}: {kind}_bmm_quantizer amax {None if a is None else a.tolist()}: "
                                  "expected one finite positive amax per layer (calibrate before exporting)")
        amax.append((q.k_amax.detach().float().cpu().reshape(()), q.v_amax.detach().float().cpu().reshape(())))
    return KvCachePlan(fmt, tuple(amax))
