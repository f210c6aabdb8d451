"""Megatron-Core support: every Megatron concern of the project (quantized modules, sharded state dicts, whole
checkpoints, process groups, the training schedule) lives in this package.

Public API::

    from modelopt_moe.plugins.megatron import (
        init_model_parallel, destroy_model_parallel,        # Megatron's parallel groups (+ CPU setup without CUDA)
        save_sharded_checkpoint, load_sharded_checkpoint,   # weights + amax + quantization + optimizer state
        check_sharded_checkpoint,                           # files and tensor shapes, before a load
        checkpoint_load_metadata,                           # metadata for your own dist_checkpointing.load calls
        get_forward_backward_func,                          # Megatron's, reusing fake-quantized weights per step,
                                                            # one autoswitch step per call
        lm_forward_step,                                    # a forward_step_func with a plain LM loss
        check_lm_batch, BatchError,                         # ... and the batch contract it checks
        distillation_model, distillation_loss_func,         # QAD: the student beside its frozen teacher
        distillation_tensor_shapes_fn,                      # ... its stage tensors, for Megatron's own schedule (PP)
        distillation_micro_batch_size,                      # ... and its micro-batch size there (virtual stages)
        write_teacher_logits, stored_teacher_logits,        # ... the teacher's top-k logits precomputed on disk
        select_trainable, qad_optimizer_config,             # ... trained the QADRecipe's way
        get_qad_optimizer, qad_lr_scheduler,
        load_modelopt_checkpoint,                           # a checkpoint NVIDIA Model Optimizer 0.47 saved
    )

:mod:`.training` wraps a model the Megatron way (``Float16Module``, DDP, ``get_megatron_optimizer``, LR scheduler)
and runs optimizer steps through the schedule: what ``modelopt-moe qat`` and the demo train with.

Hugging Face export / import (``modelopt_moe.export.export_hf`` / ``import_hf`` / ``build_megatron_model``) reach
this package's adapter (:mod:`.hf_io`, :mod:`.hf_model`) through :func:`register`.

:func:`register` is called by the core (``mtq.quantize``, every restore) once ``megatron.core`` is imported; it
registers the quantized Megatron classes and Megatron's process groups for amax reductions.
"""

from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.module import Float16Module

from modelopt_moe.checkpoint.sharded import register_sharded_checkpoint_check
from modelopt_moe.export.registry import register_export_adapter
from modelopt_moe.quantization.calib.routing import register_router_widener
from modelopt_moe.quantization.chunk_names import register_chunk_naming
from modelopt_moe.quantization.conversion import QuantModuleRegistry, register_wrapper
from modelopt_moe.quantization.process_groups import register_group_provider
from modelopt_moe.quantization.smooth_experts import register_expert_mlp_finder

from .batches import LM_BATCH_CONTRACT, BatchError, check_lm_batch
from .calib_routing import widen_moe_routing
from .checkpoint import (
    check_sharded_checkpoint,
    load_sharded_checkpoint,
    model_sharded_state_dict,
    restore_check,
    save_sharded_checkpoint,
)
from .distill import (
    distillation_loss_func,
    distillation_micro_batch_size,
    distillation_model,
    distillation_tensor_shapes_fn,
    get_qad_optimizer,
    qad_lr_scheduler,
    qad_optimizer_config,
    select_trainable,
)
from .forward_step import lm_forward_step, lm_loss_func
from .hf_io import MegatronExportAdapter
from .modelopt_checkpoint import is_modelopt_checkpoint, load_modelopt_checkpoint
from .modules import CLASSES, megatron_amax_groups
from .parallel import destroy_model_parallel, init_model_parallel
from .pipeline_state import stage_naming
from .schedule import get_forward_backward_func
from .sharded_state_dict import checkpoint_load_metadata
from .smooth_experts import megatron_expert_mlps
from .teacher_logits import stored_teacher_logits, write_teacher_logits

__all__ = [
    "register",
    "init_model_parallel",
    "destroy_model_parallel",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "check_sharded_checkpoint",
    "model_sharded_state_dict",
    "checkpoint_load_metadata",
    "get_forward_backward_func",
    "lm_forward_step",
    "lm_loss_func",
    "check_lm_batch",
    "BatchError",
    "LM_BATCH_CONTRACT",
    "megatron_amax_groups",
    "load_modelopt_checkpoint",
    "is_modelopt_checkpoint",
    "distillation_model",
    "distillation_tensor_shapes_fn",
    "distillation_micro_batch_size",
    "write_teacher_logits",
    "stored_teacher_logits",
    "distillation_loss_func",
    "select_trainable",
    "qad_optimizer_config",
    "get_qad_optimizer",
    "qad_lr_scheduler",
]


def register() -> None:
    """Adds the quantized Megatron classes to the registry, Megatron's process groups, MoE router widener
    (``moe_calib_experts_ratio``) and expert layers (``smooth_expert_inputs``) to calibration, Megatron's
    model wrappers (DDP, ``Float16Module``, transparent in state dicts) to the quantization state's naming, the
    Megatron adapter to the Hugging Face export (:mod:`modelopt_moe.export`), the tensor-shape check to
    ``restore_sharded_modelopt_state`` and the global layer names of pipeline stages
    (:mod:`modelopt_moe.quantization.chunk_names`)."""
    for original, quantized in CLASSES.items():
        QuantModuleRegistry.register(original, quantized)
    register_group_provider(megatron_amax_groups)
    register_router_widener(widen_moe_routing)
    register_expert_mlp_finder(megatron_expert_mlps)
    for wrapper in (DistributedDataParallel, Float16Module):
        register_wrapper(wrapper)
    register_export_adapter(MegatronExportAdapter())
    register_sharded_checkpoint_check(restore_check)
    register_chunk_naming(stage_naming)
