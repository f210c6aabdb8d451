"""The teacher's top-k logits precomputed on disk for quantization-aware distillation in Megatron: written once by
:func:`write_teacher_logits` (every data-parallel replica its own store; with pipeline parallelism the teacher runs
through Megatron's schedule, forward only, and the last stage writes), read back by :func:`stored_teacher_logits`,
which stands for the teacher in :func:`.distill.distillation_model` (no teacher forward, no teacher weights).

The store's format, its checks and its all-or-nothing writer are :mod:`modelopt_moe.distill.logit_store`'s; this
module places the stores by data-parallel rank, reads the vocabulary slice of each tensor-parallel rank and runs the
teacher over a pipeline.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import parallel_state

from modelopt_moe.distill.logit_store import (
    LogitStoreError,
    StoredTeacherLogits,
    TeacherLogitsStore,
    TeacherLogitsWriter,
)

from .batches import model_vocab_size
from .pipeline_state import refuse_virtual_pipeline

__all__ = ["write_teacher_logits", "stored_teacher_logits"]


def _store_of_this_rank(directory) -> Path:
    """Each data-parallel replica reads its own batches: its own store under ``directory``."""
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return Path(directory) / f"dp{rank:05d}-of-{size:05d}"


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
