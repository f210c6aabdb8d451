"""Triton kernels (optional) with pure-torch fallbacks: grouped fake quantization of MoE experts.

Imports with torch alone; ``TRITON_AVAILABLE`` says whether triton imports, :func:`kernels_available` whether the
kernels can run on a device (CUDA, or CPU under ``TRITON_INTERPRET=1``). Imports only ``modelopt_moe.numerics``.
"""

from .grouped_fake_quant import (
    GroupedInputFakeQuant,
    GroupedWeightFakeQuant,
    GroupedWeightSTE,
    grouped_input_clip_grad,
    grouped_input_fake_quant,
    grouped_input_fake_quant_ste,
    grouped_weight_clip_grad,
    grouped_weight_fake_quant,
    grouped_weight_fake_quant_ste,
)
from .grouped_scaled_input import (
    GroupedScaledInputFakeQuant,
    grouped_input_fake_quant_scaled,
    grouped_input_fake_quant_scaled_ste,
    grouped_input_scaled_clip_grad,
)
from .grouped_training_stats import (
    GroupedInputSTE,
    expert_row_sums,
    grouped_input_fake_quant_stats,
    grouped_weight_amax,
    grouped_weight_fake_quant_stats,
)
from .launch import MAX_EXPERTS, TRITON_AVAILABLE, clear_table_cache, kernels_available

__all__ = [
    "MAX_EXPERTS",
    "TRITON_AVAILABLE",
    "GroupedInputFakeQuant",
    "GroupedWeightFakeQuant",
    "GroupedWeightSTE",
    "clear_table_cache",
    "grouped_input_clip_grad",
    "grouped_input_fake_quant",
    "grouped_input_fake_quant_ste",
    "grouped_weight_clip_grad",
    "grouped_weight_fake_quant",
    "grouped_weight_fake_quant_ste",
    "kernels_available",
    "grouped_weight_amax",
    "grouped_weight_fake_quant_stats",
    "grouped_input_fake_quant_stats",
    "expert_row_sums",
    "GroupedInputSTE",
    "grouped_input_fake_quant_scaled",
    "grouped_input_fake_quant_scaled_ste",
    "grouped_input_scaled_clip_grad",
    "GroupedScaledInputFakeQuant",
]
