"""Megatron-Core's local ``DotProductAttention`` for multi-latent attention, whose query/key and value heads differ
in size.

``MLASelfAttention`` builds its core attention with ``k_channels`` (query/key head size, RoPE part included) and
``v_channels``; Megatron-Core's own ``DotProductAttention`` takes neither and shapes its output by ``kv_channels``.
This subclass takes both and shapes the context by the value heads; the scores, mask, softmax and dropout are
Megatron's, unchanged. Used by :func:`~modelopt_moe.plugins.megatron.hf_model.build_megatron_model` with
``spec="local"`` (CPU or GPU); the Transformer Engine spec keeps TE's attention, which takes both sizes.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["LatentDotProductAttention"]


class LatentDotProductAttention(DotProductAttention):
    """``DotProductAttention`` with query/key heads of ``k_channels`` and value heads of ``v_channels``."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:  # the context is [s, b, heads_per_partition * v_channels]
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
        self.k_channels, self.v_channels = k_channels, v_channels
