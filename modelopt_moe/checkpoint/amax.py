"""Layout-independent ("canonical") expert amax: one tensor ``[N, *per_expert_shape]`` per expert quantizer.

Every expert amax layout (``shared`` scalar, ``vectorized`` ``[N]``/``[N, C]``, ``per_expert`` children ``.{i}``)
converts to and from the canonical form, so a checkpoint holds ONE tensor per (layer, GEMM, quantizer kind) whatever
layout wrote it:

* to canonical: ``vectorized`` is already canonical; ``per_expert`` stacks its children; ``shared`` repeats its value
  for each expert;
* from canonical: ``vectorized`` takes it as is; ``per_expert`` child ``i`` takes row ``i``; ``shared`` takes the max
  over the expert axis (over ALL global experts when it is given the global tensor).

``per_expert_shape`` is ``()`` for a per-tensor amax and ``(C,)`` for a per-channel one (``C`` channels along the
quantizer's ``axis``). This module is framework-free; ``plugins/megatron_checkpoint.py`` adds the global expert axis.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..quantization.conversion import is_quantized
from ..quantization.nn.grouped_linear import QUANTIZER_KINDS, ExpertQuantizers
from ..quantization.tensor_quantizer import PerExpertQuantizer, TensorQuantizer, VectorizedQuantizer

__all__ = [
    "CheckpointMismatchError",
    "ExpertSlot",
    "iter_expert_slots",
    "layout_name",
    "layout_has_amax",
    "layout_is_saved",
    "per_expert_shape",
    "native_shape",
    "canonical_amax",
    "native_from_canonical",
    "classify_checkpoint_amax",
]


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model; the message names the key, the expected and the found values."""


@dataclass
class ExpertSlot:
    """One expert quantizer (a layout) of one expert GEMM.

    Attributes:
        name: full name of the layout, e.g. ``decoder.layers.0.mlp.experts.linear_fc1.weight_quantizer``.
        kind: ``input_quantizer`` / ``weight_quantizer`` / ``output_quantizer``.
        layout: the quantizer module (TensorQuantizer, VectorizedQuantizer or PerExpertQuantizer).
        owner: the quantized module that owns the container (e.g. ``QuantSequentialMLP``, a grouped linear).
        container: the module holding the three layouts (an :class:`ExpertQuantizers` or the grouped linear).
        num_local: experts on this rank.
    """

    name: str
    kind: str
    layout: nn.Module
    owner: nn.Module
    container: nn.Module
    num_local: int


def _containers(module: nn.Module) -> Iterator[tuple[str, nn.Module, int]]:
    """``(relative name, container, local expert count)`` of a quantized module's expert quantizers."""
    if hasattr(module, "num_gemms") and isinstance(getattr(module, "weight_quantizer", None), nn.Module):
        yield "", module, int(module.num_gemms)  # a grouped expert linear holds its layouts itself
        return
    for name, child in module.named_children():
        if isinstance(child, ExpertQuantizers):
            yield name, child, int(child.num_experts)


def iter_expert_slots(model: nn.Module) -> Iterator[ExpertSlot]:
    """Every expert quantizer layout of ``model``, in module order."""
    for mod_name, module in model.named_modules():
        if not is_quantized(module):
            continue
        for rel, container, n in _containers(module):
            base = ".".join(p for p in (mod_name, rel) if p)
            for kind in QUANTIZER_KINDS:
                layout = getattr(container, kind, None)
                if isinstance(layout, nn.Module):
                    yield ExpertSlot(f"{base}.{kind}" if base else kind, kind, layout, module, container, n)


def layout_name(layout: nn.Module) -> str:
    """``per_expert``, ``vectorized`` or ``shared``."""
    if isinstance(layout, PerExpertQuantizer):
        return "per_expert"
    if isinstance(layout, VectorizedQuantizer):
        return "vectorized"
    if isinstance(layout, TensorQuantizer):
        return "shared"
    raise TypeError(f"not an expert quantizer layout: {type(layout).__name__}")


def _quantizers(layout: nn.Module) -> list[TensorQuantizer]:
    return list(layout) if isinstance(layout, PerExpertQuantizer) else [layout]


def layout_has_amax(layout: nn.Module) -> bool:
    return any(q.amax is not None for q in _quantizers(layout))


def layout_is_saved(layout: nn.Module) -> bool:
    """Whether a checkpoint carries this layout's amax: it is enabled or holds an amax (e.g. after fold_weight).
    The same answer on every rank (enabled flags come from the config; calibration gives every rank an amax)."""
    return layout.is_enabled or layout_has_amax(layout)


def per_expert_shape(layout: nn.Module, weight_shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Shape of ONE expert's amax in canonical form: ``()`` per tensor, ``(C,)`` per channel.

    Args:
        layout: the expert quantizer layout.
        weight_shape: one expert's (local) weight shape; needed only for an uncalibrated per-channel weight amax.

    Raises:
        ValueError: a per-channel amax was never calibrated and its channel count is unknown.
    """
    q = _quantizers(layout)[0]
    if q.axis is None:
        return ()
    if isinstance(layout, VectorizedQuantizer) and layout.amax is not None:
        return tuple(layout.amax.shape[1:])
    amax = next((p.amax for p in _quantizers(layout) if p.amax is not None), None)
    if amax is not None:
        return (amax.numel(),)
    if weight_shape is None:
        raise ValueError(f"{type(layout).__name__}: a per-channel amax (axis={q.axis}) was never calibrated and no "
                         "weight shape was given, so its shape is unknown")
    return (int(weight_shape[q.axis]),)


def native_shape(q: TensorQuantizer, pe_shape: tuple[int, ...], ndim: int | None) -> tuple[int, ...]:
    """The shape a plain TensorQuantizer (``shared``, or a ``per_expert`` child) stores its amax in."""
    if not pe_shape:
        return ()
    if q.amax is not None:
        return tuple(q.amax.shape)
    if ndim is None:
        raise ValueError(f"per-channel amax (axis={q.axis}) of unknown rank: calibrate it first")
    shape = [1] * ndim
    shape[q.axis % ndim] = pe_shape[0]
    return tuple(shape)


def canonical_amax(layout: nn.Module, num_local: int, pe_shape: tuple[int, ...],
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """This rank's amax as ``[num_local, *pe_shape]`` float32; zeros on ``device`` (where a checkpoint load will put
    the loaded values: the module's device) where there is no amax yet."""
    if isinstance(layout, VectorizedQuantizer):
        if layout.amax is None:
            return torch.zeros((num_local, *pe_shape), dtype=torch.float32, device=device)
        return layout.amax.detach().float().reshape(num_local, *pe_shape)
    qs = _quantizers(layout)
    rows = [q.amax.detach().float().reshape(pe_shape) if q.amax is not None
            else torch.zeros(pe_shape, dtype=torch.float32, device=device) for q in qs]
    if isinstance(layout, PerExpertQuantizer):
        return torch.stack([r.to(rows[0].device) for r in rows])
    return rows[0].unsqueeze(0).expand(num_local, *pe_shape).contiguous()


def native_from_canonical(layout: nn.Module, canonical: torch.Tensor,
                          ndim: int | None = None) -> dict[str, torch.Tensor]:
    """The state-dict entries (relative keys ``_amax`` / ``{i}._amax``) that give ``layout`` the amax ``canonical``.

    Args:
        layout: the target layout.
        canonical: ``[M, *pe]``: this rank's experts (``M = N``), or, for ``shared``, any set of experts (the max is
            taken over them: pass ALL global experts).
        ndim: rank of the quantized tensor (for a per-channel amax of a quantizer that holds none yet).
    """
    canonical = canonical.float()
    pe = tuple(canonical.shape[1:])
    if isinstance(layout, VectorizedQuantizer):
        if canonical.shape[0] != layout.num_experts:
            raise CheckpointMismatchError(f"expected amax for {layout.num_experts} local experts, found "
                                          f"{canonical.shape[0]}")
        return {"_amax": canonical.clone()}
    if isinstance(layout, PerExpertQuantizer):
        if canonical.shape[0] != layout.num_experts:
            raise CheckpointMismatchError(f"expected amax for {layout.num_experts} local experts, found "
                                          f"{canonical.shape[0]}")
        return {f"{i}._amax": canonical[i].reshape(native_shape(q, pe, ndim)).clone() for i, q in enumerate(layout)}
    return {"_amax": canonical.amax(dim=0).reshape(native_shape(layout, pe, ndim))}


def classify_checkpoint_amax(key: str, expected: tuple[int, ...], found: tuple[int, ...] | None, expert_axis: int,
                             ckpt_dir: str) -> str:
    """Compares an expert amax's expected global shape with the checkpoint's.

    Returns:
        ``"match"``, or ``"legacy"`` when the checkpoint has the same shape without the expert axis (saved with one
        amax per layer).

    Raises:
        CheckpointMismatchError: naming the key, the expected and the found shape (the expert count when only that
            differs), or saying the key is absent.
    """
    expected, found = tuple(expected), None if found is None else tuple(found)
    if found is None:
        raise CheckpointMismatchError(f"{key}: not in checkpoint {ckpt_dir} (expected an amax of global shape "
                                      f"{expected}); was it saved with this quantizer enabled?")
    if found == expected:
        return "match"
    if found == expected[:expert_axis] + expected[expert_axis + 1:]:
        return "legacy"
    if len(found) == len(expected) and all(f == e for i, (f, e) in enumerate(zip(found, expected, strict=True))
                                                if i != expert_axis):
        raise CheckpointMismatchError(f"{key}: expected {expected[expert_axis]} experts in checkpoint {ckpt_dir}, "
                                      f"found {found[expert_axis]} (global amax shape expected {expected}, found "
                                      f"{found})")
    raise CheckpointMismatchError(f"{key}: amax shape mismatch in checkpoint {ckpt_dir}: expected global shape "
                                  f"{expected}, found {found} (per-tensor vs per-channel amax, or another channel "
                                  f"count?)")
