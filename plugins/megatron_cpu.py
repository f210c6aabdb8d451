"""The few patches megatron-core 0.19.2 needs to run on a CPU-only machine (gloo). Never used with CUDA.

This is the ONLY module of the project that patches torch (for the tests and the demo). ``apply_cpu_shims()`` is
called in every process that builds a Megatron model without CUDA (``modelopt_moe.plugins.testing.megatron_models``
does it for you); it does nothing when ``torch.cuda.is_available()``, so the GPU path always runs unpatched torch.

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

Megatron's *training machinery* (``DistributedDataParallel``, ``get_megatron_optimizer`` with its Float16 / FP32 /
distributed optimizers, gradient clipping, the pipeline schedules) needs more, and only while it runs:
:func:`megatron_training_shims` is a context manager for that (see its docstring for each patch and why). It is
scoped (entered around building the wrappers and optimizer and around each training step) rather than applied
for the whole process, because its ``TorchFunctionMode`` sees every torch call made inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["apply_cpu_shims", "cpu_shims_applied", "megatron_training_shims"]

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


# ---------------------------------------------------------------------------------------------------------------
# Megatron's training machinery (DDP, optimizers, clip_grads, schedules) on CPU


class _DummyStream:
    """Stand-in for ``torch.cuda.Stream`` / ``current_stream()``: CPU work is in order, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def wait_event(self, event=None):
        del event

    def wait_stream(self, stream=None):
        del stream

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


class _DummyEvent:
    """Stand-in for ``torch.cuda.Event``: recorded work is always complete on CPU."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def record(self, stream=None):
        del stream

    def wait(self, stream=None):
        del stream

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


# Tensor.type() names that Megatron's optimizers and clip_grads compare against ('torch.cuda.<X>Tensor').
_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
}


class _CudaAsCpuMode(TorchFunctionMode):
    """Makes Megatron's CUDA-only allocation and type checks land on CPU tensors (see megatron_training_shims)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]  # the tensor is already where all work runs
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_TRAINING_PATCHES = {
    # DDP's param-and-grad buffer waits on the current stream before its gradient reduce.
    "current_stream": lambda device=None: _DummyStream(),
    # DDP creates a communication stream with several distributed-optimizer instances or overlap.
    "Stream": _DummyStream,
    # Waits on recorded events (CUDA-graph replay, overlapped communication).
    "Event": _DummyEvent,
    # Stream contexts around overlapped collectives.
    "stream": lambda stream=None: contextlib.nullcontext(),
    # Optimizers' offload/reload helpers free the cache; nothing to free on CPU.
    "empty_cache": lambda: None,
}


@contextlib.contextmanager
def megatron_training_shims() -> Iterator[bool]:
    """Run Megatron's DDP, ``get_megatron_optimizer`` and the pipeline schedules on CPU; a no-op with CUDA.

    Enter it around building ``DistributedDataParallel`` and the optimizer and around every training step (building
    and running the model itself needs only :func:`apply_cpu_shims`, which this applies too). Yields whether the
    shims are in effect. Nestable; on exit ``torch.cuda`` is restored to what it was.

    Patches, each for one reason:

    * a ``TorchFunctionMode`` that
        - maps ``device='cuda'`` (or ``'cuda:N'``) of any torch call to ``'cpu'``: the optimizers' found-inf flag and
          loss scale, ``clip_grads``' norm buffers and the schedules' token counter allocate with a literal
          ``device='cuda'``;
        - makes ``Tensor.cuda()`` return the tensor: the grad scaler and optimizer-state reloads move tensors with it;
        - answers ``Tensor.type()`` with the ``torch.cuda.<X>Tensor`` name: the Float16 / distributed optimizers
          choose fp32 main params by comparing ``param.type()`` with ``'torch.cuda.BFloat16Tensor'`` (anything else
          is rejected) and ``clip_grads`` asserts ``'torch.cuda.FloatTensor'`` grads;
    * ``torch.cuda.current_stream`` / ``Stream`` / ``Event`` / ``stream``: dummies whose waits are no-ops (DDP's
      gradient reduce waits on the current stream; CPU work is in program order);
    * ``torch.cuda.empty_cache``: a no-op.

    Tensors keep their real device (``is_cuda`` stays False), so the project's own CPU/GPU decisions are unchanged.
    """
    if torch.cuda.is_available():
        yield False
        return
    apply_cpu_shims()
    saved = {name: getattr(torch.cuda, name) for name in _TRAINING_PATCHES}
    for name, value in _TRAINING_PATCHES.items():
        setattr(torch.cuda, name, value)
    try:
        with _CudaAsCpuMode():
            yield True
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
