"""The weights a quantized module's weight quantizers see, and how a quantizer's amax update mode is set.

Below both :mod:`.conversion` (which sets each weight quantizer's ``weight_amax_update`` from the config) and
:mod:`.weight_amax` (which recomputes dynamic amaxes from these weights): it imports neither.
"""

from __future__ import annotations

import torch
from torch import nn

from .expert_quantizer import ExpertQuantizer
from .tensor_quantizer import TensorQuantizer

__all__ = ["weight_operands", "learned_amax_attributes", "set_weight_amax_update"]


def weight_operands(module: nn.Module):
    """``(relative name, quantizer, weights)`` of every weight quantizer ``module`` owns (expert GEMMs and a dense
    ``weight``); an expert's linear whose quantizer is a view of its layer's has none of its own."""
    for gemm in module.expert_gemms():
        q = gemm.quantizers.weight_quantizer
        weights = gemm.weights if gemm.weights is not None else module.expert_weights()
        yield (f"{gemm.name}.weight_quantizer" if gemm.name else "weight_quantizer"), q, list(weights)
    q = module._modules.get("weight_quantizer")
    if isinstance(q, TensorQuantizer) and not isinstance(q, ExpertQuantizer) and isinstance(
            getattr(module, "weight", None), torch.Tensor):
        yield "weight_quantizer", q, [module.weight]


def learned_amax_attributes(module: nn.Module, q: TensorQuantizer) -> dict:
    """Megatron parameter attributes a learned amax copies from the weights of its GEMM (the weights it quantizes, or
    those its input meets): ``allreduce`` (False for expert parameters, which Megatron's DDP reduces over
    expert-data-parallel ranks only)."""
    for gemm in module.expert_gemms():  # a learned input amax of an expert GEMM lives where its weights do
        if gemm.quantizers._modules.get("input_quantizer") is q:
            weights = gemm.weights if gemm.weights is not None else module.expert_weights()
            return {"allreduce": weights[0].allreduce} if weights and hasattr(weights[0], "allreduce") else {}
    for _, owner, weights in weight_operands(module):
        if (owner is q or module._modules.get("input_quantizer") is q) and weights and hasattr(weights[0],
                                                                                                "allreduce"):
            return {"allreduce": weights[0].allreduce}
    return {}


def set_weight_amax_update(name: str, q: TensorQuantizer, module: nn.Module, mode: str) -> None:
    """Gives quantizer ``q`` (full name ``name``, owned by ``module``) the amax update ``mode``; a learned amax
    parameter gets the Megatron attributes of the weights it quantizes.

    Raises:
        ValueError: naming the quantizer, for a mode it cannot have.
    """
    weights = next((w for _, owner, w in weight_operands(module) if owner is q), [])
    block_shape = None
    if q.static_block_scales and weights:
        w = weights[0]
        block_shape = (*w.shape[:-1], w.shape[-1] // 16)
        block_shape = (len(weights), *block_shape) if isinstance(q, ExpertQuantizer) else block_shape
    # The module's device, not the CPU: calibration writes a learned amax in place, where it was made.
    device = next((p.device for p in (*weights, *module.parameters())), None)
    try:
        q.set_amax_update(mode, block_shape, device)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if q.learns_amax:
        for key, value in learned_amax_attributes(module, q).items():
            setattr(q._amax, key, value)
    if q.learns_block_amax and weights:
        # Split like the weight (tensor-parallel) and reduced like it (data-parallel): Megatron's attributes of it.
        for key in ("allreduce", "tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(weights[0], key):
                setattr(q.block_amax, key, getattr(weights[0], key))
