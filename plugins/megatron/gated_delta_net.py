"""Megatron-Core's Gated DeltaNet (Qwen3.5's linear-attention layers) in a local layer spec, and on its torch path
where flash-linear-attention is not installed.

Megatron-Core 0.19.2 ships the Gated DeltaNet spec for Transformer Engine only (the input norm fused into ``in_proj``,
the output norm built like every other norm, so zero-centred where the model's other norms are); and its module
refuses to build without flash-linear-attention (FLA), whose Triton ``l2norm`` it calls on the queries and keys even
on its torch path (``deterministic_mode``: ``F.conv1d`` and ``torch_chunk_gated_delta_rule``). Here:

* :func:`gated_delta_net_spec`: the module with Megatron-Core's local column- and row-parallel linears and a plain
  RMSNorm on its gated output (:class:`~.norms.GatedOutputNorm`); the layer keeps its own input norm;
* :func:`torch_gated_delta_net`: where FLA does not import, Megatron's module builds and its q/k L2 norm runs in torch
  (``x * rsqrt(sum(x^2) + 1e-6)`` in float32, FLA's and transformers' formula); the model must then run with
  ``deterministic_mode=True``, which :func:`~.hf_model.build_megatron_model` sets.
"""

from __future__ import annotations

import importlib.util

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from modelopt_moe.quantization.utils import warn_once

from .norms import GatedOutputNorm

__all__ = ["gated_delta_net_spec", "torch_gated_delta_net"]


def gated_delta_net_spec() -> ModuleSpec:
    """Megatron-Core's ``GatedDeltaNet`` with local parallel linears and a plain RMSNorm on its gated output."""
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm, out_proj=RowParallelLinear))


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """FLA's ``l2norm`` in torch: ``x / sqrt(sum(x^2) + eps)`` over ``dim``, in float32, cast back."""
    y = x.float()
    return (y * torch.rsqrt((y * y).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


def torch_gated_delta_net() -> bool:
    """Lets Megatron-Core's ``GatedDeltaNet`` build and run in torch where flash-linear-attention is absent.

    Returns:
        Whether the torch path is in use (FLA absent): the model must then be built with ``deterministic_mode=True``.
        On a GPU that is a fallback, said once on rank 0.
    """
    if importlib.util.find_spec("fla") is not None:
        return False
    from megatron.core.ssm.gated_delta_net import common

    common.HAVE_FLA = True  # the torch path needs none of FLA but its l2norm, given here
    common.l2norm = _l2norm
    if torch.cuda.is_available():
        warn_once("flash-linear-attention is not installed: Megatron-Core's Gated DeltaNet runs its torch path "
                  "(deterministic_mode=True: F.conv1d and torch_chunk_gated_delta_rule), correct but slow; "
                  "pip install flash-linear-attention for its Triton kernels")
    return True
