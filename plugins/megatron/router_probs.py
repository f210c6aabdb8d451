"""Megatron's expert layers, quantized, apply the router probability where serving engines apply it: after the down
projection's input quantization (:mod:`modelopt_moe.quantization.nn.row_scale`).

Megatron-Core 0.19's ``SequentialMLP`` and ``TEGroupedMLP`` multiply ``permuted_probs`` into the activation inside
their forward (``bias_act_func(..., permuted_probs)``: fused SwiGLU / GeGLU / squared-ReLU kernels, TE activation
modules or plain torch, optionally under activation recompute), then call ``linear_fc2``. The expert layer's forward is
the one place that holds the probabilities and is ours to wrap: the quantized layer calls Megatron's forward with
probabilities of one (every activation path then returns ``act`` unchanged) and hands the real ones to its
``linear_fc2`` for that call; the quantized ``linear_fc2`` multiplies them into its fake-quantized input (one launch
with the fake quant on the kernel path) and adds a returned bias as ``out + prob * bias``. Megatron's own padding,
offloading, recompute and bias code run unchanged.

Not engaged when the down projection's input quantizer is off (Megatron's order then computes the same numbers), nor
with ``moe_apply_probs_on_input=True``: Megatron then multiplies the probability into the expert's *input* (top-1
only) and passes ones itself; QAT trains that model as Megatron defines it (``linear_fc1``'s input quantizer sees
``prob * x``, the operand of that model's GEMM), and Hugging Face export refuses it, since serving engines do not
run it.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP

from modelopt_moe.quantization.conversion import QuantModuleMixin
from modelopt_moe.quantization.nn.experts import split_sizes
from modelopt_moe.quantization.nn.row_scale import down_proj_row_scale

__all__ = ["probs_after_down_proj", "sequential_experts_forward", "QuantTEGroupedMLP"]


def probs_after_down_proj(layer: torch.nn.Module, down_proj: torch.nn.Module) -> bool:
    """Whether ``layer`` (an expert layer) hands its router probabilities to ``down_proj`` (what holds its
    ``linear_fc2`` quantizers): its input quantizer is enabled and Megatron applies the probabilities after the
    activation."""
    q = getattr(down_proj, "input_quantizer", None)
    return q is not None and q.is_enabled and not layer.config.moe_apply_probs_on_input


def sequential_experts_forward(layer, forward, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                               *args, **kwargs):
    """``SequentialMLP``'s forward (``forward``, Megatron's) with each expert's ``linear_fc2`` given its tokens'
    probabilities (Megatron splits the tokens by ``tokens_per_expert`` the same way)."""
    probs = torch.split(permuted_probs, split_sizes(tokens_per_expert))
    with contextlib.ExitStack() as scopes:
        for expert, p in zip(layer.local_experts, probs, strict=True):
            scopes.enter_context(down_proj_row_scale(expert.linear_fc2, p))
        return forward(permuted_local_hidden_states, tokens_per_expert, torch.ones_like(permuted_probs), *args,
                       **kwargs)


class QuantTEGroupedMLP(QuantModuleMixin):
    """Megatron's ``TEGroupedMLP`` (its grouped linears are quantized on their own, :mod:`.modules` /
    :mod:`.te_experts`): the router probabilities go to ``linear_fc2`` (see the module docstring). Holds no
    quantizers."""

    def _setup_quantizers(self, config) -> None:
        if getattr(self, "_with_fused_impl", False):
            raise NotImplementedError(
                f"{type(self).__name__}: use_transformer_engine_op_fuser=True runs linear_fc1, the activation and "
                "linear_fc2 as one Transformer Engine op, past the quantized linears (nothing would be fake-"
                "quantized); build the model with use_transformer_engine_op_fuser=False for QAT with modelopt_moe")

    def calibrate_weights(self) -> None:
        """Nothing: the grouped linears calibrate their own weights."""

    def weights_to_calibrate(self):
        """None: the grouped linears hold their own weights."""
        return []

    def fold_weight(self) -> None:
        """Nothing: the grouped linears fold their own weights."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs):
        """Megatron's forward, with the router probabilities applied by the quantized ``linear_fc2``."""
        if not probs_after_down_proj(self, self.linear_fc2):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)
        with down_proj_row_scale(self.linear_fc2, permuted_probs):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, torch.ones_like(permuted_probs),
                                   *args, **kwargs)


CLASSES = {TEGroupedMLP: QuantTEGroupedMLP}
