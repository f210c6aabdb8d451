"""Megatron's training schedule with fake-quantized weights reused across the micro-batches of one step.

One call of Megatron's ``forward_backward_func`` runs every micro-batch of one optimizer step, and nothing changes
the weights during the call (the optimizer steps after it returns). :func:`get_forward_backward_func` returns
Megatron's function wrapped in :func:`modelopt_moe.quantization.reuse_quantized_weights` for the models it is given,
so each quantized module fake-quantizes its weights once per step instead of once per micro-batch. Outside such a
call every forward re-quantizes (always correct).
"""

from __future__ import annotations

import functools

from modelopt_moe.quantization.weight_reuse import reuse_quantized_weights

__all__ = ["get_forward_backward_func"]


def get_forward_backward_func(*args, **kwargs):
    """Drop-in for ``megatron.core.pipeline_parallel.get_forward_backward_func`` (same arguments, same returned
    function) whose calls reuse each module's fake-quantized weights across the call's micro-batches."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_get_forward_backward_func

    schedule = megatron_get_forward_backward_func(*args, **kwargs)

    @functools.wraps(schedule)
    def forward_backward(*f_args, **f_kwargs):
        model = f_kwargs.get("model")
        if model is None:
            raise TypeError("forward_backward_func: pass model=... by keyword (Megatron's schedules take it so)")
        with reuse_quantized_weights(model):
            return schedule(*f_args, **f_kwargs)

    return forward_backward
