"""Whole Megatron distributed checkpoints of quantized models: save and load, symmetric, safe.

:func:`save_sharded_checkpoint` writes the model chunks' weights and amaxes, the quantization state and, when given,
the optimizer state (Megatron's ``optimizer.sharded_state_dict``), the LR scheduler state, the iteration and any
extra picklable state; :func:`load_sharded_checkpoint` restores exactly what was saved, at any TP / EP layout, into
freshly built (or already quantized) model chunks and the matching optimizer and scheduler, and returns the
iteration and extra state, so a resumed run continues where the saved one stopped.

Saves go to ``<dir>.tmp`` and are moved into place once complete (:mod:`modelopt_moe.checkpoint.files`): an
interrupted save leaves the previous checkpoint intact, and a save replaces only a checkpoint of ours. Loads check
the files and every tensor's global shape against the checkpoint's metadata before anything is loaded
(:func:`check_sharded_checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.transformer.module import MegatronModule
from torch.distributed.checkpoint.api import CheckpointException

from modelopt_moe.checkpoint.errors import CheckpointMismatchError, IncompleteCheckpointError
from modelopt_moe.checkpoint.files import (
    STATE_FILE,
    begin_checkpoint_dir,
    check_checkpoint_dir,
    check_dcp_file_sizes,
    check_save_target,
    commit_checkpoint_dir,
    read_dcp_metadata,
    resolve_checkpoint_dir,
)
from modelopt_moe.checkpoint.sharded import (
    restore_sharded_modelopt_state,
    save_sharded_modelopt_state,
)
from modelopt_moe.checkpoint.state import modelopt_state
from modelopt_moe.quantization.calib.tokens import expert_token_counts
from modelopt_moe.quantization.conversion import (
    is_quantized,
    register_framework_plugins,
    unwrap_model,
    wrapper_names,
)
from modelopt_moe.quantization.utils import rank
from modelopt_moe.quantization.weight_amax import update_weight_amax

from .checkpoint_checks import mismatch_message, raise_agreed, sharded_state_dict_problems, translate_load_error
from .modelopt_checkpoint import is_modelopt_checkpoint, load_modelopt_checkpoint
from .optimizer_checkpoint import check_optimizer_fits, init_torch_adam_state, load_optimizer_state, own_steps
from .pipeline_state import global_state, merge_chunk_states, merge_stage_states, pipeline_size
from .sharded_state_dict import checkpoint_load_metadata

__all__ = ["model_sharded_state_dict", "save_sharded_checkpoint", "load_sharded_checkpoint",
           "check_sharded_checkpoint"]

# The distributed optimizer's checkpoint format that reshards to any TP / EP / DP layout (Megatron-LM's
# --dist-ckpt-optim-fully-reshardable); its default format reshards over data parallel ranks only.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _given(model_list) -> list:
    return list(model_list) if isinstance(model_list, list | tuple) else [model_list]


def _models(model_list) -> list:
    """The model chunks without their wrappers (Megatron's DDP names its child ``module.`` in sharded state dicts;
    Megatron-LM unwraps before checkpointing too). Registers the plugins first: Megatron's wrappers are known to
    ``unwrap_model`` only once this plugin is registered (a fresh process may not have quantized anything yet)."""
    register_framework_plugins()
    return [unwrap_model(m) for m in _given(model_list)]


def _model_keys(models: list) -> list[str]:
    """``model`` (one chunk) or ``model0``, ``model1``, ... (virtual pipeline chunks), as Megatron-LM saves them."""
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def model_sharded_state_dict(model_list, metadata: dict | None = None) -> dict:
    """``{"model": ...}`` (one chunk) or ``{"model0": ..., "model1": ...}`` with each chunk's sharded state dict."""
    models = _models(model_list)
    return {k: m.sharded_state_dict(metadata=dict(metadata) if metadata else None)
            for k, m in zip(_model_keys(models), models, strict=True)}


def save_sharded_checkpoint(model_list, ckpt_dir: str | os.PathLike, *, optimizer=None, opt_param_scheduler=None,
                            iteration: int | None = None, extra_state: dict | None = None) -> None:
    """Saves weights, amaxes, quantization state and (optionally) the training state, all or nothing.

    Before anything is written, rank 0 checks that ``ckpt_dir`` is absent, empty or a checkpoint of ours (and that
    its siblings ``<ckpt_dir>.tmp`` / ``.old`` hold nothing else), and every rank raises when it is not. Every rank
    then writes into ``<ckpt_dir>.tmp`` (Megatron's ``dist_checkpointing.save``, which validates the sharding of
    every tensor); then rank 0 writes the quantization state and the completion marker and moves the directory into
    place, and every rank learns whether that worked. Collectives: three agreements (all-gathers) and Megatron's
    own, the same on every rank.

    Args:
        model_list: a model or a list of model chunks (Megatron DDP / Float16Module wrappers are fine).
        ckpt_dir: the checkpoint directory: absent, empty, or a checkpoint of ours (replaced).
        optimizer: a Megatron optimizer (``get_megatron_optimizer``); its state is saved resharding-ready.
        opt_param_scheduler: an object with ``state_dict()`` / ``load_state_dict()`` (Megatron's
            ``OptimizerParamScheduler``).
        iteration: the training iteration.
        extra_state: more picklable state (e.g. the data loader position), returned by the load.

    Raises:
        FileExistsError: (every rank, nothing written) ``ckpt_dir`` is not empty and is not a checkpoint of ours, e.g.
            a Hugging Face model directory; names it and what it holds.
    """
    models = _models(model_list)
    refusal = None
    if rank() == 0:  # one rank decides (a shared directory), every rank raises
        try:
            check_save_target(ckpt_dir, "save_sharded_checkpoint")
        except OSError as e:  # FileExistsError, or a directory that cannot be listed
            refusal = e
    raise_agreed(refusal, "save_sharded_checkpoint")
    for model in models:  # dynamic weight amaxes as the next forward computes them from the saved weights
        update_weight_amax(model)
    failure = None
    try:  # rank 0 creates the staging directory; the agreement is the barrier before every rank writes into it
        tmp = begin_checkpoint_dir(ckpt_dir)
    except Exception as e:  # noqa: BLE001 - re-raised on this rank, reported to the others
        failure = e
    raise_agreed(failure, "save_sharded_checkpoint")
    state = model_sharded_state_dict(models, OPTIMIZER_METADATA)
    if optimizer is not None:
        init_torch_adam_state(optimizer)  # an optimizer that has not stepped yet (torch's Adam: no state)
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=dict(OPTIMIZER_METADATA))
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state["modelopt_moe_training"] = {"iteration": iteration, "extra_state": extra_state}
    dist_checkpointing.save(state, str(tmp), validate_access_integrity=True)
    states = None
    tokens = [expert_token_counts(m) for m in models]  # every rank: one all_gather_object per chunk (global names)
    if pipeline_size() > 1:  # stages name their layers from 0: the state is saved under global layer names
        states = [{**global_state(modelopt_state(m), m), **({"calibration_tokens": t} if t else {})}
                  for m, t in zip(models, tokens, strict=True)]
        if len(states) > 1:  # virtual pipeline stages: the chunks name other layers; saved as one model, as PP = 1
            states = [merge_chunk_states(states)]
        states = merge_stage_states(states)  # every rank: one all_gather_object over the pipeline group
    failure = None
    try:  # rank 0's writes: every rank must learn of their failure rather than wait for it
        save_sharded_modelopt_state(models, tmp, tokens, states=states)
        commit_checkpoint_dir(tmp, ckpt_dir, iteration)
    except Exception as e:  # noqa: BLE001 - re-raised on this rank, reported to the others
        failure = e
    raise_agreed(failure, "save_sharded_checkpoint")


def check_sharded_checkpoint(model_list, ckpt_dir: str | os.PathLike, *, allow_missing: bool = False) -> None:
    """Checks, without loading or changing anything, that the model chunks fit checkpoint ``ckpt_dir``.

    Every data (``.distcp``) file must be as long as the checkpoint's ``.metadata`` needs, and every tensor of the
    chunks' sharded state dicts (weights, and amaxes of quantized chunks) must be in the checkpoint with its global
    shape (the vocabulary-padded embedding and output layer may differ along axis 0, as Megatron allows).
    :func:`load_sharded_checkpoint` and ``restore_sharded_modelopt_state`` call it; call it yourself before your own
    ``dist_checkpointing.load`` of a model you did not restore with ``restore_sharded_modelopt_state``.

    Call it on every rank: the ranks agree on the outcome (one all-gather) and all raise the same error.

    Args:
        model_list: a model or a list of model chunks (wrappers are fine), quantized or not yet.
        ckpt_dir: the checkpoint directory.
        allow_missing: do not report tensors the checkpoint lacks (a load with your own sharded-state-dict metadata
            may ask for other keys).

    Raises:
        IncompleteCheckpointError: a data file is missing or shorter than needed (names it, its size and the size
            needed); CorruptCheckpointError where ``.metadata`` cannot be read.
        CheckpointMismatchError: tensors do not fit (names each key, the model's and the checkpoint's global shape).
    """
    error = None
    try:
        path = Path(ckpt_dir)
        metadata = read_dcp_metadata(path)
        check_dcp_file_sizes(path, metadata)
        state = model_sharded_state_dict(model_list, checkpoint_load_metadata(path, OPTIMIZER_METADATA))
        problems = sharded_state_dict_problems(state, metadata, allow_missing)
        if problems:
            error = CheckpointMismatchError(mismatch_message(path, problems))
    except (CheckpointMismatchError, IncompleteCheckpointError) as e:
        error = e
    raise_agreed(error, "check_sharded_checkpoint")


def restore_check(models: list, path: Path) -> None:
    """``restore_sharded_modelopt_state``'s check of Megatron model chunks (registered by the plugin): every tensor
    the checkpoint holds has its global shape there, before the restore changes the model. Tensors the checkpoint
    lacks are left to the user's load (its sharded-state-dict metadata may ask for other keys)."""
    if all(isinstance(unwrap_model(m), MegatronModule) for m in models):
        check_sharded_checkpoint(models, path, allow_missing=True)


def _refuse_unrestored(model_list, models: list, path: Path, optimizer) -> None:
    """A chunk that is not quantized yet is restored here only while nothing was built around it: a wrapper or an
    optimizer built before the restore misses what the restore adds (learned amax parameters, their gradients), and
    a QAT run would resume silently different."""
    for i, (given, model) in enumerate(zip(_given(model_list), models, strict=True)):
        if any(is_quantized(m) for m in model.modules()):
            continue
        if given is model and optimizer is None:
            continue
        built = f"wrapped in {' around '.join(wrapper_names(given))}" if given is not model else \
            "given with an optimizer built for it"
        raise CheckpointMismatchError(
            f"load_sharded_checkpoint: {path} holds a quantized model, but model chunk {i} is not quantized and is "
            f"already {built}: restore its quantization first, on the freshly built model, then wrap it and build the "
            f"optimizer: modelopt_moe.checkpoint.restore_sharded_modelopt_state([model], {str(path)!r}). Nothing "
            "was loaded")


def load_sharded_checkpoint(model_list, ckpt_dir: str | os.PathLike, *, optimizer=None, opt_param_scheduler=None,
                            experts=None, strict: bool = True) -> dict:
    """Restores what :func:`save_sharded_checkpoint` saved, at any TP / EP layout.

    First, without changing anything: the checkpoint's files are complete (every data file as long as ``.metadata``
    needs) and every tensor of the model chunks is in the checkpoint with its global shape
    (:func:`check_sharded_checkpoint`). Then the quantization state is restored (converting fresh, unwrapped model
    chunks, possibly built on the meta device; a chunk that is not quantized yet but already wrapped, or given with
    an optimizer, is refused: restore it with ``restore_sharded_modelopt_state`` before wrapping), then weights and
    amaxes load, with every amax's global shape checked against the checkpoint's; then the optimizer and scheduler
    states, when given (the checkpoint must hold them).

    Args:
        model_list: a model or a list of model chunks, in any TP/EP layout: freshly built, or already restored
            with ``restore_sharded_modelopt_state`` (then wrapped, e.g. in Megatron's DDP).
        ckpt_dir: a checkpoint written by :func:`save_sharded_checkpoint` (or by ``dist_checkpointing.save`` plus
            ``save_sharded_modelopt_state``), or by NVIDIA Model Optimizer 0.47 (its ``modelopt_state/`` inside:
            weights and quantization load through :func:`load_modelopt_checkpoint`).
        optimizer: the Megatron optimizer built for ``model_list`` (built after the quantization is restored), of
            the kind that saved the state; its moments, main parameters and step are restored (the distributed
            optimizer over torch's Adam too: :mod:`.optimizer_checkpoint`), so the next step continues bit-exact.
        opt_param_scheduler: the scheduler to restore.
        experts: restore into these expert amax layouts (an ``ExpertsConfig`` or dict) instead of the saved ones.
        strict: passed to ``load_state_dict``.

    Returns:
        ``{"iteration": ..., "extra_state": ...}`` as saved (None where nothing was saved).

    Raises:
        IncompleteCheckpointError: a partial checkpoint (names the directory and what is missing or too short);
            CorruptCheckpointError where a file cannot be read (names it).
        CheckpointMismatchError: a tensor's global shape, the expert count, format or amax shape does not fit (names
            key, expected, found); a model chunk that is not quantized but already wrapped or given with an
            optimizer (names the call that restores it first); an optimizer of another kind (distributed or not)
            than the one whose state the checkpoint holds (names both). Nothing is changed when these are raised.
        KeyError: an optimizer or scheduler was given but the checkpoint has no state for it.
    """
    models = _models(model_list)
    path = resolve_checkpoint_dir(ckpt_dir)
    if is_modelopt_checkpoint(path) and not (path / STATE_FILE).is_file():
        # Saved by NVIDIA Model Optimizer: weights and quantization (its checkpoints carry no state of ours).
        if optimizer is not None or opt_param_scheduler is not None:
            raise KeyError(f"load_sharded_checkpoint: {path} was saved by Model Optimizer; its optimizer and "
                           "scheduler states are not read here (load the model alone)")
        check_dcp_file_sizes(path)
        info = load_modelopt_checkpoint(models, path, experts=experts, strict=strict)
        return {"iteration": None, "extra_state": None, "modelopt": info}
    check_checkpoint_dir(path)
    _refuse_unrestored(model_list, models, path, optimizer)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except CheckpointException as e:
        raise translate_load_error(e, path) from None
    if optimizer is not None and "optimizer" not in common:
        raise KeyError(f"load_sharded_checkpoint: {path} holds no optimizer state (it was saved without optimizer)")
    if optimizer is not None:
        check_optimizer_fits(optimizer, common["optimizer"], path)
    if opt_param_scheduler is not None and "opt_param_scheduler" not in common:
        raise KeyError(f"load_sharded_checkpoint: {path} holds no scheduler state (it was saved without "
                       "opt_param_scheduler)")
    check_sharded_checkpoint(models, path)  # every tensor present with its shape, before the restore converts
    # (with pipeline stages each restores its own layers' entries of the global-named state)
    restore_sharded_modelopt_state(models, path, experts, check=False)
    state = model_sharded_state_dict(models, checkpoint_load_metadata(path, OPTIMIZER_METADATA))
    if optimizer is not None:
        init_torch_adam_state(optimizer)  # a freshly built optimizer has no state to load into
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=dict(OPTIMIZER_METADATA))
        own_steps(optimizer)
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except CheckpointException as e:  # a BaseException; what the checks above cannot see (damaged bytes)
        raise translate_load_error(e, path) from None
    for key, m in zip(_model_keys(models), models, strict=True):
        m.load_state_dict(loaded[key], strict=strict)
    if optimizer is not None:
        load_optimizer_state(optimizer, loaded["optimizer"])
    if opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    return dict(common.get("modelopt_moe_training") or {"iteration": None, "extra_state": None})
