"""Max calibration: weights from the weights, activations from a forward loop, amax synced across ranks.

Quantizers hold no process groups. Each quantized module says over which *named* groups (``"tp"``, ``"dp"``,
``"ep"``, ...) each of its amaxes must be max-reduced (:meth:`QuantModuleMixin.amax_reduction`); the caller passes
the groups themselves (:func:`sync_amax`), or a registered provider (the Megatron plugin) supplies them.

Every rank makes the same collectives in the same order: one flattened ``all_reduce(MAX)`` per group name,
over all quantizers in module order, with zero placeholders for amaxes this rank never saw. No collective
depends on one rank's data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .conversion import is_quantized, named_quantizers, rule_name
from .tensor_quantizer import TensorQuantizer
from .utils import is_rank0, warn_once

__all__ = ["calibrate", "sync_amax", "register_group_provider", "default_groups", "amax_placeholder"]

_GROUP_PROVIDERS: list[Callable[[], dict | None]] = []


def register_group_provider(fn: Callable[[], dict | None]) -> None:
    """Registers ``fn() -> {name: ProcessGroup} | None`` consulted when no groups are passed (plugins do this)."""
    if fn not in _GROUP_PROVIDERS:
        _GROUP_PROVIDERS.append(fn)


def default_groups() -> dict:
    """The groups of the first provider that has some (e.g. Megatron's parallel_state), else ``{}``."""
    for fn in _GROUP_PROVIDERS:
        groups = fn()
        if groups:
            return groups
    return {}


def _is_weight_quantizer(full_name: str) -> bool:
    return rule_name(full_name).endswith("weight_quantizer")


def amax_placeholder(q: TensorQuantizer) -> torch.Tensor:
    """Zeros shaped like ``q``'s amax would be, for a rank whose quantizer saw no data."""
    shape = q.amax_shape
    if shape is None:
        raise ValueError(f"{q}: a per-channel amax (axis={q.axis}) was never calibrated on this rank, so its "
                         "shape is unknown; every rank must run data through every per-channel quantizer")
    return torch.zeros(shape, dtype=torch.float32)


def sync_amax(model: nn.Module, groups: dict) -> None:
    """Max-reduces every enabled quantizer's amax over the groups its module names.

    Args:
        model: a converted model.
        groups: ``{name: ProcessGroup}``; a name a module asks for but ``groups`` lacks is skipped (the same on
            every rank, since the dict is the same).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    by_group: dict[str, list[TensorQuantizer]] = {}
    for module in model.modules():
        if not is_quantized(module):
            continue
        for rel, q in module.named_modules():
            if not isinstance(q, TensorQuantizer) or not q.is_enabled:
                continue
            for key in module.amax_reduction(rel):
                if key in groups and groups[key] is not None and dist.get_world_size(groups[key]) > 1:
                    by_group.setdefault(key, []).append(q)
    for key in sorted(by_group):
        quantizers = by_group[key]
        values = [q.amax if q.amax is not None else amax_placeholder(q) for q in quantizers]
        flat = torch.cat([v.detach().float().reshape(-1).cpu() for v in values])
        device = _collective_device(groups[key])
        flat = flat.to(device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=groups[key])
        offset = 0
        for q, v in zip(quantizers, values, strict=True):
            n = v.numel()
            q.amax = flat[offset:offset + n].reshape(v.shape).to(v.device if q.amax is None else q.amax.device)
            offset += n


def _collective_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class _ForwardCounter:
    """A tqdm bar on rank 0 counting forward calls; it appears only once calibration runs longer than 2 s."""

    def __init__(self, model: nn.Module):
        self.model, self.bar, self.handle = model, None, None

    def __enter__(self):
        if is_rank0():
            from tqdm.auto import tqdm

            self.bar = tqdm(desc="calibrating", unit="batch", delay=2.0, leave=False)
            self.handle = self.model.register_forward_hook(lambda *_: self.bar.update(1))
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()
        if self.bar is not None:
            self.bar.close()


def calibrate(model: nn.Module, algorithm: str | None = "max", forward_loop: Callable | None = None,
              groups: dict | None = None) -> nn.Module:
    """Max-calibrates every enabled quantizer of a converted model.

    Weight amaxes come from the weights themselves; activation amaxes from ``forward_loop(model)``; then amaxes are
    max-reduced over the parallel groups (``groups``, or the registered provider's) and modules finalize
    (e.g. experts that saw no tokens take the shared input amax).

    Args:
        model: a model converted by :func:`mtq.quantize`.
        algorithm: ``"max"`` (or None to skip calibration).
        forward_loop: ``forward_loop(model)`` runs calibration data through the model.
        groups: ``{name: ProcessGroup}`` for the amax reduction.

    Raises:
        ValueError: unknown algorithm.
    """
    if algorithm is None:
        return model
    if algorithm != "max":
        raise ValueError(f"calibrate: unknown algorithm {algorithm!r}; expected 'max'")
    quantizers = [(name, q) for name, q, _ in named_quantizers(model) if q.is_enabled]
    for _, q in quantizers:
        q.reset_amax()
        q.disable_quant()
        q.enable_calib()
    with torch.no_grad():
        for module in model.modules():
            if is_quantized(module):
                module.calibrate_weights()
    for name, q in quantizers:
        if _is_weight_quantizer(name):
            q.disable_calib()  # already calibrated from the weights
    if forward_loop is not None:
        with _ForwardCounter(model), torch.no_grad():
            forward_loop(model)
    elif any(not _is_weight_quantizer(n) for n, _ in quantizers):
        warn_once("calibrate: no forward_loop given; activation quantizers keep no amax and will use the amax of "
                  "each tensor they see (dynamic)")
    for _, q in quantizers:
        q.disable_calib()
        q.enable_quant()
    groups = default_groups() if groups is None else groups
    sync_amax(model, groups)
    unseen = []
    for name, module in model.named_modules():
        if is_quantized(module):
            unseen += [f"{name}.{note}" for note in module.finalize_calibration(groups)]
    if unseen:
        warn_once("calibrate: these experts (global indices) saw no calibration tokens on any rank and use the "
                  "shared input amax (max over all experts):\n  " + "\n  ".join(unseen))
    return model
