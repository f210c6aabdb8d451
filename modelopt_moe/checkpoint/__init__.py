"""Checkpoints of quantized models: quantization state, expert amaxes on a global expert axis, safe writes.

* :func:`save_sharded_modelopt_state` / :func:`restore_sharded_modelopt_state`: the quantization state beside a
  Megatron / ``torch.distributed.checkpoint`` checkpoint, restored into a freshly built model before its weights load
  (optionally into other expert amax layouts). The amaxes themselves travel in the model's ``sharded_state_dict``
  with a global expert axis (:mod:`.expert_axis`; the Megatron plugin builds the sharded tensors).
* :func:`save` / :func:`restore`: plain PyTorch, quantization state and weights in one file.
* Model Optimizer's ``mto`` names: :func:`modelopt_state`, :func:`restore_from_modelopt_state`, :func:`save`,
  :func:`restore` (which also read Model Optimizer 0.47's states and ``mto.save`` files, :mod:`.modelopt_format`).
* :mod:`.files`: checkpoint directories that are complete or absent, never half-written; a save replaces only a
  checkpoint of ours (:func:`check_save_target`); data files are checked against torch DCP's ``.metadata``
  (:func:`check_dcp_file_sizes`) before a load.
"""

from .errors import CheckpointMismatchError, CorruptCheckpointError, IncompleteCheckpointError
from .files import (
    atomic_torch_save,
    begin_checkpoint_dir,
    check_checkpoint_dir,
    check_dcp_file_sizes,
    check_save_target,
    commit_checkpoint_dir,
    is_our_checkpoint,
    megatron_lm_iteration_dir,
    resolve_checkpoint_dir,
)
from .modelopt_format import is_model_optimizer_state, restore_model_optimizer_state
from .sharded import (
    checkpoint_amax_shapes,
    has_sharded_modelopt_state,
    load_sharded_modelopt_state,
    register_sharded_checkpoint_check,
    restore_sharded_modelopt_state,
    save_sharded_modelopt_state,
)
from .state import (
    iter_expert_quantizers,
    modelopt_state,
    restore,
    restore_from_modelopt_state,
    restore_modelopt_state,
    save,
)

__all__ = [
    "save_sharded_modelopt_state",
    "restore_sharded_modelopt_state",
    "has_sharded_modelopt_state",
    "load_sharded_modelopt_state",
    "checkpoint_amax_shapes",
    "save",
    "restore",
    "modelopt_state",
    "restore_modelopt_state",
    "restore_from_modelopt_state",
    "restore_model_optimizer_state",
    "is_model_optimizer_state",
    "iter_expert_quantizers",
    "register_sharded_checkpoint_check",
    "CheckpointMismatchError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "atomic_torch_save",
    "begin_checkpoint_dir",
    "commit_checkpoint_dir",
    "check_checkpoint_dir",
    "check_save_target",
    "check_dcp_file_sizes",
    "is_our_checkpoint",
    "resolve_checkpoint_dir",
    "megatron_lm_iteration_dir",
]
