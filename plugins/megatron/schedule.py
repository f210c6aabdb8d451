"""Megatron's training schedule with fake-quantized weights reused across the micro-batches of one step, and the step
that precision autoswitch counts.

One call of Megatron's ``forward_backward_func`` runs every micro-batch of one optimizer step, and nothing changes
the weights during the call (the optimizer steps after it returns). :func:`get_forward_backward_func` returns
Megatron's function wrapped in :func:`modelopt_moe.quantization.reuse_quantized_weights` for the models it is given,
so each quantized module fake-quantizes its weights once per step instead of once per micro-batch. Outside such a
call every forward re-quantizes (always correct).

The same call is one step of :func:`modelopt_moe.quantization.autoswitch_step`: the returned function counts its
calls, starting at ``first_step`` (pass the iteration a resumed run starts at), and a model with an ``autoswitch``
config samples every ``every``-th of them.
"""

from __future__ import annotations

import contextlib
import functools

from modelopt_moe.quantization.autoswitch import autoswitch_step
from modelopt_moe.quantization.weight_reuse import reuse_quantized_weights as reuse_scope

from .pipeline_state import pipeline_size, virtual_pipeline_size

__all__ = ["get_forward_backward_func"]


def _clear_aux_loss_scale() -> None:
    """Drops Megatron's process-global MoE aux-loss scale before a schedule runs. A backward through the router's aux
    loss outside a schedule (a user's own ``loss.backward()`` in training mode) creates it as a 0-dim tensor, and the
    schedule's ``copy_`` of its ``[1]`` scale into it then fails; each schedule call sets it before it is read."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _refuse_batched_p2p_between_two_stages(model, forward_only: bool) -> None:
    """Refuses training on the interleaved schedule at pipeline size 2 with ``config.batch_p2p_comm``: in its
    steady state Megatron batches a send and a receive of activations with a send and a receive of gradients, all
    between the same two ranks, and the receives pair with the wrong sends (no error: the shapes agree, the losses
    and gradients are wrong). Megatron-LM's arguments refuse this layout; its default at virtual stages,
    ``overlap_p2p_comm=True`` with ``batch_p2p_comm=False``, sends them apart. A forward-only call sends one way
    only. Local state only."""
    from megatron.core.utils import get_model_config

    if forward_only or virtual_pipeline_size() <= 1 or pipeline_size() != 2:
        return
    chunks = model if isinstance(model, (list, tuple)) else [model]
    if get_model_config(chunks[0]).batch_p2p_comm:
        raise ValueError(
            "forward_backward_func: training at virtual pipeline stages with pipeline_model_parallel_size=2 needs "
            "config.batch_p2p_comm=False (found True): Megatron's batched sends and receives between the same two "
            "ranks pair activations with gradients; set config.overlap_p2p_comm=True and config.batch_p2p_comm=False "
            "on the model chunks' config (Megatron-LM's setting), or use a pipeline size above 2")


def teacher_hidden_state_kwargs(model, f_kwargs: dict) -> dict:
    """Megatron's schedule arguments ``f_kwargs`` for ``model``, a pipeline-parallel distillation model's included,
    whose teacher's hidden states travel between stages beside the student's: the wider tensor shapes for the
    non-interleaved schedule (unless the caller gives a function), twice the micro-batch size for the interleaved one
    (stacked on the batch axis); unchanged for any other model."""
    from .distill import distillation_micro_batch_size, distillation_tensor_shapes_fn

    if f_kwargs.get("adjust_tensor_shapes_fn") is None:
        adjust = distillation_tensor_shapes_fn(model)
        if adjust is not None:
            f_kwargs = {**f_kwargs, "adjust_tensor_shapes_fn": adjust}
    if "micro_batch_size" in f_kwargs:
        f_kwargs = {**f_kwargs, "micro_batch_size": distillation_micro_batch_size(model, f_kwargs["micro_batch_size"])}
    return f_kwargs


def get_forward_backward_func(*args, reuse_quantized_weights: bool = True, first_step: int = 0, **kwargs):
    """Drop-in for ``megatron.core.pipeline_parallel.get_forward_backward_func`` (same arguments, same returned
    function) whose calls reuse each module's fake-quantized weights across the call's micro-batches and each count as
    one autoswitch step. For a pipeline-parallel distillation model it passes
    :func:`~modelopt_moe.plugins.megatron.distill.distillation_tensor_shapes_fn` (unless the caller gives one), and at
    virtual pipeline stages twice the given ``micro_batch_size`` (the batches' size: the teacher's hidden states travel
    stacked on the batch axis, :func:`~modelopt_moe.plugins.megatron.distill.distillation_micro_batch_size`).

    Args:
        *args: Megatron's positional arguments.
        **kwargs: Megatron's keyword arguments.
        reuse_quantized_weights: open the weight-reuse scope around each call.
        first_step: the autoswitch step of the first call (each later call is the next step).

    With virtual pipeline stages (``virtual_pipeline_model_parallel_size`` > 1) Megatron returns its interleaved
    schedule: pass ``model`` as the list of this stage's chunks and ``data_iterator`` as one iterator per chunk, as
    Megatron's schedule takes them.

    Raises:
        ValueError: (from the returned function) training at virtual pipeline stages on 2 pipeline
            stages with ``config.batch_p2p_comm=True`` (Megatron pairs activations with gradients there: set
            ``overlap_p2p_comm=True`` and ``batch_p2p_comm=False``, as Megatron-LM does).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_get_forward_backward_func

    schedule = megatron_get_forward_backward_func(*args, **kwargs)
    step = first_step

    @functools.wraps(schedule)
    def forward_backward(*f_args, **f_kwargs):
        nonlocal step
        model = f_kwargs.get("model")
        if model is None:
            raise TypeError("forward_backward_func: pass model=... by keyword (Megatron's schedules take it so)")
        f_kwargs = teacher_hidden_state_kwargs(model, f_kwargs)
        _refuse_batched_p2p_between_two_stages(model, f_kwargs.get("forward_only", False))
        reuse = reuse_scope(model) if reuse_quantized_weights else contextlib.nullcontext()
        _clear_aux_loss_scale()
        with reuse, autoswitch_step(model, step):
            result = schedule(*f_args, **f_kwargs)
        step += 1
        return result

    return forward_backward
