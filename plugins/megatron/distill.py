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
:func:`write_teacher_logits` runs it once and stores its top-k logits on disk, and :func:`stored_teacher_logits` stands
for it afterwards (no teacher forward, no teacher weights)::

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

from pathlib import Path

import torch
from megatron.core import parallel_state

from modelopt_moe.distill import DistillationModel, QADRecipe, param_group
from modelopt_moe.distill.logit_store import (
    LogitStoreError,
    StoredTeacherLogits,
    TeacherLogitsStore,
    TeacherLogitsWriter,
)

from .batches import model_vocab_size
from .pipeline_state import refuse_virtual_pipeline, virtual_pipeline_size

__all__ = ["distillation_model", "write_teacher_logits", "stored_teacher_logits", "distillation_tensor_shapes_fn",
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
            chunked over tokens; an integer: the KL on the teacher's top k tokens, an approximation),
            ``teacher_fp8`` (``"per_tensor"`` / ``"per_channel"``: the teacher's weights stored in FP8).

    ``teacher`` may be :func:`stored_teacher_logits` instead of a model: the teacher's top-k logits precomputed by
    :func:`write_teacher_logits`. With pipeline parallelism it returns a :class:`PipelineStoredLogitsModel` then (the
    student alone on every stage, the loss on the last).

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


def _store_of_this_rank(directory) -> Path:
    """Each data-parallel replica reads its own batches: its own store under ``directory``."""
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return Path(directory) / f"dp{rank:05d}-of-{size:05d}"


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


def write_teacher_logits(teacher: torch.nn.Module, batches, directory, *, top_k: int,
                         values_dtype: torch.dtype = torch.bfloat16, batches_per_shard: int = 64) -> Path:
    """Runs the teacher once over ``batches`` and writes its top-``top_k`` logits per token to disk.

    Every rank calls it with its own batches (the ones it will train on, in that order): the teacher's forward and
    the gather of the top k over the tensor-parallel group run on every rank; the first TP rank of each
    data-parallel replica writes that replica's store, ``directory/dp<rank>-of-<size>``, all or nothing; all ranks
    then meet in one barrier.

    With pipeline parallelism the teacher (this stage's part, built at the training layout) runs through Megatron's
    pipeline schedule, forward only (one call over all ``batches``, as micro-batches of the first batch's shape: all
    must have it); the last stage gathers the top k and writes the store, the same files as at pipeline parallelism 1;
    the other stages write nothing. Every rank of a pipeline gets the same batches (its data-parallel replica's).
    An error on any rank before the stores are committed (a batch of another shape, a ``top_k`` above the
    vocabulary) stops every rank with nothing written. Virtual pipeline stages are refused.

    Args:
        teacher: the Megatron GPT model (its forward ``teacher(tokens, position_ids, attention_mask)`` returns
            logits; with pipeline parallelism, this stage's part).
        batches: dicts of ``tokens``, ``position_ids``, ``attention_mask`` (the training batches' contract).
        directory: where the stores go (absent, empty, or stores of ours, which are replaced).
        top_k: logits kept per token.
        values_dtype: the stored values' dtype (the teacher logits' dtype stores them exactly).
        batches_per_shard: batches in one shard file.

    Returns:
        This rank's store directory (written by the last stage's first TP rank of its data-parallel replica).

    Raises:
        LogitStoreError: (a ``ValueError``) ``directory`` holds something else, a bad ``top_k``, no batches; with
            pipeline parallelism (on every rank, before the teacher runs) a batch of another shape than the first or
            with token ids outside the vocabulary, and an error on another rank.
        ValueError: virtual pipeline stages.
    """
    import torch.distributed as dist

    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if pipelined:
        refuse_virtual_pipeline("write_teacher_logits", "the teacher runs through the non-interleaved pipeline "
                                "schedule, one model per stage", "write the store with "
                                "virtual_pipeline_model_parallel_size=None (the stores do not depend on the layout)")
        batches = list(batches)
        _check_pipeline_batches(batches, directory, model_vocab_size(teacher))
    path = _store_of_this_rank(directory)
    last_stage = parallel_state.is_pipeline_last_stage()
    writer = TeacherLogitsWriter(
        path, top_k=top_k, values_dtype=values_dtype, tp_group=parallel_state.get_tensor_model_parallel_group(),
        batches_per_shard=batches_per_shard,
        write=last_stage and parallel_state.get_tensor_model_parallel_rank() == 0,
        extra={"data_parallel_rank": parallel_state.get_data_parallel_rank(),
               "data_parallel_size": parallel_state.get_data_parallel_world_size()})
    failed, was_training = None, teacher.training
    device = next(iter([*teacher.parameters(), *teacher.buffers()])).device  # an FP8 teacher keeps buffers
    try:
        teacher.eval()
        with torch.no_grad():
            if pipelined:
                failed = _pipelined_teacher_logits(teacher, batches, writer.add, device)
            else:
                for b in batches:
                    tokens = b["tokens"].to(device)
                    mask = b.get("attention_mask")
                    logits = teacher(tokens, b["position_ids"].to(device), None if mask is None else mask.to(device))
                    writer.add(tokens, logits)
    except Exception as e:
        failed = e
    except BaseException:  # an interrupt: leave at once, nothing written
        writer.abort()
        raise
    finally:
        teacher.train(was_training)
    if pipelined:  # the other stages learn of a failure on the last one (or it of theirs): all stop, nothing written
        failed = _agree_on_failure(failed, device, "before any store was committed")
    if failed is None and last_stage:
        try:
            writer.commit()
        except Exception as e:
            failed = e
    if failed is not None:
        writer.abort()
    if dist.is_initialized():
        dist.barrier()  # every rank, even one that failed: the others' stores are complete before anyone reads
    if failed is not None:
        raise failed
    return path


def _check_pipeline_batches(batches: list, directory, vocab_size: int | None) -> None:
    """The pipeline schedule's micro-batches have one shape (the first batch's) and token ids the embedding takes:
    checked on every rank before the teacher runs, so that no stage fails in its forward while another waits for a
    tensor it never sends."""
    if not batches:
        raise LogitStoreError(f"write_teacher_logits: {directory}: no batches; nothing to write")
    shape = None
    for i, b in enumerate(batches):
        tokens = b.get("tokens") if isinstance(b, dict) else None
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or "position_ids" not in b:
            raise LogitStoreError(f"write_teacher_logits: {directory}: batch {i} is not a dict with 'tokens' "
                                  "[batch, seq] and 'position_ids' (the training batches' contract)")
        shape = shape or tuple(tokens.shape)
        if tuple(tokens.shape) != shape:
            raise LogitStoreError(f"write_teacher_logits: {directory}: batch {i}'s tokens are "
                                  f"{list(tokens.shape)}, batch 0's {list(shape)}; with pipeline parallelism every "
                                  "batch is one micro-batch of the schedule, all of one shape")
        if vocab_size is not None and tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
            raise LogitStoreError(f"write_teacher_logits: {directory}: batch {i}'s tokens hold ids in "
                                  f"[{int(tokens.min())}, {int(tokens.max())}]; the teacher's vocabulary is "
                                  f"[0, {vocab_size})")


def _pipelined_teacher_logits(teacher: torch.nn.Module, batches: list, add, device) -> Exception | None:
    """The teacher over ``batches`` through Megatron's non-interleaved schedule, forward only (the activations go
    between the stages as in training); on the last stage ``add(tokens, logits)`` per batch, in order.

    Returns:
        The first error ``add`` raised on this rank (None: none). Later batches still go through the pipeline (the
        other stages send them whatever happens here), without ``add``.
    """
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    from modelopt_moe.plugins.megatron_cpu import megatron_training_shims

    errors: list[Exception] = []

    def record(tokens, logits):
        if not errors:
            try:
                add(tokens, logits)
            except Exception as e:
                errors.append(e)
        return logits.new_zeros(()), {}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        tokens = b["tokens"].to(device)
        mask = b.get("attention_mask")
        out = model(tokens, b["position_ids"].to(device), None if mask is None else mask.to(device))
        return out, partial(record, tokens)

    batch, seq = batches[0]["tokens"].shape
    with megatron_training_shims():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[teacher],
            num_microbatches=len(batches), seq_length=seq, micro_batch_size=batch, forward_only=True)
    return errors[0] if errors else None


def _agree_on_failure(failed: Exception | None, device, when: str) -> Exception | None:
    """Every rank's own error, or one that names the failing ranks where another rank failed (one all-reduce over
    all ranks, made by every rank)."""
    import torch.distributed as dist

    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = failed is not None
    dist.all_reduce(flags)
    if failed is not None or not flags.any():
        return failed
    ranks = [int(r) for r in flags.nonzero().flatten()]
    return LogitStoreError(f"write_teacher_logits: rank(s) {ranks} failed {when} (their error is raised there); "
                           "nothing was written")


def stored_teacher_logits(directory, *, batches=None, top_k: int | None = None,
                          start_batch: int = 0) -> StoredTeacherLogits:
    """The teacher's precomputed logits (:func:`write_teacher_logits`) for ``distillation_model(student, teacher)``,
    read by this rank from its data-parallel replica's store, at its tensor-parallel slice of the vocabulary.

    Every rank calls it (local files, no collective): with pipeline parallelism every stage opens and checks the store,
    so that a missing or mismatched one stops all stages before any step; only the last stage reads its shards.

    Args:
        directory: what ``write_teacher_logits`` was given.
        batches: the batches this rank will train on, in order: checked against the store now, before any step
            (None: each batch is checked when it comes).
        top_k: the ``k`` the run expects (None: the store's).
        start_batch: the batch of the store the first micro-batch reads (a resumed run: the micro-batches done).

    Raises:
        LogitStoreError: (a ``ValueError``) the store is missing, damaged, or does not fit (tokens, their order,
            ``k``): the message names the file and the field.
    """
    store = TeacherLogitsStore(_store_of_this_rank(directory), top_k=top_k, batches=batches)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if store.vocab_size % tp:
        raise ValueError(f"stored_teacher_logits: {store.directory / 'manifest.json'} field 'vocab_size' "
                         f"{store.vocab_size} does not split over {tp} tensor-parallel ranks")
    local = store.vocab_size // tp
    return StoredTeacherLogits(store, vocab_first=rank * local, vocab_slice=local, start_batch=start_batch)


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
