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

With pipeline parallelism the teacher is split on the same stages as the student (build both at the same layout):
each stage runs its part of both, the hidden states of both go to the next stage side by side (concatenated on the
hidden axis), and the last stage computes the loss from both models' logits. Megatron's non-interleaved schedule
carries the wider tensor when given :func:`distillation_tensor_shapes_fn` (``adjust_tensor_shapes_fn=``);
``modelopt_moe``'s :func:`~modelopt_moe.plugins.megatron.get_forward_backward_func` and ``train_step`` pass it
themselves. Megatron's interleaved schedule takes no such function, so virtual pipeline stages are refused.

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

__all__ = ["distillation_model", "distillation_tensor_shapes_fn", "distillation_loss_func", "select_trainable",
           "qad_optimizer_config", "get_qad_optimizer", "qad_lr_scheduler"]


def distillation_model(student: torch.nn.Module, teacher: torch.nn.Module, *, recipe: QADRecipe | None = None,
                       **kwargs) -> DistillationModel:
    """:class:`~modelopt_moe.distill.DistillationModel` over Megatron's tensor-parallel group.

    Args:
        student: the (quantized) Megatron model to train, not wrapped yet.
        teacher: the frozen Megatron model of the same architecture and parallel layout (e.g. the bf16 model).
        recipe: takes ``temperature`` and ``lm_loss_weight`` from it (keyword arguments still win).
        **kwargs: ``temperature``, ``kl_weight``, ``lm_loss_weight``, ``top_k`` (None, the default: the exact KL,
            chunked over tokens; an integer: the KL on the teacher's top k tokens, an approximation).

    With pipeline parallelism (teacher and student split on the same stages) it returns a
    :class:`PipelineDistillationModel`.

    Raises:
        ValueError: virtual pipeline stages (Megatron's interleaved schedule cannot carry the teacher's hidden
            states), or at pipeline parallelism the student and teacher hold other stages (pre/post process) or
            another number of layers.
    """
    if recipe is not None:
        kwargs = {"temperature": recipe.temperature, "lm_loss_weight": recipe.lm_loss_weight, **kwargs}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return DistillationModel(student, teacher, tp_group=tp_group, **kwargs)
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp not in (None, 1):
        raise ValueError(f"distillation_model: virtual pipeline stages ({vpp}) are not supported: Megatron's "
                         "interleaved schedule takes no adjust_tensor_shapes_fn to carry the teacher's hidden states; "
                         "use the non-interleaved schedule (virtual pipeline size 1)")
    for attr in ("pre_process", "post_process"):
        if getattr(student, attr, None) != getattr(teacher, attr, None):
            raise ValueError(f"distillation_model: student.{attr}={getattr(student, attr, None)} but teacher."
                             f"{attr}={getattr(teacher, attr, None)}; build both at the same pipeline layout")
    n_s, n_t = len(student.decoder.layers), len(teacher.decoder.layers)
    if n_s != n_t:
        raise ValueError(f"distillation_model: this pipeline stage holds {n_s} student layers but {n_t} teacher "
                         "layers; split both on the same stages")
    return PipelineDistillationModel(student, teacher, tp_group=tp_group, **kwargs)


class PipelineDistillationModel(DistillationModel):
    """:class:`~modelopt_moe.distill.DistillationModel` on one pipeline stage, the teacher split on the same stages.

    ``set_input_tensor`` gives each model its half of the received hidden states; before the last stage the forward
    returns both models' hidden states concatenated on the hidden axis (the teacher's without gradient), on the
    last stage the per-token distillation loss.
    """

    def __init__(self, student: torch.nn.Module, teacher: torch.nn.Module, **kwargs):
        super().__init__(student, teacher, **kwargs)
        self.post_process = bool(student.post_process)
        self.student_hidden = student.config.hidden_size

    def set_input_tensor(self, input_tensor) -> None:
        """Splits the previous stage's hidden states (None on the first stage) between student and teacher."""
        x = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor
        if x is None:
            self.module.set_input_tensor(None)
            self.teacher.set_input_tensor(None)
            return
        self.module.set_input_tensor(x[..., :self.student_hidden])
        teacher_dtype = next(self.teacher.parameters()).dtype  # both travel in the pipeline's dtype
        self.teacher.set_input_tensor(x[..., self.student_hidden:].to(teacher_dtype))

    def forward(self, *args, labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The per-token loss on the last stage; both models' hidden states, side by side, before it."""
        if self.post_process:
            return super().forward(*args, labels=labels, **kwargs)
        hidden = self.module(*args, **kwargs)
        with torch.no_grad():
            teacher_hidden = self.teacher(*args, **kwargs)
        return torch.cat([hidden, teacher_hidden.to(hidden.dtype)], dim=-1)


def _distillation_chunk(model) -> PipelineDistillationModel | None:
    while model is not None and not isinstance(model, PipelineDistillationModel):
        model = getattr(model, "module", None)
    return model


def distillation_tensor_shapes_fn(model):
    """Megatron's ``adjust_tensor_shapes_fn`` for a pipeline-parallel distillation model (its wrappers around it,
    or a list of one chunk): the tensors between stages carry the teacher's hidden states beside the student's.
    None for any other model (pass nothing to the schedule then).

    Pass it to Megatron's non-interleaved schedule::

        forward_backward(..., model=[model], adjust_tensor_shapes_fn=distillation_tensor_shapes_fn(model))
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = [_distillation_chunk(m) for m in chunks]
    if not any(found):
        return None
    teacher_hidden = found[0].teacher.config.hidden_size

    def adjust(recv_tensor_shapes, send_tensor_shapes):
        def widen(shapes):
            return [tuple(s[:-1]) + (s[-1] + teacher_hidden,) if len(s) else s for s in shapes]

        return widen(recv_tensor_shapes), widen(send_tensor_shapes)

    return adjust


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


def get_qad_optimizer(config, model_chunks: list, *, amax_lr_mult: float = 1.0, **kwargs):
    """Megatron's ``get_megatron_optimizer(config, model_chunks, **kwargs)`` without the optimizers that hold no
    parameter. With only the experts training, Megatron (0.19) still builds a dense-parameter optimizer, empty (a
    "stub"), inside its ``ChainedOptimizer``, and then fails to save the optimizer state (``_synchronize_steps`` reads
    the stub's missing ``torch.optim`` optimizer); without it the checkpoint holds the experts' optimizer alone. Every
    rank drops the same ones (the parameter groups are agreed over all ranks).

    ``amax_lr_mult`` (``QADRecipe.amax_lr_mult``): the learned amaxes (parameters named ``*_amax``) get their own
    parameter groups, at that multiple of the learning rate and its floor, without weight decay (Megatron's
    ``config_overrides``, merged into its standard ones)."""
    from megatron.core.optimizer import ChainedOptimizer, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import ParamKey

    if amax_lr_mult != 1.0:
        overrides = kwargs.pop("config_overrides", None) or get_standard_config_overrides(config)
        overrides[ParamKey(name="*_amax")] = {"max_lr": config.lr * amax_lr_mult,
                                              "min_lr": config.min_lr * amax_lr_mult, "wd_mult": 0.0}
        kwargs["config_overrides"] = overrides
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
