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

The settings of a QAD run are a :class:`~modelopt_moe.distill.QADRecipe` (the default is the measured one):
:func:`select_trainable` freezes what the recipe keeps at the teacher's values, :func:`qad_optimizer_config` and
:func:`qad_lr_scheduler` give Megatron's optimizer config and learning-rate scheduler::

    recipe = QADRecipe()
    mtq.quantize(student, recipe.quant_config(cfg), forward_loop)
    select_trainable(student, recipe)
    model = DDP(Float16Module(distillation_model(student, teacher, recipe=recipe)))
    optimizer = get_qad_optimizer(qad_optimizer_config(recipe, bf16=True), [model])
    scheduler = qad_lr_scheduler(optimizer, recipe, steps)      # scheduler.step(1) after every optimizer step
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from modelopt_moe.distill import DistillationModel, QADRecipe, param_group

__all__ = ["distillation_model", "distillation_loss_func", "select_trainable", "qad_optimizer_config",
           "get_qad_optimizer", "qad_lr_scheduler"]


def distillation_model(student: torch.nn.Module, teacher: torch.nn.Module, *, recipe: QADRecipe | None = None,
                       **kwargs) -> DistillationModel:
    """:class:`~modelopt_moe.distill.DistillationModel` over Megatron's tensor-parallel group.

    Args:
        student: the (quantized) Megatron model to train, not wrapped yet.
        teacher: the frozen Megatron model of the same architecture and parallel layout (e.g. the bf16 model).
        recipe: takes ``temperature`` and ``lm_loss_weight`` from it (keyword arguments still win).
        **kwargs: ``temperature``, ``kl_weight``, ``lm_loss_weight``, ``top_k`` (None, the default: the exact KL,
            chunked over tokens; an integer: the KL on the teacher's top k tokens, an approximation).

    Raises:
        ValueError: pipeline parallelism is on.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("distillation_model: pipeline parallelism must be 1 (the teacher runs beside the student)")
    if recipe is not None:
        kwargs = {"temperature": recipe.temperature, "lm_loss_weight": recipe.lm_loss_weight, **kwargs}
    return DistillationModel(student, teacher, tp_group=parallel_state.get_tensor_model_parallel_group(), **kwargs)


def select_trainable(model: torch.nn.Module, recipe: QADRecipe) -> dict[str, int]:
    """Lets the parameters of the recipe's groups train (``recipe.train``) and freezes the others at their values
    (the teacher's, for a student quantized from it). Call it before wrapping the model (DDP and the optimizer take
    the parameters that require gradients). Every rank makes the same choice (it depends on the names alone).

    Returns:
        ``{group: number of elements that train}`` on this rank, every group of :data:`PARAM_GROUPS` present.
    """
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        group = param_group(name)
        train = group in recipe.trained_groups
        p.requires_grad_(train)
        counts[group] = counts.get(group, 0) + (p.numel() if train else 0)
    return counts


def qad_optimizer_config(recipe: QADRecipe, **kwargs):
    """Megatron's ``OptimizerConfig`` (Adam) with the recipe's learning rates, Adam settings, weight decay and
    gradient clip; ``kwargs`` set the rest (``bf16``, ``params_dtype``, ``use_distributed_optimizer``, ...).
    With Megatron-LM's arguments: ``--lr``, ``--min-lr``, ``--adam-beta1/2``, ``--adam-eps``, ``--weight-decay``,
    ``--clip-grad``."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=recipe.lr, min_lr=recipe.min_lr, adam_beta1=recipe.adam_beta1,
                           adam_beta2=recipe.adam_beta2, adam_eps=recipe.adam_eps, weight_decay=recipe.weight_decay,
                           clip_grad=recipe.clip_grad, **kwargs)


def get_qad_optimizer(config, model_chunks: list, **kwargs):
    """Megatron's ``get_megatron_optimizer(config, model_chunks, **kwargs)`` without the optimizers that hold no
    parameter. With only the experts training, Megatron (0.19) still builds a dense-parameter optimizer, empty (a
    "stub"), inside its ``ChainedOptimizer``, and then fails to save the optimizer state (``_synchronize_steps`` reads
    the stub's missing ``torch.optim`` optimizer); without it the checkpoint holds the experts' optimizer alone. Every
    rank drops the same ones (the parameter groups are agreed over all ranks)."""
    from megatron.core.optimizer import ChainedOptimizer, get_megatron_optimizer

    optimizer = get_megatron_optimizer(config, model_chunks, **kwargs)
    if isinstance(optimizer, ChainedOptimizer):
        kept = [o for o in optimizer.chained_optimizers if not getattr(o, "is_stub_optimizer", False)]
        if kept and len(kept) < len(optimizer.chained_optimizers):
            optimizer = ChainedOptimizer(kept)
    return optimizer


def qad_lr_scheduler(optimizer, recipe: QADRecipe, steps: int):
    """Megatron's ``OptimizerParamScheduler``: linear warmup from 0 over ``recipe.warmup_steps(steps)``, then
    ``recipe.lr_decay_style`` down to ``recipe.min_lr`` at step ``steps`` (Megatron-LM: ``--lr-warmup-fraction``,
    ``--lr-decay-style``, ``--lr-decay-iters``). Call ``scheduler.step(1)`` after every optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    steps = max(1, steps)
    warmup = recipe.warmup_steps(steps)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else recipe.lr, max_lr=recipe.lr, min_lr=recipe.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=steps, lr_decay_style=recipe.lr_decay_style,
        start_wd=recipe.weight_decay, end_wd=recipe.weight_decay, wd_incr_steps=steps, wd_incr_style="constant")


def distillation_loss_func(output_tensor: torch.Tensor):
    """Megatron ``loss_func``: the mean per-token distillation loss of one micro-batch (the schedule divides it by the
    number of micro-batches), and ``{"distillation loss": value}`` for logging."""
    loss = output_tensor.float().mean()
    return loss, {"distillation loss": loss.detach().clone()}
