"""Megatron's model-parallel groups and RNG trackers, set up in one call inside each rank.

    from modelopt_moe.plugins.megatron import init_model_parallel, destroy_model_parallel

    init_model_parallel(tp=2, ep=2, seed=1234)   # torch.distributed already initialised (torchrun, srun, spawn)
    ...                                          # build, quantize, train, save, export
    destroy_model_parallel()

On a machine without CUDA it applies :func:`modelopt_moe.plugins.megatron_cpu.apply_cpu_shims` first (a no-op with
CUDA), so the same call runs Megatron in CPU processes joined with gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from modelopt_moe.plugins.megatron_cpu import apply_cpu_shims

__all__ = ["init_model_parallel", "destroy_model_parallel"]


def init_model_parallel(tp: int = 1, ep: int = 1, *, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """Initialise Megatron's model-parallel groups and RNG trackers on the current process group.

    ``torch.distributed`` must already be initialised (``modelopt_moe.launch.spawn``, ``torchrun`` or ``srun`` with
    :func:`modelopt_moe.launch.init_from_environment`). Applies the CPU shims first when CUDA is absent. Groups that
    exist already are destroyed and built again. Expert tensor parallelism is fixed to 1 (gloo cannot all-gather
    unequal sizes); context parallelism is 1; the rest of the world is data parallel.

    Args:
        tp: Tensor-model-parallel size; must divide the world size.
        ep: Expert-model-parallel size; must divide the world size.
        pp: Pipeline-model-parallel size; ``tp * pp`` and ``ep * pp`` must divide the world size.
        vpp: Virtual pipeline stages (model chunks) per pipeline stage, for Megatron's interleaved schedule; None or
            1: the non-interleaved schedule.
        seed: Seed of Megatron's RNG trackers (dropout) and of torch's default generator.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: ``tp``, ``ep`` or ``pp`` (or ``tp * pp``, ``ep * pp``) does not divide the world size; ``vpp``
            above 1 with ``pp`` 1.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel needs torch.distributed initialised (use modelopt_moe.launch.spawn)")
    world = dist.get_world_size()
    for name, size in (("tp", tp), ("ep", ep)):
        if size < 1 or world % size:
            raise ValueError(f"{name}={size} must be >= 1 and divide the world size {world}")
    if pp < 1 or world % (tp * pp) or world % (ep * pp):
        raise ValueError(f"pp={pp}: must be >= 1 and tp * pp = {tp * pp} and ep * pp = {ep * pp} must divide the "
                         f"world size {world}")
    if vpp is not None and (vpp < 1 or (vpp > 1 and pp == 1)):
        raise ValueError(f"vpp={vpp}: virtual pipeline stages need pp > 1 (got pp={pp}); expected None, 1, or above 1 "
                         "with pp > 1")
    apply_cpu_shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
    )
    torch.manual_seed(seed)
    # The inference tracker keeps plain torch generators, so no CUDA RNG state is needed (the plain call needs
    # torch.cuda.get_rng_state; skipping the call breaks attention dropout's tracker lookups).
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def destroy_model_parallel() -> None:
    """Tear down Megatron's model-parallel groups (the default process group stays)."""
    parallel_state.destroy_model_parallel()
