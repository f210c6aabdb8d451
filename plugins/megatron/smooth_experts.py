"""Megatron's expert layers for the exact rescaling of the experts' fc2 inputs
(:mod:`modelopt_moe.quantization.smooth_experts`): ``SequentialMLP`` (one ``MLP`` per local expert) and
``TEGroupedMLP`` (grouped ``linear_fc1`` / ``linear_fc2`` with ``weight0..weight{N-1}``: ours, or Transformer
Engine's on GPUs), quantized or not.

A layer is rescalable when its config proves ``h = act(gate) * up`` with ``[gate; up] = fc1(x)`` on every rank:
``gated_linear_unit`` on, no clamp (``activation_func_clamp_value``, gpt-oss's), no offset (``glu_linear_offset``),
no interleaved gate / up rows (``moe_mlp_glu_interleave_size``), Megatron's own elementwise activation (not a
Transformer Engine activation module, ``use_te_activation_func``, whose clamping cannot be read), and not Transformer
Engine's fused op (``use_transformer_engine_op_fuser``). With expert tensor parallelism each rank holds whole fc2
columns and the matching up rows (Megatron splits a gated fc1 as ``[gate shard; up shard]``), so every scale is
local; ranks holding the same experts for other tokens are the expert-data-parallel group.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from torch import nn

from modelopt_moe.quantization.smooth_experts import ExpertMLP

__all__ = ["megatron_expert_mlps", "refusal"]


def refusal(config, fc1_rows: int, fc2_cols: int) -> str | None:
    """Why an expert layer with this ``TransformerConfig`` and local fc1 rows / fc2 columns is not a plain gated
    linear unit that a per-channel power-of-two scale leaves unchanged (naming the setting and its value), or None.
    """
    act = getattr(config.activation_func, "__name__", repr(config.activation_func))
    if not config.gated_linear_unit:
        return (f"gated_linear_unit=False ({act} of fc1's output): a per-channel scale does not pass through a "
                "non-gated activation")
    if getattr(config, "activation_func_clamp_value", None) is not None:
        return (f"activation_func_clamp_value={config.activation_func_clamp_value} ({act}, a clamped GLU as "
                "gpt-oss's): clamping the up half does not commute with scaling it")
    if getattr(config, "glu_linear_offset", 0.0) != 0.0:
        return (f"glu_linear_offset={config.glu_linear_offset} (act(gate) * (up + offset)): scaling the up half "
                "would scale the offset too")
    if getattr(config, "moe_mlp_glu_interleave_size", None) is not None:
        return (f"moe_mlp_glu_interleave_size={config.moe_mlp_glu_interleave_size}: fc1's gate and up rows are "
                "interleaved")
    if getattr(config, "use_te_activation_func", False):
        return "use_te_activation_func=True (a Transformer Engine activation module, possibly clamped)"
    if getattr(config, "use_transformer_engine_op_fuser", False):
        return "use_transformer_engine_op_fuser=True (fc1, the activation and fc2 in one Transformer Engine op)"
    if fc1_rows != 2 * fc2_cols:
        return f"fc1 has {fc1_rows} rows for fc2's {fc2_cols} input channels; a gated fc1 has twice as many"
    return None


def _bias(t) -> torch.Tensor | None:
    return t if isinstance(t, torch.Tensor) and t.numel() else None


def _fc2_input_quantizer(layer: nn.Module):
    """The quantized layer's fc2 input quantizer (``SequentialMLP``: the layer-level one; ``TEGroupedMLP``: its
    grouped ``linear_fc2``'s), None on an unconverted layer."""
    return getattr(getattr(layer, "linear_fc2", None), "input_quantizer", None)


def megatron_expert_mlps(model: nn.Module) -> list[ExpertMLP]:
    """Every ``SequentialMLP`` and ``TEGroupedMLP`` of ``model`` as an :class:`ExpertMLP`, in module order."""
    out = []
    for name, layer in model.named_modules():
        if isinstance(layer, SequentialMLP):
            experts = list(layer.local_experts)
            fc1 = [e.linear_fc1.weight for e in experts]
            fc2 = [e.linear_fc2.weight for e in experts]
            out.append(ExpertMLP(
                name, fc1, [_bias(getattr(e.linear_fc1, "bias", None)) for e in experts], fc2,
                [e.linear_fc2 for e in experts], grouped=False, fc2_input_quantizer=_fc2_input_quantizer(layer),
                refusal=refusal(layer.config, fc1[0].shape[0], fc2[0].shape[1]) if experts else None))
        elif isinstance(layer, TEGroupedMLP):
            lin1, lin2 = layer.linear_fc1, layer.linear_fc2
            n = lin1.num_gemms
            fc1 = [getattr(lin1, f"weight{i}") for i in range(n)]
            fc2 = [getattr(lin2, f"weight{i}") for i in range(n)]
            out.append(ExpertMLP(
                name, fc1, [_bias(getattr(lin1, f"bias{i}", None)) for i in range(n)], fc2, [lin2], grouped=True,
                fc2_input_quantizer=_fc2_input_quantizer(layer),
                refusal=refusal(layer.config, fc1[0].shape[0], fc2[0].shape[1]) if n else None))
    return out
