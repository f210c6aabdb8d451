"""Distributed checkpoints: EP-aware sharded amax and quantization state.

* :func:`save_sharded_modelopt_state` / :func:`restore_sharded_modelopt_state`: the quantization state beside a
  Megatron / ``torch.distributed.checkpoint`` checkpoint, restored into a freshly built model before its weights load
  (optionally into other expert amax layouts). The amaxes themselves travel in the model's ``sharded_state_dict``
  (``modelopt_moe.plugins.megatron_checkpoint``), with a global expert axis, one key per expert quantizer whatever
  its layout.
* :func:`save` / :func:`restore`: plain PyTorch, quantization state and weights in one file.
* :mod:`.amax`: the layout-independent ("canonical") expert amax both use.
"""

from .amax import CheckpointMismatchError, canonical_amax, iter_expert_slots, native_from_canonical
from .sharded import (
    IncompleteCheckpointError,
    begin_checkpoint_dir,
    check_checkpoint_dir,
    commit_checkpoint_dir,
    load_sharded_modelopt_state,
    resolve_checkpoint_dir,
    restore_sharded_modelopt_state,
    save_sharded_modelopt_state,
)
from .state import modelopt_state, restore, restore_modelopt_state, save

__all__ = [
    "save_sharded_modelopt_state",
    "restore_sharded_modelopt_state",
    "load_sharded_modelopt_state",
    "save",
    "restore",
    "modelopt_state",
    "restore_modelopt_state",
    "CheckpointMismatchError",
    "IncompleteCheckpointError",
    "begin_checkpoint_dir",
    "commit_checkpoint_dir",
    "check_checkpoint_dir",
    "resolve_checkpoint_dir",
    "iter_expert_slots",
    "canonical_amax",
    "native_from_canonical",
]
