"""Megatron-Core 0.19 on a machine without CUDA: build, train, checkpoint and export Megatron models in CPU
processes (gloo), e.g. to try a training script on a laptop or in CI before it runs on GPUs.

    from modelopt_moe.plugins.megatron_cpu import enable_cpu_megatron

    enable_cpu_megatron()  # first, before megatron.core is imported; does nothing where CUDA is available

Megatron calls CUDA in places that have a CPU meaning; :func:`enable_cpu_megatron` gives them that meaning for the
rest of the process, and does nothing where ``torch.cuda.is_available()`` (the GPU path always runs unpatched torch
and Megatron). This is the only module of the project that patches torch. It imports torch only.

What it does, each for one reason:

* hides Transformer Engine and Apex (``import transformer_engine`` raises ``ModuleNotFoundError``, ``find_spec``
  finds nothing): where they are installed but CUDA is not usable (GPUs hidden with ``CUDA_VISIBLE_DEVICES=""``),
  Megatron would pick their CUDA kernels (the MoE router's GEMM, fused Adam, multi-tensor helpers) and fail with
  "No CUDA GPUs are available"; hidden, Megatron takes its own torch code, as on a machine without them. Hence
  "before megatron.core is imported": a Megatron that already bound them is refused with that advice;
* ``torch.cuda.current_device()`` -> ``torch.device("cpu")``: Megatron passes it as ``device=`` when it allocates
  tensors (RoPE frequencies, the MoE router and token dispatcher, tensor-parallel buffers, the dist-checkpoint
  saver); on a CPU build the real function raises ("Torch not compiled with CUDA enabled");
* ``torch.cuda.synchronize()`` -> no-op: ``dist_checkpointing.save`` and timers wait for GPU work;
* for Megatron's training machinery (``DistributedDataParallel``, ``get_megatron_optimizer``, ``clip_grads``, the
  pipeline schedules, ``save_sharded_checkpoint(..., optimizer=...)``): the patches of
  :func:`megatron_training_shims` (a ``TorchFunctionMode`` that maps ``device="cuda"`` to the CPU, ``Tensor.cuda()``
  to the tensor itself and ``Tensor.type()`` to the ``torch.cuda.<X>Tensor`` name Megatron's optimizers compare
  with; dummy CUDA streams and events). :func:`enable_cpu_megatron` keeps them on for the whole process (in the
  thread that called it); the context manager scopes them to a block.

Megatron's sliding-window mask (``get_sliding_window_causal_mask``, built on ``device="cuda"``):
:func:`cpu_sliding_window_mask` builds it on the CPU; ``build_megatron_model`` installs it on a machine without CUDA
for models with sliding windows (gpt-oss), whichever of the setups above ran.

Not patched: the CUDA RNG (seed Megatron with ``tensor_parallel.model_parallel_cuda_manual_seed(seed,
inference_rng_tracker=True)``, which keeps no CUDA RNG state); CUDA streams of the alltoall token dispatcher (use
``moe_token_dispatcher_type="allgather"``); the non-TE norm's refusal of ``sequence_parallel`` (build the norms with
``modelopt_moe.plugins.megatron.norms.sequence_parallel_norm``). ``modelopt_moe.export.build_megatron_model``
chooses that dispatcher and those norms on a machine without CUDA.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable_cpu_megatron", "apply_cpu_shims", "cpu_shims_applied", "megatron_training_shims"]

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


# Packages whose kernels need CUDA and which Megatron uses whenever they import (see the module docstring).
GPU_ONLY_PACKAGES = ("transformer_engine", "transformer_engine_torch", "apex")


def _hide_gpu_only_packages() -> None:
    """Makes Transformer Engine and Apex look uninstalled: ``import transformer_engine`` raises
    ``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns None (a None entry in ``sys.modules``), so
    Megatron (and any library that checks) takes its torch code."""
    imported = sorted(name for name, m in sys.modules.items() if name.split(".")[0] in GPU_ONLY_PACKAGES
                      and m is not None)
    if imported:
        raise RuntimeError(
            f"Megatron on CPU: {imported[0]} was imported before the CPU setup, and Megatron would call its CUDA "
            "kernels (e.g. the MoE router's GEMM: 'No CUDA GPUs are available'). Call "
            "modelopt_moe.plugins.megatron_cpu.enable_cpu_megatron() first, before importing megatron.core")
    for name in GPU_ONLY_PACKAGES:
        sys.modules[name] = None


def apply_cpu_shims() -> bool:
    """Patch ``torch.cuda`` so megatron-core builds and runs models on CPU, and hide Transformer Engine and Apex;
    idempotent; a no-op when CUDA is available. :func:`enable_cpu_megatron` does this and more (training).

    Call it in every process before building a Megatron model on a CPU-only machine, before importing megatron.core
    where Transformer Engine or Apex are installed (without them, before or after: Megatron looks the patched
    functions up on ``torch.cuda`` at call time).

    Returns:
        True if the shims are in effect in this process (applied now or before), False if CUDA is available and
        nothing was patched.

    Raises:
        RuntimeError: Transformer Engine or Apex is already imported (Megatron would use its CUDA kernels).
    """
    if torch.cuda.is_available():
        return False
    if cpu_shims_applied():
        return True
    _hide_gpu_only_packages()
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


_enabled_mode: _CudaAsCpuMode | None = None


def enable_cpu_megatron() -> bool:
    """Lets Megatron-Core build, train (DDP, ``get_megatron_optimizer``, the schedules), checkpoint and export models
    in this process on a machine without CUDA; a no-op where CUDA is available. Idempotent.

    Call it first, before importing megatron.core (Transformer Engine and Apex, where installed, must stay out of
    Megatron on CPU). Every patch, and why, is in the module docstring; they stay for the rest of the process (the
    ``TorchFunctionMode`` for the calling thread).

    Returns:
        True if Megatron runs on CPU in this process (set up now or before), False where CUDA is available and
        nothing was changed.

    Raises:
        RuntimeError: Transformer Engine or Apex was imported already (the message says what to do).
    """
    global _enabled_mode
    if not apply_cpu_shims():
        return False
    if _enabled_mode is None:
        for name, value in _TRAINING_PATCHES.items():
            setattr(torch.cuda, name, value)
        _enabled_mode = _CudaAsCpuMode()
        _enabled_mode.__enter__()  # pushed for good: the process runs Megatron on CPU from here on
    return True


def _sliding_window_causal_mask_cpu(sq: int, skv: int, window_size) -> torch.Tensor:
    """Megatron's ``get_sliding_window_causal_mask`` (True: masked), built on the CPU."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def cpu_sliding_window_mask() -> bool:
    """Makes Megatron's unfused softmax build its sliding-window mask on the CPU (Megatron-Core 0.19 builds it on
    ``"cuda"``); a no-op where CUDA is available. Imports Megatron: call it after :func:`apply_cpu_shims`.

    Returns:
        True if the CPU mask is in place (now or before), False where CUDA is available.
    """
    if torch.cuda.is_available():
        return False
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_sliding_window_causal_mask = _sliding_window_causal_mask_cpu
    return True
