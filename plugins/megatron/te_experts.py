"""Megatron's Transformer Engine grouped expert linears (``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear``, the experts of ``TEGroupedMLP``): the TE plugin's quantized forward plus Megatron's
expert grid and global-expert-axis checkpoints. Registered when both Megatron-Core and Transformer Engine are
imported; each class declares its own expert-TP weight axis. Also Transformer Engine's core attention
(``TEDotProductAttention``), which gets the KV cache's quantizers of :mod:`.attention`.
"""

from __future__ import annotations

from megatron.core.extensions.transformer_engine import (
    TEColumnParallelGroupedLinear,
    TEDotProductAttention,
    TERowParallelGroupedLinear,
)

from modelopt_moe.quantization.conversion import QuantModuleRegistry

from ..transformer_engine import QuantTEGroupedLinear
from .attention import QuantCoreAttentionMixin
from .modules import MegatronGroupedExpertsMixin

__all__ = ["QuantTEColumnParallelGroupedLinear", "QuantTERowParallelGroupedLinear", "register", "CLASSES"]


class QuantTEColumnParallelGroupedLinear(MegatronGroupedExpertsMixin, QuantTEGroupedLinear):
    """Quantized Megatron ``TEColumnParallelGroupedLinear`` (``linear_fc1``): expert weights split on axis 0."""
    sharded_axis = 0


class QuantTERowParallelGroupedLinear(MegatronGroupedExpertsMixin, QuantTEGroupedLinear):
    """Quantized Megatron ``TERowParallelGroupedLinear`` (``linear_fc2``): expert weights split on axis 1."""
    sharded_axis = 1


CLASSES = {
    TEColumnParallelGroupedLinear: QuantTEColumnParallelGroupedLinear,
    TERowParallelGroupedLinear: QuantTERowParallelGroupedLinear,
    TEDotProductAttention: QuantCoreAttentionMixin,  # the KV cache's quantizers, as on DotProductAttention
}


def register() -> None:
    """Registers the quantized classes of Megatron's TE grouped expert linears."""
    for original, quantized in CLASSES.items():
        QuantModuleRegistry.register(original, quantized)
