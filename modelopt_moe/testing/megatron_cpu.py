"""The few patches megatron-core 0.19.2 needs to run on a CPU-only machine (gloo). Never used with CUDA.

This is the ONLY module of the project that patches torch. ``apply_cpu_shims()`` is called in every process that
builds a Megatron model without CUDA (``modelopt_moe.testing.megatron_models`` does it for you); it does nothing when
``torch.cuda.is_available()``, so the GPU path always runs unpatched torch.

Each patch, and why it is needed:

* ``torch.cuda.current_device()`` -> ``torch.device("cpu")``: Megatron passes it as ``device=`` when it allocates
  tensors (RoPE frequencies, the MoE router and token dispatcher, tensor-parallel communication buffers, the
  dist-checkpoint saver). On a CPU build the real function raises ("Torch not compiled with CUDA enabled").
  Returning a CPU *device object* (rather than an index) makes every ``device=torch.cuda.current_device()`` land
  on the CPU, which is what we want.
* ``torch.cuda.synchronize()`` -> no-op: ``dist_checkpointing.save`` and a few timers call it to wait for GPU
  work; on CPU all work is already synchronous.

What is deliberately *not* patched:

* The CUDA RNG: use ``tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``; that
  tracker keeps no CUDA RNG state (``init_model_parallel`` in ``megatron_models.py`` does it).
* CUDA streams/events: only Megatron's alltoall token dispatcher creates them; use the allgather dispatcher.
* The non-TE norm's refusal of ``sequence_parallel``: solved without patching, by building the norms from our own
  builder in the layer spec (``megatron_models.sequence_parallel_norm``).
"""

from __future__ import annotations

import torch

__all__ = ["apply_cpu_shims", "cpu_shims_applied"]

# Marker attribute set on torch.cuda once the shims are in, so a second call (or a second importer) is a no-op.
_MARKER = "_modelopt_moe_cpu_shims"


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` on CPU-only machines: every Megatron allocation goes to CPU."""
    return torch.device("cpu")


def _cpu_synchronize(device: object = None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` on CPU-only machines: CPU work is already synchronous."""
    del device


def cpu_shims_applied() -> bool:
    """Return True if :func:`apply_cpu_shims` has patched torch in this process."""
    return bool(getattr(torch.cuda, _MARKER, False))


def apply_cpu_shims() -> bool:
    """Patch ``torch.cuda`` so megatron-core runs on CPU; idempotent; a no-op when CUDA is available.

    Call it in every process before building a Megatron model on a CPU-only machine (before or after importing
    megatron.core: Megatron looks the functions up on ``torch.cuda`` at call time).

    Returns:
        True if the shims are in effect in this process (applied now or before), False if CUDA is available and
        nothing was patched.
    """
    if torch.cuda.is_available():
        return False
    if cpu_shims_applied():
        return True
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.synchronize = _cpu_synchronize
    setattr(torch.cuda, _MARKER, True)
    return True
