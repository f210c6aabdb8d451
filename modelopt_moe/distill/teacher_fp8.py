"""The teacher's weights stored in FP8: real ``float8_e4m3fn`` codes and their scales, dequantized per layer.

A frozen teacher needs no high-precision copy of its weights: :func:`store_weights_fp8` replaces each weight matrix
(``weight``, and the grouped experts' ``weight0 .. weight{N-1}`` / ``weight1``, ``weight2``) of every module by two
buffers, ``{name}_fp8`` (E4M3 codes, one byte an element) and ``{name}_fp8_scale`` (fp32, per tensor or per output
channel), and gives the module a read-only attribute of the weight's name that dequantizes them when it is read.
A layer reads its weight in its own forward, so one layer's dequantized weight exists at a time (under
``torch.no_grad()`` nothing keeps it), and the weights held between forwards take about half the bytes of bf16.

The codes are those of the numeric contract (:func:`modelopt_moe.numerics.fp8.encode_fp8`: ``s = 448 / amax``,
saturating, nearest even), the weight read back is ``q / s`` in the weight's dtype: the teacher computes with exactly
the FP8 fake-quantized weights ``fake_quant(w, "e4m3", amax)``.

Transformer Engine modules keep their weights in their own tensors (and have FP8 primary weights of their own,
``te.fp8_model_init``): they are refused by name, before anything changes.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..numerics.fp8 import encode_fp8
from .recipe import TEACHER_FP8_GRANULARITIES, param_group

__all__ = ["TEACHER_FP8_GRANULARITIES", "store_weights_fp8", "stored_bytes"]

_WEIGHT_NAME = re.compile(r"weight\d*")
_SKIPPED_GROUPS = ("router", "norms")  # routing decisions and norm gains stay in their own precision
_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _dequantized(module: nn.Module, name: str) -> torch.Tensor:
    codes, scale = module._buffers[f"{name}_fp8"], module._buffers[f"{name}_fp8_scale"]
    return torch.div(codes.to(torch.float32), scale).to(module.__dict__["_fp8_dtypes"][name])


def _fp8_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a read-only property per converted weight name (one class per original class and names)."""
    key = (cls, names)
    if key not in _CLASSES:
        props = {n: property(lambda self, n=n: _dequantized(self, n), doc=f"``{n}`` dequantized from FP8")
                 for n in names}
        _CLASSES[key] = type(f"FP8Stored{cls.__name__}", (cls,), {
            **props, "__module__": cls.__module__, "__reduce_ex__": _reduce_ex, "_fp8_key": key})
    return _CLASSES[key]


def _reduce_ex(module: nn.Module, protocol):
    """Pickles (and deep-copies) a converted module through its original class, which pickles by name. The codes
    travel as their bytes (uint8): torch 2.13 cannot unpickle a float8 tensor with plain ``pickle``."""
    cls, names = type(module)._fp8_key
    state = dict(module.__getstate__())
    state["_buffers"] = {k: v.view(torch.uint8) if k in _codes(names) else v for k, v in state["_buffers"].items()}
    return _restore, (cls, names, state)


def _codes(names: tuple[str, ...]) -> set[str]:
    return {f"{n}_fp8" for n in names}


def _restore(cls: type, names: tuple[str, ...], state: dict) -> nn.Module:
    state["_buffers"] = {k: v.view(torch.float8_e4m3fn) if k in _codes(names) else v
                         for k, v in state["_buffers"].items()}
    module = cls.__new__(cls)
    module.__setstate__(state)
    module.__class__ = _fp8_class(cls, names)
    return module


def _is_transformer_engine(module: nn.Module) -> bool:
    return any(c.__module__.startswith("transformer_engine") for c in type(module).__mro__)


def store_weights_fp8(model: nn.Module, granularity: str = "per_tensor") -> dict[str, int]:
    """Stores the weight matrices of a frozen ``model`` (a teacher) as FP8 E4M3 codes and scales, in place.

    Every parameter named ``weight`` or ``weight<digits>`` with two or more dims is converted, except the router's
    (Megatron's ``...router.weight``: routing stays exact) and the norms'. Its module then reads it back dequantized
    (``codes / scale`` in the parameter's dtype) wherever it reads it, in its forward or in its parent's (tied
    embeddings), and holds no high-precision copy.

    Args:
        model: the teacher; its parameters must not require gradients after this (FP8 storage is frozen).
        granularity: ``"per_tensor"`` (one scale a weight) or ``"per_channel"`` (one per row of the weight, the
            output channel of a linear layer).

    Returns:
        ``{"converted": weights converted, "bytes_before": their bytes before, "bytes_after": codes and scales}``.

    Raises:
        ValueError: an unknown ``granularity``; a Transformer Engine module holds a weight (named); a weight holds
            NaN or Inf (named). Nothing is changed then.
    """
    if granularity not in TEACHER_FP8_GRANULARITIES:
        raise ValueError(f"store_weights_fp8: granularity={granularity!r}; expected one of "
                         f"{list(TEACHER_FP8_GRANULARITIES)}")
    plan: list[tuple[str, nn.Module, tuple[str, ...]]] = []
    for path, module in model.named_modules():
        names = tuple(n for n, p in module._parameters.items()
                      if p is not None and _WEIGHT_NAME.fullmatch(n) and p.dim() >= 2 and p.is_floating_point()
                      and param_group(f"{path}.{n}" if path else n) not in _SKIPPED_GROUPS)
        if not names:
            continue
        if _is_transformer_engine(module):
            raise ValueError(f"store_weights_fp8: {path or 'the model'} is a Transformer Engine module "
                             f"({type(module).__name__}); TE reads its weights itself: build the teacher with "
                             "Megatron's local layer spec, or use TE's own FP8 weights (te.fp8_model_init)")
        plan.append((path, module, names))
    encoded, done = [], {}
    for path, module, names in plan:  # encode everything first: a bad weight changes nothing
        for n in names:
            w = module._parameters[n].detach()
            if id(module._parameters[n]) in done:  # a weight shared by two modules (tied): one copy of the codes
                encoded.append((module, n, *done[id(module._parameters[n])][:3], 0))
                continue
            rows = w.reshape(w.shape[0], -1).float()
            amax = rows.abs().amax() if granularity == "per_tensor" else rows.abs().amax(-1, keepdim=True)
            codes, scale = encode_fp8(rows, amax, name=f"{path}.{n}" if path else n)
            if granularity == "per_channel":
                scale = scale.reshape(w.shape[0], *([1] * (w.dim() - 1)))
            codes, scale = codes.reshape(w.shape), scale.float().contiguous()
            done[id(module._parameters[n])] = (codes, scale, w.dtype)
            encoded.append((module, n, codes, scale, w.dtype, w.numel() * w.element_size()))
    stats = {"converted": len(encoded), "bytes_before": 0, "bytes_after": 0}
    for module, n, codes, scale, dtype, nbytes in encoded:
        del module._parameters[n]
        module.register_buffer(f"{n}_fp8", codes)
        module.register_buffer(f"{n}_fp8_scale", scale)
        module.__dict__.setdefault("_fp8_dtypes", {})[n] = dtype
        if nbytes:  # not a second module of a shared weight
            stats["bytes_before"] += nbytes
            stats["bytes_after"] += codes.numel() + scale.numel() * scale.element_size()
    for _, module, names in plan:
        module.__class__ = _fp8_class(type(module), names)
    return stats


def stored_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (each storage once): what it holds between forwards."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
