"""Quantization state beside a distributed (``torch.distributed.checkpoint`` / Megatron ``torch_dist``) checkpoint.

Flow (Megatron; ``modelopt_moe.plugins.megatron`` wraps it as ``save_sharded_checkpoint`` /
``load_sharded_checkpoint``, with the optimizer state)::

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)     # every rank
    save_sharded_modelopt_state([model], ckpt_dir)                     # every rank; rank 0 writes
    ...
    model = build_model()                                              # fresh, unquantized, maybe on "meta"
    restore_sharded_modelopt_state([model], ckpt_dir)                  # converts, BEFORE the weights load
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))

The expert amaxes themselves travel in the model's sharded state dict, with a global expert axis
(:mod:`.expert_axis`). :func:`checkpoint_amax_shapes` reads their global shapes from a checkpoint's metadata, for
load-time checks.

Before it changes the model, :func:`restore_sharded_modelopt_state` checks the checkpoint's files
(:func:`~.files.check_checkpoint_dir`, data file sizes included) and runs the model checks a framework plugin
registered with :func:`register_sharded_checkpoint_check` (Megatron: every tensor's global shape against the
checkpoint's ``.metadata``), so that the user's own ``dist_checkpointing.load`` that follows cannot fail halfway.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..quantization.chunk_names import chunk_naming
from ..quantization.config import ExpertsConfig
from ..quantization.conversion import register_framework_plugins
from ..quantization.utils import rank
from .errors import CheckpointMismatchError
from .files import (
    STATE_FILE,
    atomic_torch_save,
    check_checkpoint_dir,
    megatron_lm_iteration_dir,
    read_dcp_metadata,
    read_torch_file,
)
from .state import modelopt_state, restore_modelopt_state

__all__ = [
    "save_sharded_modelopt_state",
    "restore_sharded_modelopt_state",
    "load_sharded_modelopt_state",
    "has_sharded_modelopt_state",
    "checkpoint_amax_shapes",
    "register_sharded_checkpoint_check",
]

# Checks of model chunks against a checkpoint, registered by framework plugins (see restore_sharded_modelopt_state).
_MODEL_CHECKS: list[Callable[[list[nn.Module], Path], None]] = []


def register_sharded_checkpoint_check(check: Callable[[list[nn.Module], Path], None]) -> None:
    """Adds a plugin's check of model chunks against a checkpoint directory, run by
    :func:`restore_sharded_modelopt_state` before it changes anything.

    ``check(models, ckpt_dir)`` must return None for models that are not its framework's and raise a
    :class:`CheckpointMismatchError` (or :class:`IncompleteCheckpointError`) for a checkpoint that does not fit; it is
    called on every rank, with the same outcome on every rank. Registering the same function twice adds it once.
    """
    if check not in _MODEL_CHECKS:
        _MODEL_CHECKS.append(check)


def _as_list(model_list) -> list[nn.Module]:
    return list(model_list) if isinstance(model_list, list | tuple) else [model_list]


def save_sharded_modelopt_state(model_list, ckpt_dir: str | os.PathLike,
                                calibration_tokens: list[dict] | None = None, *, states: list[dict] | None = None
                                ) -> None:
    """Writes the quantization state of every model chunk to ``ckpt_dir/modelopt_moe_state.pt``.

    Call on every rank after the weights are saved; global rank 0 writes (atomically), no collective is made. The
    state is layout-independent (the same on every rank with pipeline parallelism 1).

    Args:
        model_list: a model or a list of model chunks (virtual pipeline stages).
        ckpt_dir: the checkpoint directory (must exist).
        calibration_tokens: per chunk, every expert's calibration tokens by global index
            (:func:`~modelopt_moe.quantization.calib.tokens.expert_token_counts`, gathered by the caller;
            ``save_sharded_checkpoint`` passes them), restored with the state at any layout.
        states: the per-chunk states to write instead of the models' own (a framework plugin's, e.g. merged over
            pipeline stages under global layer names).

    Raises:
        ValueError: ``states`` not given for a pipeline stage (its own state holds its layers alone).
    """
    models = _as_list(model_list)
    tokens = calibration_tokens or [None] * len(models)
    if states is None:
        register_framework_plugins()
        if any(chunk_naming(m) is not None for m in models):
            raise ValueError("save_sharded_modelopt_state: the model is one pipeline stage of a larger model; its own "
                             "state would name its layers from 0 and leave the other stages' out: save with "
                             "modelopt_moe.plugins.megatron.save_sharded_checkpoint, which merges every stage's state "
                             "under global layer names (or pass states=)")
        states = [modelopt_state(m, t) for m, t in zip(models, tokens, strict=True)]
    if rank() != 0:
        return
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"save_sharded_modelopt_state: checkpoint directory {path} does not exist")
    atomic_torch_save({"format": "modelopt_moe.sharded_state", "models": states}, path / STATE_FILE)


def has_sharded_modelopt_state(ckpt_dir: str | os.PathLike) -> bool:
    """Whether ``ckpt_dir`` (or the latest iteration of a Megatron-LM checkpoint root) holds a quantization state:
    a training script resumes a QAT run with :func:`restore_sharded_modelopt_state` when it does, and quantizes
    the bf16 model when it does not."""
    return (megatron_lm_iteration_dir(ckpt_dir) / STATE_FILE).is_file()


def load_sharded_modelopt_state(ckpt_dir: str | os.PathLike) -> list[dict]:
    """The per-chunk quantization states saved in ``ckpt_dir``.

    Raises:
        IncompleteCheckpointError: the directory or its state file is missing or the save did not finish.
        CorruptCheckpointError: the state file is truncated or damaged (names it).
    """
    return _read_states(check_checkpoint_dir(ckpt_dir, require_state=True))


def _read_states(path: Path) -> list[dict]:
    payload = read_torch_file(path / STATE_FILE)
    if not isinstance(payload, dict) or not isinstance(payload.get("models"), list):
        raise CheckpointMismatchError(f"{path / STATE_FILE}: not a modelopt_moe sharded quantization state")
    return payload["models"]


def restore_sharded_modelopt_state(model_list, ckpt_dir: str | os.PathLike,
                                   experts: ExpertsConfig | dict | None = None, *, check: bool = True) -> None:
    """Re-creates the saved quantization in freshly built model chunks, before their weights load.

    First checks, without changing anything: the checkpoint is complete (every data file as long as its
    ``.metadata`` needs), its quantization state is readable, and (``check``) the model fits the checkpoint: the
    framework plugin's check (Megatron: every model tensor the checkpoint holds has the checkpoint's global shape).
    Then converts each (unquantized, possibly meta-device) chunk, restores every quantizer's format, enablement and
    STE, and checks each expert quantizer's global expert count against the checkpoint's.

    With pipeline parallelism each stage restores its own layers' entries of the saved state (which names layers
    globally), through the framework plugin's naming (:mod:`modelopt_moe.quantization.chunk_names`); with virtual
    pipeline stages each model chunk of the list does, from the one state of the whole model.

    Call it on every rank. Collectives: the Megatron check agrees on its outcome over all ranks (one all-gather).

    Args:
        model_list: a model or a list of model chunks, as saved.
        ckpt_dir: the checkpoint directory.
        experts: restore into these expert amax layouts instead of the saved ones.
        check: run the plugin's model check (``load_sharded_checkpoint`` passes False: it has made a stricter one).

    Raises:
        IncompleteCheckpointError: the checkpoint is partial (names the directory and what is missing or short).
        CorruptCheckpointError: the quantization state file is truncated or damaged (names it).
        CheckpointMismatchError: the checkpoint does not fit the model (names the key, expected and found values).
    """
    models = _as_list(model_list)
    path = check_checkpoint_dir(ckpt_dir, require_state=True)
    states = _read_states(path)
    register_framework_plugins()
    if len(states) == 1 and len(models) > 1 and all(chunk_naming(m) is not None for m in models):
        states = states * len(models)  # one whole-model state: each chunk (virtual pipeline stage) takes its layers
    if len(states) != len(models):
        raise CheckpointMismatchError(f"{path}: expected {len(models)} model chunks, found {len(states)}")
    if check:
        for model_check in _MODEL_CHECKS:
            model_check(models, path)
    for model, state in zip(models, states, strict=True):
        naming = chunk_naming(model)  # a pipeline stage: its layers' entries of the whole model's state
        restore_modelopt_state(model, naming.chunk_state(state) if naming is not None else state, experts,
                               source=str(path / STATE_FILE))


def checkpoint_amax_shapes(ckpt_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shapes of the ``*_amax`` tensors of a ``torch.distributed.checkpoint`` directory (reads its
    ``.metadata`` file; no collective)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_dcp_metadata(ckpt_dir)
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and k.endswith("_amax")}
