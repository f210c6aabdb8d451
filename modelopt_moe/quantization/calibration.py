"""Max calibration: weights from the weights, activations from a forward loop, amax synced across ranks.

Quantizers hold no process groups. Each quantized module says over which *named* groups (``"tp"``, ``"dp"``,
``"ep"``, ...) each of its amaxes must be max-reduced (:meth:`QuantModuleMixin.amax_reduction`); the caller passes
the groups themselves (:func:`sync_amax`), or a registered provider (the Megatron plugin) supplies them.

Every rank makes the same collectives in the same order: one flattened ``all_reduce(MAX)`` per group name,
over all quantizers in module order, with zero placeholders for amaxes this rank never saw. No collective
depends on one rank's data.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..progress import progress
from .calib.calibrator import Statistic, reduce_statistics
from .calib.max import AMAX_REDUCE_OP
from .calib.registry import calibrator_class
from .calib.routing import widened_routing
from .calib.tokens import sum_token_counts
from .config import MaxCalibConfig, normalize_algorithm
from .conversion import is_quantized, named_quantizers, own_quantizers, rule_name
from .modelopt_compat import COMPAT_DOC
from .process_groups import collective_device, default_groups, register_group_provider
from .tensor_quantizer import TensorQuantizer
from .utils import is_rank0, warn_once

__all__ = ["calibrate", "sync_amax", "register_group_provider", "default_groups", "amax_placeholder",
           "as_forward_loop", "as_chunks", "CalibrationError"]


class CalibrationError(ValueError):
    """Calibration saw data it cannot calibrate on (an infinite value gives an infinite amax: no scale at all)."""


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
    """Max-reduces every enabled quantizer's amax over the groups its module names (the max rule's reduction,
    :mod:`.calib.max`, through the calibrator seam's :func:`~.calib.calibrator.reduce_statistics`).

    Args:
        model: a converted model.
        groups: ``{name: ProcessGroup}``; a name a module asks for but ``groups`` lacks is skipped (the same on
            every rank, since the dict is the same).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    statistics = []
    for module in model.modules():
        if not is_quantized(module):
            continue
        for rel, q in own_quantizers(module):
            if not q.is_enabled:
                continue
            names = tuple(key for key in module.amax_reduction(rel)
                          if key in groups and groups[key] is not None and dist.get_world_size(groups[key]) > 1)
            if names:
                value = q.amax if q.amax is not None else amax_placeholder(q)
                statistics.append(Statistic(value, AMAX_REDUCE_OP, names, partial(_store_amax, q)))
    reduce_statistics(statistics, groups)


def _store_amax(q: TensorQuantizer, value: torch.Tensor) -> None:
    q.amax = value if q.amax is None else value.to(q.amax.device)


class _Chunks(nn.ModuleList):
    """The chunks of one model (e.g. Megatron's virtual pipeline stages) calibrated together: one ``forward_loop``
    over the list feeds all of them, as the whole model would be fed."""


def as_chunks(model) -> tuple[nn.Module, list[nn.Module] | tuple[nn.Module, ...] | None]:
    """``(module, chunks)``: a list of model chunks as one module holding them (and the list itself), a model as
    itself (and None).

    Raises:
        TypeError: an empty list, or a list holding something other than modules (names its index and type).
    """
    if not isinstance(model, list | tuple):
        return model, None
    if not model:
        raise TypeError("expected a model or a non-empty list of model chunks, got an empty list")
    for i, chunk in enumerate(model):
        if not isinstance(chunk, nn.Module):
            raise TypeError(f"model chunk {i} is a {type(chunk).__name__}, expected a torch.nn.Module")
    return _Chunks(model), model


class _ForwardCounter:
    """Progress on rank 0 counting forward calls, shown once calibration runs longer than 2 s: a bar on a terminal,
    a line every 30 s in a log (:func:`modelopt_moe.progress.progress`)."""

    def __init__(self, model: nn.Module):
        self.model, self.bar, self.handle = (model[0] if isinstance(model, _Chunks) else model), None, None

    def __enter__(self):
        if is_rank0():
            self.bar = progress(None, "calibrating", unit="batches", delay=2.0, leave=False)
            self.handle = self.model.register_forward_hook(self._count)
        return self

    def _count(self, module, args, output) -> None:
        # A forward hook that returns anything but None replaces the module's output (tqdm.update returns True
        # whenever it redraws), so the return value is dropped here.
        self.bar.update(1)

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()
        if self.bar is not None:
            self.bar.close()


def as_forward_loop(forward_loop) -> Callable[[nn.Module], object] | None:
    """``forward_loop`` as a function of the model: Model Optimizer also takes one with no argument (it warns that
    this is deprecated there; both are fine here).

    Raises:
        TypeError: ``forward_loop`` is neither None nor callable (e.g. a list of batches), or takes more than one
            required argument.
    """
    if forward_loop is None:
        return None
    if not callable(forward_loop):
        raise TypeError(f"forward_loop must be a callable forward_loop(model) that runs calibration data through "
                        f"the model, got a {type(forward_loop).__name__}; for a list of batches write "
                        "forward_loop=lambda model: [model(batch) for batch in batches]")
    try:
        params = inspect.signature(forward_loop).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: assume forward_loop(model)
        return forward_loop
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if not positional and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return lambda model: forward_loop()
    if len(required) > 1:
        raise TypeError(f"forward_loop must take the model (or nothing), but it requires {len(required)} arguments "
                        f"{[p.name for p in required]}")
    return forward_loop


def _needs_activation_data(quantizers) -> bool:
    return any(not _is_weight_quantizer(n) and not q.is_dynamic for n, q in quantizers)


def refuse_meta(model: nn.Module, call: str) -> None:
    """Calibration reads the weights and runs data through them: on the meta device it would compute nothing, and
    the amaxes would be garbage once the model is materialised.

    Raises:
        ValueError: a parameter or buffer is on the meta device (naming it and the fix).
    """
    on_meta = next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(
            f"{call}: {on_meta} is on the meta device; calibration needs the real weights (and data). Materialise "
            "the model first (model.to_empty(device=...), then load its weights), or quantize without calibrating "
            "(the config's 'algorithm': None) and call mtq.calibrate once it is materialised. To restore a quantized "
            "checkpoint into a model on the meta device, use modelopt_moe.checkpoint.restore_sharded_modelopt_state "
            "(Megatron) or restore_from_modelopt_state. Nothing was changed")


def calibrate(model: nn.Module, algorithm: str | dict | MaxCalibConfig | None = "max",
              forward_loop: Callable | None = None, groups: dict | None = None) -> nn.Module:
    """Calibrates every enabled quantizer of a converted model with a registered calibration algorithm
    (:mod:`.calib`: ``max``, ``mse``, ``histogram``).

    Every algorithm starts from max calibration: weight amaxes come from the weights themselves; activation amaxes
    from ``forward_loop(model)`` (with ``moe_calib_experts_ratio``, MoE layers route each token to more experts
    while calibrating, :mod:`.calib.routing`); then amaxes are max-reduced over the parallel groups (``groups``, or
    the registered provider's) and modules finalize (e.g. experts that saw no tokens take the shared input amax).
    Then the algorithm refines (``mse``: each weight amax searched on a grid of multipliers, its errors summed
    across the weight's shards; ``histogram``: activation amaxes from histograms of a second ``forward_loop`` pass,
    summed across ranks). Dynamic quantizers (``type: dynamic``) are left alone: their amax comes from each
    tensor.

    If ``forward_loop`` raises, every quantizer is put back as it was before this call (amaxes, calibration and
    quantization switches) and the exception propagates with a note saying so; the model is in eval mode or
    training mode as before. (Inside :func:`mtq.quantize` the whole conversion is undone as well.)

    Args:
        model: a model converted by :func:`mtq.quantize`, or a list of its chunks (Megatron's virtual pipeline
            stages), calibrated together: ``forward_loop`` gets the list and feeds every chunk in one pass.
        algorithm: ``"max"``, ``"mse"``, ``"histogram"``, ``{"method": ..., ...}`` (the method's options:
            :class:`MaxCalibConfig`'s ``distributed_sync``, ``skip_forward_without_activation_calib``,
            ``moe_calib_experts_ratio``; for ``mse`` also :class:`~.config_schema.MseCalibConfig`'s grid, for
            ``histogram`` :class:`~.config_schema.HistogramCalibConfig`'s rule and bins), or None to skip
            calibration.
        forward_loop: ``forward_loop(model)`` (or ``forward_loop()``) runs calibration data through the model.
        groups: ``{name: ProcessGroup}`` for the reductions across ranks.

    Raises:
        ValueError: a method no calibrator is registered for, or an invalid option (naming it); a model on the
            meta device (naming a tensor there).
        TypeError: a ``forward_loop`` that is not callable.
    """
    options = normalize_algorithm(algorithm)
    loop = as_forward_loop(forward_loop)
    if options is None:
        return model
    given = model
    model, chunks = as_chunks(model)
    if chunks is not None and loop is not None:
        user_loop = loop
        loop = lambda _chunks: user_loop(chunks)  # noqa: E731 - the user's loop takes the list it was given
    refuse_meta(model, "mtq.calibrate")
    calibrator = calibrator_class(options.method)(options)
    quantizers = [(name, q) for name, q, _ in named_quantizers(model) if q.is_enabled]
    for name, q in quantizers:
        if getattr(q, "static_block_scales", False) and not _is_weight_quantizer(name):
            raise ValueError(f"mtq.calibrate: {name} has static block scales (block_sizes.type: static), which are "
                             "calibrated on a weight; activations take block scales from the data "
                             "(block_sizes.type: dynamic)")
    saved = [(q, q.calibration_snapshot()) for _, q in quantizers]
    modes = [(m, m.training) for m in (chunks or [model])]
    model.eval()  # as Model Optimizer calibrates: no dropout, inference-mode routing; the mode is restored after
    try:
        _collect(model, quantizers, loop, options)
    except BaseException as e:
        for q, snapshot in saved:
            q.restore_calibration_snapshot(snapshot)
        if hasattr(e, "add_note"):
            e.add_note(f"mtq.calibrate: calibration failed; every quantizer is back in its state before this call "
                       f"(amaxes, calibration and quantization switches; see {COMPAT_DOC}#after-a-failure)")
        raise
    finally:
        for m, training in modes:
            m.train(training)
    groups = default_groups() if groups is None else groups
    sync = options.distributed_sync is not False
    if sync:
        sync_amax(model, groups)
        sum_token_counts(model, groups)
    unseen = []
    for name, module in model.named_modules():
        if is_quantized(module):
            unseen += [f"{name}.{note}" for note in module.finalize_calibration(groups)]
    if unseen:
        warn_once("calibrate: these experts (global indices) saw no calibration tokens on any rank and use the "
                  "shared input amax (max over all experts):\n  " + "\n  ".join(unseen))
    try:
        _check_finite(quantizers, collective=sync and bool(groups))
    except CalibrationError:
        for q, snapshot in saved:
            q.restore_calibration_snapshot(snapshot)
        raise
    try:
        calibrator.refine(model, groups if sync else {}, loop,
                          lambda: widened_routing(model, options.moe_calib_experts_ratio))
    except BaseException:
        for q, snapshot in saved:
            q.restore_calibration_snapshot(snapshot)
        raise
    return given


def _check_finite(quantizers, collective: bool) -> None:
    """Refuses an infinite amax and warns once (rank 0) about NaN, naming the quantizers and what they saw.

    With ``collective`` (a synchronised calibration in a process group), every rank adds its counts to one
    ``all_reduce`` over the world, whatever its data, so that all ranks raise or none does.

    Raises:
        CalibrationError: some rank's calibration data or weights held an Inf (its amax is infinite).
    """
    # Per quantizer: [NaN seen, Inf seen, non-finite amax entries] (read once, after the pass).
    rows = [(*q.calib_nonfinite, 0 if q.amax is None else int((~torch.isfinite(q.amax.detach())).sum()))
            for _, q in quantizers]
    totals = torch.tensor([sum(column) for column in zip(*rows, strict=True)] if rows else [0, 0, 0])
    if collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flat = totals.to(collective_device(None))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        totals = flat.cpu()
    nan_total, inf_total, bad_total = totals.tolist()
    if not (nan_total or inf_total or bad_total):
        return
    where = " on all ranks" if collective and dist.is_initialized() and dist.get_world_size() > 1 else ""
    lines = [f"{name}: {nan} NaN, {inf} Inf seen" + (f"; amax {_amax_text(q.amax)}" if bad else "")
             + (" (max-reduced from another rank)" if bad and not inf else "")
             for (name, q), (nan, inf, bad) in zip(quantizers, rows, strict=True) if nan or inf or bad]
    listing = ("\n  " + "\n  ".join(lines)) if lines else " (none of them on this rank)"
    if inf_total or bad_total:
        raise CalibrationError(
            f"mtq.calibrate: the calibration data (or weights) held {inf_total} infinite and {nan_total} NaN "
            f"values{where}; an infinite amax gives a scale of 1, i.e. no calibration. Quantizers that saw them"
            f"{' on this rank' if where else ''}:{listing}\nFind where the model overflows (e.g. run the "
            "forward_loop without quantization and check each layer's output with torch.isfinite), or feed "
            "other batches; every quantizer is back in its state before this call")
    warn_once(f"mtq.calibrate: the calibration data held {nan_total} NaN values{where}, which the amax ignores (it "
              f"is the max of the finite values); a model that makes NaN will not train. Quantizers that saw them"
              f"{' on this rank' if where else ''}:{listing}")


def _amax_text(amax: torch.Tensor) -> str:
    a = amax.detach().float().reshape(-1)
    return f"{a.item()}" if a.numel() == 1 else f"{(~torch.isfinite(a)).sum().item()} of {a.numel()} entries non-finite"


def _collect(model: nn.Module, quantizers, loop, options: MaxCalibConfig) -> None:
    """The local part of max calibration: weights from themselves, activations from ``loop``."""
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
            if getattr(q, "calibrated_rows", None) is not None:
                q.calibrated_rows = None  # rows of weights: the counts are of calibration tokens
    needs_data = _needs_activation_data(quantizers)
    if loop is not None and (needs_data or not options.skip_forward_without_activation_calib):
        with _ForwardCounter(model), torch.no_grad(), widened_routing(model, options.moe_calib_experts_ratio):
            loop(model)
    elif loop is None and needs_data:
        warn_once("calibrate: no forward_loop given; activation quantizers keep no amax and will use the amax of "
                  "each tensor they see (dynamic)")
    for _, q in quantizers:
        q.disable_calib()
        q.enable_quant()
