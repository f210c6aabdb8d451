"""Whole Megatron distributed checkpoints of quantized models: save and load, symmetric, safe.

:func:`save_sharded_checkpoint` writes the model chunks' weights and amaxes, the quantization state and, when given,
the optimizer state (Megatron's ``optimizer.sharded_state_dict``), the LR scheduler state, the iteration and any
extra picklable state; :func:`load_sharded_checkpoint` restores exactly what was saved, at any TP / EP layout, into
freshly built (or already quantized) model chunks and the matching optimizer and scheduler, and returns the
iteration and extra state, so a resumed run continues where the saved one stopped.

Saves go to ``<dir>.tmp`` and are moved into place once complete (:mod:`modelopt_moe.checkpoint.files`): an
interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from megatron.core import dist_checkpointing

from modelopt_moe.checkpoint.files import (
    STATE_FILE,
    begin_checkpoint_dir,
    check_checkpoint_dir,
    commit_checkpoint_dir,
    resolve_checkpoint_dir,
)
from modelopt_moe.checkpoint.sharded import restore_sharded_modelopt_state, save_sharded_modelopt_state
from modelopt_moe.quantization.conversion import unwrap_model
from modelopt_moe.quantization.weight_amax import update_weight_amax

from .modelopt_checkpoint import is_modelopt_checkpoint, load_modelopt_checkpoint
from .sharded_state_dict import checkpoint_load_metadata

__all__ = ["model_sharded_state_dict", "save_sharded_checkpoint", "load_sharded_checkpoint"]

# The distributed optimizer's checkpoint format that reshards to any TP / EP / DP layout (Megatron-LM's
# --dist-ckpt-optim-fully-reshardable); its default format reshards over data parallel ranks only.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _models(model_list) -> list:
    """The model chunks without their wrappers (Megatron's DDP names its child ``module.`` in sharded state dicts;
    Megatron-LM unwraps before checkpointing too)."""
    return [unwrap_model(m) for m in (model_list if isinstance(model_list, list | tuple) else [model_list])]


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

    Every rank writes into ``<ckpt_dir>.tmp`` (Megatron's ``dist_checkpointing.save``, which validates the sharding
    of every tensor); then rank 0 writes the quantization state and the completion marker and moves the directory
    into place. Collectives: two barriers and Megatron's own, the same on every rank.

    Args:
        model_list: a model or a list of model chunks (Megatron DDP / Float16Module wrappers are fine).
        ckpt_dir: the checkpoint directory (replaced if it exists).
        optimizer: a Megatron optimizer (``get_megatron_optimizer``); its state is saved resharding-ready.
        opt_param_scheduler: an object with ``state_dict()`` / ``load_state_dict()`` (Megatron's
            ``OptimizerParamScheduler``).
        iteration: the training iteration.
        extra_state: more picklable state (e.g. the data loader position), returned by the load.
    """
    models = _models(model_list)
    for model in models:  # dynamic weight amaxes as the next forward computes them from the saved weights
        update_weight_amax(model)
    tmp = begin_checkpoint_dir(ckpt_dir)
    dist.barrier()
    state = model_sharded_state_dict(models, OPTIMIZER_METADATA)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=dict(OPTIMIZER_METADATA))
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state["modelopt_moe_training"] = {"iteration": iteration, "extra_state": extra_state}
    dist_checkpointing.save(state, str(tmp), validate_access_integrity=True)
    save_sharded_modelopt_state(models, tmp)
    commit_checkpoint_dir(tmp, ckpt_dir)
    dist.barrier()


def load_sharded_checkpoint(model_list, ckpt_dir: str | os.PathLike, *, optimizer=None, opt_param_scheduler=None,
                            experts=None, strict: bool = True) -> dict:
    """Restores what :func:`save_sharded_checkpoint` saved, at any TP / EP layout.

    The quantization state is restored first (converting fresh model chunks, possibly built on the meta device),
    then weights and amaxes load, with every amax's global shape checked against the checkpoint's; then the
    optimizer and scheduler states, when given (the checkpoint must hold them).

    Args:
        model_list: a model or a list of model chunks, in any TP/EP layout.
        ckpt_dir: a checkpoint written by :func:`save_sharded_checkpoint` (or by ``dist_checkpointing.save`` plus
            ``save_sharded_modelopt_state``), or by NVIDIA Model Optimizer 0.47 (its ``modelopt_state/`` inside:
            weights and quantization load through :func:`load_modelopt_checkpoint`).
        optimizer: the Megatron optimizer built for ``model_list`` (built after the quantization is restored).
        opt_param_scheduler: the scheduler to restore.
        experts: restore into these expert amax layouts (an ``ExpertsConfig`` or dict) instead of the saved ones.
        strict: passed to ``load_state_dict``.

    Returns:
        ``{"iteration": ..., "extra_state": ...}`` as saved (None where nothing was saved).

    Raises:
        IncompleteCheckpointError: a partial checkpoint (names the directory and what is missing).
        CheckpointMismatchError: expert count, format or amax shape does not fit (names key, expected, found).
        KeyError: an optimizer or scheduler was given but the checkpoint has no state for it.
    """
    models = _models(model_list)
    path = resolve_checkpoint_dir(ckpt_dir)
    if is_modelopt_checkpoint(path) and not (path / STATE_FILE).is_file():
        # Saved by NVIDIA Model Optimizer: weights and quantization (its checkpoints carry no state of ours).
        if optimizer is not None or opt_param_scheduler is not None:
            raise KeyError(f"load_sharded_checkpoint: {path} was saved by Model Optimizer; its optimizer and "
                           "scheduler states are not read here (load the model alone)")
        info = load_modelopt_checkpoint(models, path, experts=experts, strict=strict)
        return {"iteration": None, "extra_state": None, "modelopt": info}
    check_checkpoint_dir(path)
    restore_sharded_modelopt_state(models, path, experts)
    common = dist_checkpointing.load_common_state_dict(str(path))
    if optimizer is not None and "optimizer" not in common:
        raise KeyError(f"load_sharded_checkpoint: {path} holds no optimizer state (it was saved without optimizer)")
    if opt_param_scheduler is not None and "opt_param_scheduler" not in common:
        raise KeyError(f"load_sharded_checkpoint: {path} holds no scheduler state (it was saved without "
                       "opt_param_scheduler)")
    state = model_sharded_state_dict(models, checkpoint_load_metadata(path, OPTIMIZER_METADATA))
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=dict(OPTIMIZER_METADATA))
    loaded = dist_checkpointing.load(state, str(path))
    for key, m in zip(_model_keys(models), models, strict=True):
        m.load_state_dict(loaded[key], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    return dict(common.get("modelopt_moe_training") or {"iteration": None, "extra_state": None})
