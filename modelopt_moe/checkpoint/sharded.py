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
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..quantization.config import ExpertsConfig
from ..quantization.utils import rank
from .errors import CheckpointMismatchError
from .files import STATE_FILE, atomic_torch_save, check_checkpoint_dir, megatron_lm_iteration_dir
from .state import modelopt_state, restore_modelopt_state

__all__ = [
    "save_sharded_modelopt_state",
    "restore_sharded_modelopt_state",
    "load_sharded_modelopt_state",
    "has_sharded_modelopt_state",
    "checkpoint_amax_shapes",
]


def _as_list(model_list) -> list[nn.Module]:
    return list(model_list) if isinstance(model_list, list | tuple) else [model_list]


def save_sharded_modelopt_state(model_list, ckpt_dir: str | os.PathLike) -> None:
    """Writes the quantization state of every model chunk to ``ckpt_dir/modelopt_moe_state.pt``.

    Call on every rank after the weights are saved; global rank 0 writes (atomically), no collective is made. The
    state is layout-independent (the same on every rank with pipeline parallelism 1).

    Args:
        model_list: a model or a list of model chunks (virtual pipeline stages).
        ckpt_dir: the checkpoint directory (must exist).
    """
    states = [modelopt_state(m) for m in _as_list(model_list)]
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
    """
    path = check_checkpoint_dir(ckpt_dir, require_state=True)
    payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or not isinstance(payload.get("models"), list):
        raise CheckpointMismatchError(f"{path / STATE_FILE}: not a modelopt_moe sharded quantization state")
    return payload["models"]


def restore_sharded_modelopt_state(model_list, ckpt_dir: str | os.PathLike,
                                   experts: ExpertsConfig | dict | None = None) -> None:
    """Re-creates the saved quantization in freshly built model chunks, before their weights load.

    Converts each (unquantized, possibly meta-device) chunk, restores every quantizer's format, enablement and STE,
    and checks each expert quantizer's global expert count against the checkpoint's. No collective.

    Args:
        model_list: a model or a list of model chunks, as saved.
        ckpt_dir: the checkpoint directory.
        experts: restore into these expert amax layouts instead of the saved ones.

    Raises:
        IncompleteCheckpointError: the checkpoint is partial (names the directory and what is missing).
        CheckpointMismatchError: the checkpoint does not fit the model (names the key, expected and found values).
    """
    models = _as_list(model_list)
    path = check_checkpoint_dir(ckpt_dir, require_state=True)
    states = load_sharded_modelopt_state(path)
    if len(states) != len(models):
        raise CheckpointMismatchError(f"{path}: expected {len(models)} model chunks, found {len(states)}")
    for model, state in zip(models, states, strict=True):
        restore_modelopt_state(model, state, experts, source=str(path / STATE_FILE))


def checkpoint_amax_shapes(ckpt_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Global shapes of the ``*_amax`` tensors of a ``torch.distributed.checkpoint`` directory (reads its
    ``.metadata`` file; no collective)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(ckpt_dir)).read_metadata()
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and k.endswith("_amax")}
