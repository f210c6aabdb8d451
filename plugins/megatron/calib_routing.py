"""Megatron's router widener for ``moe_calib_experts_ratio`` (:mod:`modelopt_moe.quantization.calib.routing`).

While calibrating, every ``MoELayer`` first runs a forward of its own whose router picks
``max(top_k, round(ratio * num_experts))`` experts per token (``router.topk`` and the config's ``moe_router_topk``,
which the token dispatchers size their buffers by, are set for that forward and put back), its output dropped; then
Megatron's forward with the model's own top-k runs with the layer's quantizers' calibration paused, and its output
is what the next layers see. Both are hooks that return None. Every expert kind behind ``MoELayer`` takes the same
path (``SequentialMLP`` and the grouped experts are tested on CPU with the allgather dispatcher).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch import nn

from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

__all__ = ["widen_moe_routing"]


def _calibrating(layer: nn.Module) -> list[TensorQuantizer]:
    return [m for m in layer.modules() if isinstance(m, TensorQuantizer) and m.switches()["if_calib"]]


def _widened_pass(k: int, paused: list):
    def hook(layer, args, kwargs):
        router, config = layer.router, layer.config
        topk, config_topk = router.topk, config.moe_router_topk
        router.topk, config.moe_router_topk = k, k
        try:
            with torch.no_grad():
                type(layer).forward(layer, *args, **kwargs)
        finally:
            router.topk, config.moe_router_topk = topk, config_topk
        paused[:] = _calibrating(layer)
        for q in paused:
            q.set_switches(if_calib=False)  # set_switches, not disable_calib: the pass's progress stays

    return hook


def _resume(paused: list):
    def hook(layer, args, output) -> None:
        for q in paused:
            q.set_switches(if_calib=True)
        paused.clear()

    return hook


@contextlib.contextmanager
def widen_moe_routing(model: nn.Module, ratio: float):
    """Inside: every ``MoELayer`` of ``model`` calibrates on tokens routed to ``max(top_k, round(ratio *
    num_experts))`` experts (see the module docstring); yields how many layers that widens."""
    handles = []
    try:
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                k = max(layer.router.topk, round(layer.config.num_moe_experts * ratio))
                if k > layer.router.topk:
                    paused: list[TensorQuantizer] = []  # the layer's quantizers paused between its two hooks
                    handles.append(layer.register_forward_pre_hook(_widened_pass(k, paused), with_kwargs=True))
                    handles.append(layer.register_forward_hook(_resume(paused), always_call=True))
        yield len(handles) // 2
    finally:
        for handle in handles:
            handle.remove()
