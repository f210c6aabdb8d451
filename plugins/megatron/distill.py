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
themselves. With virtual pipeline stages (model chunks, Megatron's interleaved schedule, which takes no such function
and sizes its tensors ``[seq, micro_batch_size, hidden_size]``) the teacher's hidden states travel stacked on the batch
axis instead (``[seq, 2 * micro_batch, hidden]``, the student's first): distil chunk by chunk
(``distillation_model(student_chunk, teacher_chunk)``, both built with the same ``vp_stage``) and call the schedule with
:func:`distillation_micro_batch_size` (twice the batches' micro-batch size; the drop-in schedule and ``train_step``
pass it themselves). The teacher must have the student's hidden size there.

The settings of a QAD run are a :class:`~modelopt_moe.distill.QADRecipe` (the default is the measured one):
:func:`select_trainable` freezes what the recipe keeps at the teacher's values, :func:`qad_optimizer_config` and
:func:`qad_lr_scheduler` give Megatron's optimizer config and learning-rate scheduler::

    recipe = QADRecipe()
    mtq.quantize(student, recipe.quant_config(cfg), forward_loop)
    select_trainable(student, recipe)
    model = DDP(Float16Module(distillation_model(student, teacher, recipe=recipe)))
    optimizer = get_qad_optimizer(qad_optimizer_config(recipe, bf16=True), [model])
    scheduler = qad_lr_scheduler(optimizer, recipe, steps)      # scheduler.step(1) after every optimizer step

The teacher's memory: ``QADRecipe(teacher_fp8=...)`` stores its weights in FP8 (dequantized per layer);
:func:`.teacher_logits.write_teacher_logits` runs it once and stores its top-k logits on disk, and
:func:`.teacher_logits.stored_teacher_logits` stands for it afterwards (no teacher forward, no teacher weights)::

    write_teacher_logits(teacher, batches, "teacher_logits", top_k=4096)
    model = distillation_model(student, stored_teacher_logits("teacher_logits", batches=batches), recipe=recipe)

Both work with pipeline parallelism: the teacher, built at the layout it is written at (without virtual pipeline
stages), runs through Megatron's pipeline schedule (forward only) and its last stage writes the store, the same files
as at pipeline parallelism 1; in training (virtual pipeline stages too: one per student chunk) no teacher exists on any
stage, the student runs through the pipeline as a plain model (:class:`PipelineStoredLogitsModel`: Megatron's usual
tensor shapes) and the last stage computes the loss from the stored logits, which find each batch by its tokens: the
forward step passes the batch's tokens on the last stage too (``lm_forward_step`` does). Every rank opens and checks
its replica's store (the directory is visible to every rank), so one that is missing or does not fit stops every stage
before any step.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from modelopt_moe.distill import DistillationModel, QADRecipe, param_group
from modelopt_moe.distill.logit_store import StoredTeacherLogits

from .batches import model_vocab_size
from .pipeline_state import refuse_virtual_pipeline, virtual_pipeline_size

__all__ = ["distillation_model", "distillation_tensor_shapes_fn",
           "distillation_micro_batch_size", "distillation_loss_func", "select_trainable",
           "qad_optimizer_config", "get_qad_optimizer", "qad_lr_scheduler"]


def distillation_model(student: torch.nn.Module, teacher: torch.nn.Module, *, recipe: QADRecipe | None = None,
                       **kwargs) -> DistillationModel:
    """:class:`~modelopt_moe.distill.DistillationModel` over Megatron's tensor-parallel group.

    Args:
        student: the (quantized) Megatron model to train, not wrapped yet.
        teacher: the frozen Megatron model of the same architecture and parallel layout (e.g. the bf16 model).
        recipe: takes ``temperature``, ``lm_loss_weight`` and ``teacher_fp8`` from it (keyword arguments still win).
        **kwargs: ``temperature``, ``kl_weight``, ``lm_loss_weight``, ``top_k`` (None, the default: the exact KL,
            chunked over tokens; an integer: the KL on the teacher's top k tokens, an approximation), ``top_p``
            (a number in (0, 1]: the KL on the teacher's nucleus of that probability, an approximation),
            ``teacher_fp8`` (``"per_tensor"`` / ``"per_channel"``: the teacher's weights stored in FP8).

    ``teacher`` may be :func:`.teacher_logits.stored_teacher_logits` instead of a model: the teacher's top-k logits
    precomputed by :func:`.teacher_logits.write_teacher_logits`. With pipeline parallelism it returns a
    :class:`PipelineStoredLogitsModel` then (the student alone on every stage, the loss on the last).

    With pipeline parallelism (teacher and student split on the same stages) it returns a
    :class:`PipelineDistillationModel`.

    With virtual pipeline stages pass one chunk of each (built with the same ``vp_stage``): the hidden states go between
    stages stacked on the batch axis (see the module docstring).

    Raises:
        ValueError: at pipeline parallelism the student and teacher hold other stages (pre/post process) or another
            number of layers; at virtual pipeline stages a student built without ``vp_stage``, a teacher chunk of
            another ``vp_stage`` or a teacher of another hidden size; stored logits of another vocabulary than the
            student's (on every stage).
    """
    if recipe is not None:
        kwargs = {"temperature": recipe.temperature, "lm_loss_weight": recipe.lm_loss_weight, **kwargs}
        if recipe.teacher_fp8 is not None:
            kwargs.setdefault("teacher_fp8", recipe.teacher_fp8)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if isinstance(teacher, StoredTeacherLogits):
        _check_stored_vocab(student, teacher)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return DistillationModel(student, teacher, tp_group=tp_group, **kwargs)
    if isinstance(teacher, StoredTeacherLogits):
        if virtual_pipeline_size() > 1:
            _check_student_chunk(student)
        return PipelineStoredLogitsModel(student, teacher, tp_group=tp_group, **kwargs)
    if virtual_pipeline_size() > 1:
        _check_virtual_pipeline_chunks(student, teacher)
    for attr in ("pre_process", "post_process"):
        if getattr(student, attr, None) != getattr(teacher, attr, None):
            raise ValueError(f"distillation_model: student.{attr}={getattr(student, attr, None)} but teacher."
                             f"{attr}={getattr(teacher, attr, None)}; build both at the same pipeline layout")
    n_s, n_t = len(student.decoder.layers), len(teacher.decoder.layers)
    if n_s != n_t:
        raise ValueError(f"distillation_model: this pipeline stage holds {n_s} student layers but {n_t} teacher "
                         "layers; split both on the same stages")
    return PipelineDistillationModel(student, teacher, tp_group=tp_group, stack_on_batch=virtual_pipeline_size() > 1,
                                     **kwargs)


def _check_student_chunk(student: torch.nn.Module) -> None:
    """At virtual pipeline stages the student is one model chunk (built with its ``vp_stage``)."""
    if getattr(student, "vp_stage", None) is None:
        refuse_virtual_pipeline("distillation_model of a model built without vp_stage",
                                "the interleaved schedule runs model chunks, each built with its vp_stage",
                                "build the student's and the teacher's chunks with vp_stage=0.. and pass one chunk "
                                "of each")


def _check_virtual_pipeline_chunks(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    """At virtual pipeline stages: one chunk of each, of the same ``vp_stage``, and the hidden sizes the batch-axis
    stacking needs (Megatron's interleaved schedule sends ``[seq, micro_batch, config.hidden_size]``)."""
    _check_student_chunk(student)
    if getattr(teacher, "vp_stage", None) != student.vp_stage:
        raise ValueError(f"distillation_model: student.vp_stage={student.vp_stage} but teacher.vp_stage="
                         f"{getattr(teacher, 'vp_stage', None)}; pass the teacher's chunk of the same virtual "
                         "pipeline stage")
    h_s, h_t = student.config.hidden_size, teacher.config.hidden_size
    if h_s != h_t:
        raise ValueError(f"distillation_model: teacher.config.hidden_size={h_t} but student.config.hidden_size={h_s}; "
                         "at virtual pipeline stages the teacher's hidden states travel stacked on the batch axis of "
                         "the student's [seq, micro_batch, hidden_size] tensors (Megatron's interleaved schedule "
                         "sizes them from the student's config), so the teacher needs the student's hidden size; "
                         "distil a teacher of another width with virtual_pipeline_model_parallel_size=None")


def _logits_vocab(model: torch.nn.Module) -> int:
    """The vocabulary slice of this rank's output logits (Megatron's padded vocabulary / TP)."""
    weight = model.output_layer.weight if getattr(model, "output_layer", None) is not None else None
    if weight is None:  # tied embeddings: the output layer reads the embedding's table
        weight = model.shared_embedding_or_output_weight()
    return weight.shape[0]


def _check_stored_vocab(student: torch.nn.Module, teacher: StoredTeacherLogits) -> None:
    """On every pipeline stage, so that all stop together: the last stage reads the output layer's vocabulary, the
    others the model's (``GPTModel.vocab_size``, the output layer's rows over all TP ranks)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if getattr(student, "post_process", True) or model_vocab_size(student) is None:
        vocab = _logits_vocab(student) * tp
    else:
        vocab = model_vocab_size(student)
    if vocab != teacher.store.vocab_size or teacher.vocab_slice * tp != vocab:
        raise ValueError(f"distillation_model: the student's logits cover a vocabulary of {vocab} ({vocab // tp} "
                         f"on each of {tp} TP ranks) but the stored teacher logits "
                         f"({teacher.store.directory / 'manifest.json'}) field 'vocab_size' is "
                         f"{teacher.store.vocab_size} (read at a slice of {teacher.vocab_slice})")


class PipelineDistillationModel(DistillationModel):
    """:class:`~modelopt_moe.distill.DistillationModel` on one pipeline stage, the teacher split on the same stages.

    ``set_input_tensor`` gives each model its part of the received hidden states; before the last stage the forward
    returns both models' hidden states together (the teacher's without gradient), on the last stage the per-token
    distillation loss. They go side by side on the hidden axis (``[seq, batch, student + teacher hidden]``, for
    Megatron's non-interleaved schedule with :func:`distillation_tensor_shapes_fn`), or with ``stack_on_batch`` (model
    chunks of virtual pipeline stages) stacked on the batch axis (``[seq, 2 * batch, hidden]``, the student's first,
    for the interleaved schedule called with :func:`distillation_micro_batch_size`).
    """

    def __init__(self, student: torch.nn.Module, teacher: torch.nn.Module, *, stack_on_batch: bool = False,
                 **kwargs):
        super().__init__(student, teacher, **kwargs)
        self.post_process = bool(student.post_process)
        self.student_hidden = student.config.hidden_size
        self.stack_on_batch = stack_on_batch
        self.vp_stage = getattr(student, "vp_stage", None)  # the student chunk's virtual pipeline stage

    def set_input_tensor(self, input_tensor) -> None:
        """Splits the previous stage's hidden states (None on the first stage) between student and teacher."""
        x = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor
        if x is None:
            self.module.set_input_tensor(None)
            self.teacher.set_input_tensor(None)
            return
        if self.stack_on_batch:
            batch = x.shape[1] // 2
            student_x, teacher_x = x[:, :batch], x[:, batch:]
        else:
            student_x, teacher_x = x[..., :self.student_hidden], x[..., self.student_hidden:]
        self.module.set_input_tensor(student_x)
        teacher_dtype = next(self.teacher.parameters()).dtype  # both travel in the pipeline's dtype
        self.teacher.set_input_tensor(teacher_x.to(teacher_dtype))

    def forward(self, *args, labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The per-token loss on the last stage; both models' hidden states, together, before it."""
        if self.post_process:
            return super().forward(*args, labels=labels, **kwargs)
        hidden = self.module(*args, **kwargs)
        with torch.no_grad():
            teacher_hidden = self.teacher(*args, **kwargs)
        return torch.cat([hidden, teacher_hidden.to(hidden.dtype)], dim=1 if self.stack_on_batch else -1)


class PipelineStoredLogitsModel(DistillationModel):
    """:class:`~modelopt_moe.distill.DistillationModel` from stored teacher logits on one pipeline stage: no teacher
    runs anywhere, so the student runs through the pipeline as a plain model (the tensors between stages are its
    hidden states, of Megatron's usual shapes: the schedule needs no wider shapes) and the last stage computes the
    loss against the stored logits exactly as at pipeline parallelism 1. With virtual pipeline stages there is one
    per student chunk (sharing the stored logits, which the last stage's last chunk reads).

    The forward step must pass the batch's tokens as the model's first input on the last stage too (the stored logits
    find their batch by the tokens' digest): ``lm_forward_step`` does; a forward step that passes None there (as
    Megatron-LM's ``get_batch`` does off the first stage) is refused by name.
    """

    def __init__(self, student: torch.nn.Module, teacher: StoredTeacherLogits, **kwargs):
        super().__init__(student, teacher, **kwargs)
        self.post_process = bool(student.post_process)
        self.vp_stage = getattr(student, "vp_stage", None)  # the student chunk's virtual pipeline stage

    def forward(self, *args, labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """The per-token loss on the last stage; the student's hidden states before it."""
        if not self.post_process:
            return self.module(*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):
            found = args[0] if args else None
            raise ValueError(f"distillation_model: the last pipeline stage got tokens={found!r} as the model's first "
                             f"input, but the stored teacher logits ({self.teacher.store.directory}) find each batch "
                             "by its tokens: pass the batch's tokens on the last stage too")
        return super().forward(*args, labels=labels, **kwargs)


def _distillation_chunk(model) -> PipelineDistillationModel | None:
    while model is not None and not isinstance(model, PipelineDistillationModel):
        model = getattr(model, "module", None)
    return model


def _distillation_chunks(model) -> list[PipelineDistillationModel]:
    """The pipeline distillation models under ``model`` (one, or a list of chunks, in their wrappers)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [c for c in map(_distillation_chunk, chunks) if c is not None]


def distillation_micro_batch_size(model, micro_batch_size: int) -> int:
    """The ``micro_batch_size`` for Megatron's interleaved schedule: twice the batches' for distillation chunks.

    ``model`` is the list of this stage's model chunks (in their wrappers), whose batches hold ``micro_batch_size``
    sequences: for distillation chunks the answer is twice that (the teacher's hidden states travel stacked on the
    batch axis of the tensors between stages, and the schedule sizes its receive buffers from this argument alone);
    for any other model ``micro_batch_size``::

        forward_backward(..., model=chunks, micro_batch_size=distillation_micro_batch_size(chunks, mbs))
    """
    found = _distillation_chunks(model)
    return 2 * micro_batch_size if found and found[0].stack_on_batch else micro_batch_size


def distillation_tensor_shapes_fn(model):
    """Megatron's ``adjust_tensor_shapes_fn`` for a pipeline-parallel distillation model (its wrappers around it,
    or a list of one chunk): the tensors between stages carry the teacher's hidden states beside the student's.
    None for any other model (pass nothing to the schedule then), and for chunks of virtual pipeline stages
    (Megatron's interleaved schedule takes no such function: see :func:`distillation_micro_batch_size`).

    Pass it to Megatron's non-interleaved schedule::

        forward_backward(..., model=[model], adjust_tensor_shapes_fn=distillation_tensor_shapes_fn(model))
    """
    found = _distillation_chunks(model)
    if not found or found[0].stack_on_batch:  # on the batch axis: distillation_micro_batch_size
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
