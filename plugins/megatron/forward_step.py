"""A ``forward_step_func`` for Megatron's schedules (``get_forward_backward_func``) with a plain language-model loss.

Megatron-LM's ``pretrain_gpt.py`` defines its own; this one is for scripts that train with Megatron-Core alone::

    forward_backward = get_forward_backward_func()
    forward_backward(forward_step_func=lm_forward_step, data_iterator=iter(batches), model=[model], ...)

Each batch is a dict of ``tokens``, ``labels``, ``position_ids`` (int64 ``[batch, seq]``), ``attention_mask`` (bool,
True where masked, or None for causal attention alone) and, optionally, ``loss_mask`` (1 where a token counts):
:mod:`.batches` states the contract and checks it. The
same step trains a :func:`~modelopt_moe.plugins.megatron.distillation_model` (its forward returns the per-token
distillation loss where a GPT model returns the per-token LM loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from .batches import check_lm_batch, model_vocab_size

__all__ = ["lm_forward_step", "lm_loss_func"]


def lm_loss_func(loss_mask: torch.Tensor | None, output_tensor: torch.Tensor):
    """Megatron ``loss_func``: the mean per-token loss of one micro-batch over the tokens ``loss_mask`` keeps (all
    without one); the schedule divides it by the number of micro-batches. Returns ``(loss, {"lm loss": loss})``."""
    losses = output_tensor.float()
    if loss_mask is None:
        loss = losses.mean()
    else:
        mask = loss_mask.to(losses.device, torch.float32).reshape(losses.shape)
        loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach().clone()}


def lm_forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """Megatron ``forward_step_func``: the next batch through ``model`` with its labels; returns the per-token loss
    and :func:`lm_loss_func` (with the batch's ``loss_mask``).

    Each batch is checked first (:func:`~modelopt_moe.plugins.megatron.batches.check_lm_batch`: keys, dtypes,
    shapes, and token and label ids against the model's vocabulary).

    Raises:
        BatchError: (a ``ValueError``) the batch breaks the contract; the message names the key, its value and what
            is expected.
    """
    batch = next(data_iterator)
    check_lm_batch(batch, model_vocab_size(model), source="lm_forward_step: the batch")
    device = next(model.parameters()).device
    b = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    output = model(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])
    return output, partial(lm_loss_func, b.get("loss_mask"))
