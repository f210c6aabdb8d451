"""Quantization-aware distillation in Megatron's training loop.

``distillation_model(student, teacher)`` is :class:`modelopt_moe.distill.DistillationModel` with Megatron's
tensor-parallel group (the logits of Megatron's output layer are split over the vocabulary there). Wrap it like any
Megatron model (``Float16Module``, then ``DistributedDataParallel``: both reach the student only) and keep the usual
forward step: ``model(tokens, position_ids, attention_mask, labels=labels)`` returns the per-token loss, and
:func:`distillation_loss_func` (or any ``loss_func`` that averages it) goes to ``get_forward_backward_func``::

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, distillation_loss_func

Pipeline parallelism must be 1 (the teacher runs whole beside each student stage only when both are one stage).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from modelopt_moe.distill import DistillationModel

__all__ = ["distillation_model", "distillation_loss_func"]


def distillation_model(student: torch.nn.Module, teacher: torch.nn.Module, **kwargs) -> DistillationModel:
    """:class:`~modelopt_moe.distill.DistillationModel` over Megatron's tensor-parallel group.

    Args:
        student: the (quantized) Megatron model to train, not wrapped yet.
        teacher: the frozen Megatron model of the same architecture and parallel layout (e.g. the bf16 model).
        **kwargs: ``temperature``, ``kl_weight``, ``lm_loss_weight``.

    Raises:
        ValueError: pipeline parallelism is on.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("distillation_model: pipeline parallelism must be 1 (the teacher runs beside the student)")
    return DistillationModel(student, teacher, tp_group=parallel_state.get_tensor_model_parallel_group(), **kwargs)


def distillation_loss_func(output_tensor: torch.Tensor):
    """Megatron ``loss_func``: the mean per-token distillation loss of one micro-batch (the schedule divides it by the
    number of micro-batches), and ``{"distillation loss": value}`` for logging."""
    loss = output_tensor.float().mean()
    return loss, {"distillation loss": loss.detach().clone()}
