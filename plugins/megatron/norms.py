"""Norm builders for Megatron layer specs.

:func:`sequence_parallel_norm` is Megatron's ``WrappedTorchNorm`` (a plain torch ``LayerNorm`` / ``RMSNorm``) plus what
that one lacks for sequence parallelism, which Megatron requires for MoE with tensor parallelism > 1 in training:
its parameters carry ``sequence_parallel = config.sequence_parallel``, the attribute Megatron's
``finalize_model_grads`` uses to all-reduce their gradients over the tensor-parallel group. Used by
:func:`~modelopt_moe.plugins.megatron.hf_model.build_megatron_model` (``spec="local"``) and the test models.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["sequence_parallel_norm", "zero_centered_norm", "ZeroCenteredRMSNorm", "GatedOutputNorm"]


def sequence_parallel_norm(*, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
    """Build a torch ``LayerNorm`` / ``RMSNorm`` that supports sequence parallelism (a Megatron norm builder).

    Same module as Megatron's ``WrappedTorchNorm``, plus what that one lacks for sequence parallelism: its
    parameters carry ``sequence_parallel = config.sequence_parallel``, the attribute Megatron's
    ``finalize_model_grads`` (and the test models' ``allreduce_sequence_parallel_grads``) use to all-reduce their
    gradients over the tensor-parallel group (each TP rank sees a different slice of the sequence). Its
    parameters take ``config.params_dtype`` like Transformer Engine's norms, so a bf16 model runs before
    ``Float16Module`` wraps it (on CUDA a float32 norm refuses bf16 activations).

    Args:
        config: The model's TransformerConfig (reads ``normalization`` and ``sequence_parallel``).
        hidden_size: Normalised size.
        eps: Epsilon.

    Returns:
        The norm module.
    """
    if config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    elif config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    else:
        raise ValueError(f"normalization={config.normalization!r}: expected 'LayerNorm' or 'RMSNorm'")
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm that scales by ``1 + weight`` (weight initialised 0), computed in float32 and cast back: Qwen3.5's
    (and Qwen3-Next's) norm, Transformer Engine's ``zero_centered_gamma``; the local spec has none (Megatron's
    ``WrappedTorchNorm`` refuses ``layernorm_zero_centered_gamma``)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, sequence_parallel: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.weight.sequence_parallel = sequence_parallel
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x) * (1 + weight)`` over the last dim, in float32."""
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def zero_centered_norm(*, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
    """Build a :class:`ZeroCenteredRMSNorm` (a Megatron norm builder, like :func:`sequence_parallel_norm`)."""
    return ZeroCenteredRMSNorm(hidden_size, eps, config.params_dtype, config.sequence_parallel)


class GatedOutputNorm(torch.nn.RMSNorm):
    """A plain RMSNorm (``weight * x / rms(x)``) for a Gated DeltaNet's output, whatever
    ``layernorm_zero_centered_gamma`` says: Qwen3.5 scales its other norms by ``1 + weight`` and this one by
    ``weight``. A class, since Megatron's ``build_module`` instantiates classes (it returns a builder function
    itself, uncalled)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel
