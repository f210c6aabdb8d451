"""Quantized Megatron core attention: the KV cache's fake quant (``k_bmm_quantizer`` / ``v_bmm_quantizer``, and
``q_bmm_quantizer``), as Model Optimizer 0.47 puts them on Megatron's core attention.

Megatron's ``Attention.forward`` applies RoPE to the query and key, then calls ``self.core_attention(query, key,
value, ...)``: the core attention's inputs are the K and V that serving engines write to their KV cache (vLLM and
TensorRT-LLM quantize the cache right after RoPE). :class:`QuantCoreAttentionMixin` fake-quantizes them there, for
any core attention with that call (Megatron's ``DotProductAttention`` here; Transformer Engine's
``TEDotProductAttention`` in :mod:`.te_experts`), with a straight-through gradient. The amax is one scalar per
layer: the KV heads are split over TP, so calibration max-reduces it over TP (and DP), and checkpoints carry it
replicated under the layer axis (:func:`.sharded_state_dict.per_layer_quantizers_sharded_state_dict`).
:func:`kv_cache_quants` hands them to the Hugging Face export (:mod:`modelopt_moe.export.kv_cache`).
"""

from __future__ import annotations

from modelopt_moe.export.errors import ExportError
from modelopt_moe.export.kv_cache import KvCacheQuant
from modelopt_moe.quantization.config import ConfigError
from modelopt_moe.quantization.conversion import QuantModuleMixin
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

from .sharded_state_dict import per_layer_quantizers_sharded_state_dict

__all__ = ["BMM_QUANTIZERS", "QuantCoreAttentionMixin", "kv_cache_quants"]

BMM_QUANTIZERS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer")


class QuantCoreAttentionMixin(QuantModuleMixin):
    """A Megatron core attention (``forward(query, key, value, ...)``, K and V after RoPE, ``[s, b, heads, dim]``)
    whose query, key and value go through ``q_bmm_quantizer``, ``k_bmm_quantizer`` and ``v_bmm_quantizer``.

    Rules name them as Model Optimizer does (``*[kv]_bmm_quantizer``); a quantizer no rule names is disabled, so
    a model preset alone leaves the attention unquantized. It holds no weight.
    """

    def _setup_quantizers(self, config):
        for name in BMM_QUANTIZERS:
            setattr(self, name, TensorQuantizer())

    def forward(self, query, key, value, *args, **kwargs):
        """The core attention's forward on the fake-quantized query, key and value."""
        return super().forward(self.q_bmm_quantizer(query), self.k_bmm_quantizer(key), self.v_bmm_quantizer(value),
                               *args, **kwargs)

    def calibrate_weights(self) -> None:
        """No weights."""

    def weights_to_calibrate(self) -> list:
        """No weights: weight calibration algorithms (``mse``) have nothing to search here."""
        return []

    def fold_weight(self) -> None:
        """No weights."""

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        """One amax per layer: the max over the data-parallel ranks (other tokens) and the tensor-parallel ranks
        (other heads)."""
        return ("dp", "tp")

    def finalize_calibration(self, groups: dict) -> list[str]:
        """Refuses an amax that is not one per layer (it would depend on the TP size: heads are split over TP).

        Raises:
            ConfigError: an enabled bmm quantizer with ``axis`` set or static blocks.
        """
        for name in BMM_QUANTIZERS:
            q = getattr(self, name)
            if q.is_enabled and (q.axis is not None or q.static_block_size is not None):
                raise ConfigError(f"{type(self).__name__}.{name}: axis={q.axis!r}, static block "
                                  f"{q.static_block_size!r}: the KV cache takes one amax per layer (axis: null, "
                                  "no static blocks; dynamic blocks such as NVFP4's are fine)")
        return []

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's entries plus the per-layer bmm amaxes (replicated over TP and DP)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sd.update(per_layer_quantizers_sharded_state_dict(self, BMM_QUANTIZERS, prefix, sharded_offsets, metadata))
        return sd


def kv_cache_quants(model, offset: int = 0) -> list[KvCacheQuant]:
    """Each decoder layer's KV-cache quantizers, for the Hugging Face export (local state only: no collective; the
    amaxes are the same on every rank). ``offset``: the global index of the model's first layer (a pipeline
    stage's), for the names in errors.

    Raises:
        ExportError: a quantizing ``q_bmm_quantizer`` (no engine reads a quantized query from a checkpoint).
    """
    out = []
    for i, layer in enumerate(model.decoder.layers):
        core = getattr(layer.self_attention, "core_attention", None)  # a Gated DeltaNet layer keeps no KV cache
        if not isinstance(core, QuantCoreAttentionMixin):
            out.append(KvCacheQuant())
            continue
        if core.q_bmm_quantizer.is_quantizing:
            raise ExportError(f"decoder.layers.{i + offset}.self_attention.core_attention.q_bmm_quantizer is enabled: "
                              "checkpoints carry a quantized KV cache (k_bmm_quantizer / v_bmm_quantizer) only")
        k, v = core.k_bmm_quantizer, core.v_bmm_quantizer
        out.append(KvCacheQuant(k.fmt if k.is_quantizing else None, v.fmt if v.is_quantizing else None, k.amax,
                                v.amax))
    return out
