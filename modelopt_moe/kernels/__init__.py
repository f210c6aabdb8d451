"""Triton kernels (optional) with pure-torch fallbacks: grouped fake quantization of MoE experts, and the
distillation KL.

Imports with torch alone; ``TRITON_AVAILABLE`` says whether triton imports, :func:`kernels_available` whether the
kernels can run on a device (CUDA, or CPU under ``TRITON_INTERPRET=1``). Imports only ``modelopt_moe.numerics``.

One module per op family, each with the same parts in the same order (launcher with its ``ValueError`` checks, torch
fallback, ``torch.library.custom_op`` with ``register_fake``, autograd), its ``@triton.jit`` code apart in
``<family>_kernels.py``, imported on the first launch:

- :mod:`.weight_fake_quant`: N expert weights in one launch, and the clipped straight-through gradient;
- :mod:`.static_blocks_fake_quant`: the same with static NVFP4 block scales (a calibrated amax per block);
- :mod:`.input_fake_quant`: tokens split among N experts by ``m_splits``, optionally times a per-row scale;
- :mod:`.dense_fake_quant`: one dense weight or input through the two ops above (their one-expert case);
- :mod:`.weight_amax`: ``max |w|`` of N experts (``weight_amax_update: dynamic``);
- :mod:`.quant_stats`: fake quant with quantization-error sums (precision autoswitch);
- :mod:`.kl_divergence`: the distillation KL's per-token softmax sums and the student's gradient (the loss and its
  autograd are :func:`modelopt_moe.distill.logits_kl_loss`).

Beneath them: :mod:`.launch` (backend, expert-list signatures, the cached pointer tables, tiling), :mod:`.checks`
(the shared ``ValueError`` checks), :mod:`.fallback` (what the torch fallbacks share), :mod:`.tuning` (launch options
of the weight kernel, with a public hook to override them) and :mod:`.tile_kernels` (the ``@triton.jit`` helpers
every kernel is built from).
"""

from .dense_fake_quant import dense_fake_quant_ste, dense_layout
from .input_fake_quant import (
    GroupedInputFakeQuant,
    GroupedInputSTE,
    GroupedScaledInputFakeQuant,
    grouped_input_clip_grad,
    grouped_input_fake_quant,
    grouped_input_fake_quant_scaled,
    grouped_input_fake_quant_scaled_ste,
    grouped_input_fake_quant_ste,
    grouped_input_scaled_clip_grad,
)
from .launch import MAX_EXPERTS, TRITON_AVAILABLE, clear_table_cache, kernels_available, use_kernels
from .quant_stats import expert_row_sums, grouped_input_fake_quant_stats, grouped_weight_fake_quant_stats
from .static_blocks_fake_quant import (
    GroupedStaticBlocksFakeQuant,
    GroupedStaticBlocksSTE,
    grouped_static_blocks_clip_grad,
    grouped_static_blocks_fake_quant,
    grouped_static_blocks_fake_quant_ste,
)
from .weight_amax import grouped_weight_amax
from .weight_fake_quant import (
    GroupedWeightFakeQuant,
    GroupedWeightSTE,
    grouped_weight_clip_grad,
    grouped_weight_fake_quant,
    grouped_weight_fake_quant_ste,
)

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
    "use_kernels",
    "dense_fake_quant_ste",
    "dense_layout",
    "grouped_weight_amax",
    "grouped_weight_fake_quant_stats",
    "grouped_input_fake_quant_stats",
    "expert_row_sums",
    "GroupedInputSTE",
    "grouped_input_fake_quant_scaled",
    "grouped_input_fake_quant_scaled_ste",
    "grouped_input_scaled_clip_grad",
    "GroupedScaledInputFakeQuant",
    "GroupedStaticBlocksFakeQuant",
    "GroupedStaticBlocksSTE",
    "grouped_static_blocks_clip_grad",
    "grouped_static_blocks_fake_quant",
    "grouped_static_blocks_fake_quant_ste",
]
