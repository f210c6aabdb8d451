"""The user-facing verbs, with NVIDIA Model Optimizer 0.47's names and signatures: ``quantize``, ``calibrate``,
``set_quantizer_by_cfg``, ``set_quantizer_attributes_full`` / ``_partial`` (and the deprecated
``set_quantizer_attribute``), ``enable_quantizer`` / ``disable_quantizer``, ``postprocess_amax``,
``replace_quant_module``, ``print_quant_summary``, ``fold_weight``.

Where this package deliberately differs (a second ``quantize`` on a quantized model, for one), the error says so
and points to ``docs/modelopt_compat.md``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .calibration import as_chunks, as_forward_loop, calibrate, refuse_meta
from .chunk_names import global_name_of
from .config import ConfigError, QuantizeConfig, QuantizerAttributeConfig, to_config
from .conversion import (
    _set_attributes,
    apply_quant_cfg_entries,
    check_quantizer_shapes,
    convert,
    is_quantized,
    matching_quantizers,
    named_quantizers,
    register_framework_plugins,
    set_quantizer_by_pattern,
    unwrap_model,
    wrapper_names,
)
from .expert_quantizer import ExpertQuantizer
from .modelopt_compat import COMPAT_DOC
from .rollback import unchanged_on_error
from .smooth_experts import check_expert_mlps, expert_mlps, rescaled_expert_inputs
from .utils import is_rank0
from .weight_amax import update_weight_amax

__all__ = [
    "quantize",
    "calibrate",
    "print_quant_summary",
    "enable_quantizer",
    "disable_quantizer",
    "fold_weight",
    "set_quantizer_by_cfg",
    "set_quantizer_attributes_full",
    "set_quantizer_attributes_partial",
    "set_quantizer_attribute",
    "postprocess_amax",
    "replace_quant_module",
]


def quantize(model: nn.Module | list[nn.Module], config: QuantizeConfig | dict,
             forward_loop: Callable | None = None) -> nn.Module | list[nn.Module]:
    """Converts ``model`` in place to fake-quantized modules per ``config`` and max-calibrates it.

    All or nothing: if anything fails (an invalid config, a quantizer that cannot work on its module, a
    ``forward_loop`` that raises, an interrupt), the model is left exactly as it was before the call (module classes,
    submodules, parameters, buffers, hooks and the training mode), so the call can be retried with a fixed config.

    Args:
        model: any model whose layers have registered quantized wrappers (``nn.Linear``, grouped expert linears;
            Megatron-Core and Transformer Engine layers when the program has imported those frameworks); not yet
            quantized. Or a list of the model's chunks (Megatron's virtual pipeline stages): each is converted, and
            all are calibrated together by one ``forward_loop(chunks)`` (e.g. Megatron's interleaved schedule).
        config: a :class:`QuantizeConfig`, a dict of the same shape (also Model Optimizer's shapes), a preset such
            as ``mtq.FP8_DEFAULT_CFG``, or ``mtq.load_config("file.yaml")``.
        forward_loop: ``forward_loop(model)`` (or ``forward_loop()``) feeds calibration data; without it only
            weights are calibrated. With ``smooth_expert_inputs`` in the config it runs once more, first: the
            experts' fc2 input channels are rescaled from its statistics (exactly, by powers of two) before
            calibration.

    Returns:
        ``model`` (the same object; the same list).

    Raises:
        ConfigError: an invalid config, or quantizers that cannot work on their modules (naming them).
        TypeError: ``forward_loop`` is not callable (checked before anything is converted).
        ValueError: nothing quantizable; ``model`` is already quantized (Model Optimizer reconfigures it
            silently; here: call :func:`set_quantizer_by_cfg` and :func:`calibrate`); ``model`` is already wrapped
            (torch's or Megatron's ``DistributedDataParallel``, ``Float16Module``: quantize before wrapping); or it
            is on the meta device and the config calibrates (``algorithm`` not None); ``input_amax_update: learned``
            without a ``forward_loop`` (or without an algorithm) to calibrate the inputs; ``smooth_expert_inputs``
            without a ``forward_loop`` or an algorithm, or on experts it cannot rescale exactly (naming each layer
            and the setting). Nothing is changed then.
    """
    cfg = to_config(config)
    as_forward_loop(forward_loop)  # a bad forward_loop fails before the model changes
    _, chunks = as_chunks(model)
    if chunks is not None:
        _quantize_chunks(chunks, cfg, forward_loop)
        return model
    return _quantize_one(model, cfg, forward_loop)


def _quantize_chunks(chunks, cfg: QuantizeConfig, forward_loop) -> None:
    """:func:`quantize` of a model given as chunks: every chunk checked before any converts, all or nothing."""
    for i, chunk in enumerate(chunks):
        _check_quantizable(chunk, cfg, forward_loop, f"mtq.quantize (model chunk {i})")
    whole, _ = as_chunks(chunks)
    _check_smoothable(whole, cfg, "mtq.quantize")  # a chunk may hold no expert layer: the whole model is checked
    with contextlib.ExitStack() as stack:
        for i, chunk in enumerate(chunks):
            stack.enter_context(unchanged_on_error(chunk, f"mtq.quantize (model chunk {i})"))
        for chunk in chunks:
            convert(chunk, cfg)
        loop = as_forward_loop(forward_loop)
        with _smoothed(whole, cfg, None if loop is None else (lambda _whole: loop(chunks))):
            calibrate(chunks, cfg.max_calib if cfg.algorithm is not None else None, forward_loop)


def _quantize_one(model: nn.Module, cfg: QuantizeConfig, forward_loop) -> nn.Module:
    _check_quantizable(model, cfg, forward_loop, "mtq.quantize")
    _check_smoothable(model, cfg, "mtq.quantize")
    with unchanged_on_error(model, "mtq.quantize"):
        convert(model, cfg)
        with _smoothed(model, cfg, as_forward_loop(forward_loop)):
            return calibrate(model, cfg.max_calib if cfg.algorithm is not None else None, forward_loop)


def _smoothed(model: nn.Module, cfg: QuantizeConfig, loop):
    """The config's ``smooth_expert_inputs`` rescale of the converted model, undone bit for bit if what follows
    (calibration) fails; nothing without it. Its layers were checked before conversion (:func:`_check_smoothable`):
    conversion keeps their configs, shapes and dtypes, so they are found again, not checked again."""
    if cfg.smooth_expert_inputs is None:
        return contextlib.nullcontext()
    return rescaled_expert_inputs(model, loop, cfg.smooth_expert_inputs.alpha, mlps=expert_mlps(model),
                                  moe_calib_experts_ratio=cfg.max_calib.moe_calib_experts_ratio)


def _check_smoothable(model: nn.Module, cfg: QuantizeConfig, call: str) -> None:
    """With ``smooth_expert_inputs``: every expert layer of the whole model can be rescaled exactly, on every rank
    (one collective), before anything changes."""
    if cfg.smooth_expert_inputs is not None:
        check_expert_mlps(model, call, collective=True)


def _check_quantizable(model: nn.Module, cfg: QuantizeConfig, forward_loop, call: str) -> None:
    """:func:`quantize`'s refusals, before anything changes."""
    register_framework_plugins()  # the wrappers of the imported frameworks, for wrapper_names
    wrappers = wrapper_names(model)
    if wrappers:
        raise ValueError(
            f"{call}: the model is already wrapped in {' around '.join(wrappers)}; quantize it before wrapping: "
            "mtq.quantize(model, config, forward_loop) on the freshly built model, then wrap it and build the "
            "optimizer (a wrapper's gradient buffers and hooks, and an optimizer, built first miss what quantize "
            "adds, e.g. learned amaxes). Nothing was changed")
    if cfg.algorithm is not None:
        refuse_meta(model, call)
    if cfg.input_amax_update == "learned" and (forward_loop is None or cfg.algorithm is None):
        raise ValueError(f"{call}: input_amax_update=learned starts every input amax from its calibrated value, "
                         f"but this call calibrates none (forward_loop={forward_loop!r}, algorithm="
                         f"{cfg.algorithm!r}); pass a forward_loop and a calibration algorithm. Nothing was changed")
    if cfg.smooth_expert_inputs is not None and (forward_loop is None or cfg.algorithm is None):
        raise ValueError(f"{call}: smooth_expert_inputs={cfg.smooth_expert_inputs.model_dump()} rescales the "
                         "experts' fc2 inputs from calibration data before calibrating, but this call calibrates "
                         f"nothing (forward_loop={forward_loop!r}, algorithm={cfg.algorithm!r}); pass a "
                         "forward_loop and a calibration algorithm, or drop smooth_expert_inputs. Nothing was "
                         "changed")
    quantized = [name or "<model>" for name, m in model.named_modules() if is_quantized(m)]
    if quantized:
        raise ValueError(
            f"{call}: the model is already quantized ({len(quantized)} quantized modules, e.g. "
            f"{quantized[:3]}); a second quantize would silently replace its quantizers' settings. To change them "
            "call mtq.set_quantizer_by_cfg(model, config['quant_cfg']) and then mtq.calibrate(model, "
            f"config['algorithm'], forward_loop). See {COMPAT_DOC}#differences-from-model-optimizer")


def enable_quantizer(model: nn.Module, wildcard_or_filter_func: str | Callable[[str], bool]) -> int:
    """Enables the quantizers whose full name matches a wildcard, or for which ``filter(name)`` is true; returns
    how many."""
    return set_quantizer_by_pattern(model, wildcard_or_filter_func, True)


def disable_quantizer(model: nn.Module, wildcard_or_filter_func: str | Callable[[str], bool]) -> int:
    """Disables the quantizers whose full name matches a wildcard, or for which ``filter(name)`` is true; returns
    how many."""
    return set_quantizer_by_pattern(model, wildcard_or_filter_func, False)


def set_quantizer_by_cfg(quant_model: nn.Module, quant_cfg, strict: bool = False) -> None:
    """Applies a ``quant_cfg`` (any shape :class:`QuantizeConfig` takes) to the quantizers of a quantized model,
    in order: an entry with ``cfg`` replaces the matched quantizers' attributes, an entry with only ``enable``
    switches them; quantizers no entry matches are left alone. Amaxes are kept (re-calibrate with
    :func:`calibrate` after changing formats).

    Raises:
        ConfigError: an invalid entry, an attribute a quantizer cannot take, or (``strict``) an entry that
            matches nothing.
    """
    entries = to_config({"quant_cfg": quant_cfg}, source="<quant_cfg>").quant_cfg
    apply_quant_cfg_entries(quant_model, entries, strict)


def _attributes(value) -> QuantizerAttributeConfig:
    if isinstance(value, QuantizerAttributeConfig):
        return value
    if isinstance(value, list):
        raise ConfigError(f"a list of attribute configs is Model Optimizer's SequentialQuantizer, not supported here; "
                          f"see {COMPAT_DOC}#differences-from-model-optimizer")
    if not isinstance(value, dict):
        raise ConfigError(f"expected quantizer attributes (a QuantizerAttributeConfig or a dict), got "
                          f"{type(value).__name__}")
    return to_config({"quant_cfg": [{"quantizer_name": "*", "cfg": value}]}, source="<attributes>").quant_cfg[0].cfg


def set_quantizer_attributes_full(quant_model: nn.Module, wildcard_or_filter_func: str | Callable[[str], bool],
                                  attributes: QuantizerAttributeConfig | dict,
                                  parent_class: str | type | None = None) -> int:
    """Replaces every attribute of the selected quantizers (unspecified ones take their defaults); returns how
    many quantizers were set.

    Args:
        quant_model: a quantized model.
        wildcard_or_filter_func: a wildcard on full quantizer names, or ``filter(name) -> bool``.
        attributes: a :class:`QuantizerAttributeConfig` (or a dict of its fields).
        parent_class: only quantizers of modules of this class (a class, a class-name wildcard or a Model Optimizer
            registry name such as ``"nn.Linear"``).

    Raises:
        ConfigError: invalid attributes, or attributes a quantizer cannot take (naming it).
    """
    attrs = _attributes(attributes)
    found = matching_quantizers(quant_model, wildcard_or_filter_func, parent_class)
    for name, q, _ in found:
        _set_attributes(name, q, attrs)
    check_quantizer_shapes(quant_model)
    return len(found)


def set_quantizer_attributes_partial(quant_model: nn.Module, wildcard_or_filter_func: str | Callable[[str], bool],
                                     partial_attributes: dict[str, Any],
                                     parent_class: str | type | None = None) -> int:
    """Updates only the given attributes of the selected quantizers (``{"enable": False}``, ``{"num_bits": 4,
    "axis": 0}``); the rest are kept. Returns how many quantizers were set.

    Raises:
        ConfigError: unknown or invalid attributes, or a result a quantizer cannot take (naming it).
    """
    if isinstance(partial_attributes, list):
        _attributes(partial_attributes)  # raises: SequentialQuantizer
    if not isinstance(partial_attributes, dict):
        raise ConfigError(f"partial_attributes must be a dict of QuantizerAttributeConfig fields, got "
                          f"{type(partial_attributes).__name__}")
    unknown = sorted(set(partial_attributes) - set(QuantizerAttributeConfig.model_fields))
    if unknown:
        raise ConfigError(f"unknown quantizer attributes {unknown}; allowed: "
                          f"{sorted(QuantizerAttributeConfig.model_fields)}")
    found = matching_quantizers(quant_model, wildcard_or_filter_func, parent_class)
    for name, q, _ in found:
        if set(partial_attributes) == {"enable"}:
            q.enable() if partial_attributes["enable"] else q.disable()
        else:
            _set_attributes(name, q, dict(partial_attributes))
    check_quantizer_shapes(quant_model)
    return len(found)


def set_quantizer_attribute(quant_model: nn.Module, wildcard_or_filter_func: str | Callable[[str], bool],
                            attribute: dict[str, Any], parent_class: str | type | None = None) -> int:
    """Deprecated in Model Optimizer in favour of :func:`set_quantizer_attributes_partial`, which it calls."""
    warnings.warn("set_quantizer_attribute is deprecated, use set_quantizer_attributes_partial or "
                  "set_quantizer_attributes_full instead", DeprecationWarning, stacklevel=2)
    return set_quantizer_attributes_partial(quant_model, wildcard_or_filter_func, attribute, parent_class)


def postprocess_amax(model: nn.Module, key: str, post_process_fn: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """Replaces the amax of every quantizer whose full name matches the wildcard ``key`` by
    ``post_process_fn(amax)`` (quantizers without an amax are skipped).

    An expert quantizer whose name matches gets its whole ``[N, ...]`` amax; the per-expert entries
    ``weight_quantizer.{i}`` of the ``per_expert`` layout match on their own (each gets its ``[]`` / ``[C, 1]``
    row), but never in addition to their quantizer, so no amax is processed twice.
    """
    if not isinstance(key, str):
        raise TypeError(f"postprocess_amax: key must be a wildcard string, got {type(key).__name__}")
    done = set()
    for name, q, _ in named_quantizers(model):
        if fnmatch.fnmatchcase(name, key) and q.amax is not None:
            q.amax = post_process_fn(q.amax)
            done.add(id(q))
    for name, module in model.named_modules():
        owner = getattr(module, "owner", None)
        if isinstance(owner, ExpertQuantizer) and id(owner) not in done and fnmatch.fnmatchcase(name, key):
            if module.amax is not None:
                module.amax = post_process_fn(module.amax)
    return model


def replace_quant_module(model: nn.Module) -> nn.Module:
    """Swaps every registered module to its quantized class without applying a config: each quantizer keeps its
    default attributes (8-bit per tensor, enabled), as Model Optimizer leaves them; then use
    :func:`set_quantizer_by_cfg` and :func:`calibrate`. Prints how many quantizers were inserted (rank 0).

    Raises:
        ValueError: ``model`` is already quantized, or nothing in it is quantizable.
    """
    if any(is_quantized(m) for m in model.modules()):
        raise ValueError("replace_quant_module: the model is already quantized")
    convert(model, QuantizeConfig(), apply_rules=False)
    if is_rank0():
        print(f"Inserted {sum(1 for _ in named_quantizers(model))} quantizers", flush=True)
    return model


def fold_weight(model: nn.Module, keep_attrs: bool = False) -> nn.Module:
    """Writes each fake-quantized weight into the weight and disables its weight quantizer (for export). The
    quantizers keep their attributes and amaxes either way (``keep_attrs`` is accepted for Model Optimizer's
    signature). Dynamic weight amaxes are recomputed from the current weights first (every rank must call it
    then)."""
    del keep_attrs
    update_weight_amax(model)
    for module in model.modules():
        if is_quantized(module):
            module.fold_weight()
    return model


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 6]`` -> ``"0-2, 5-6"``."""
    spans = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _expert_amaxes(model: nn.Module) -> dict[str, tuple[bool, dict[int, tuple[float, float] | None]]]:
    """``{expert quantizer name: (enabled, {global expert: (min, max) of its amax, or None})}`` of this rank's
    experts."""
    found: dict[str, tuple[bool, dict[int, tuple[float, float] | None]]] = {}
    for mod_name, module in unwrap_model(model).named_modules():
        if not is_quantized(module):
            continue
        grid = module.expert_grid()
        for gemm in module.expert_gemms():
            base = ".".join(p for p in (mod_name, gemm.name) if p)
            for kind in ("input_quantizer", "weight_quantizer", "output_quantizer"):
                q = getattr(gemm.quantizers, kind)
                _, cells = found.setdefault(f"{base}.{kind}" if base else kind, (q.is_enabled, {}))
                for i in range(gemm.num_local):
                    a = q.expert_amax(i)
                    known = a is not None and not a.is_meta
                    cells[grid.global_index(gemm.num_local, i)] = (a.min().item(), a.max().item()) if known else None
    return found


def print_quant_summary(model: nn.Module, output_dir: str | None = None, file=None, *,
                        gather: bool = False) -> str:
    """Prints (rank 0) and returns one line per quantizer, a table of every expert quantizer's amax by GLOBAL expert
    index, and a count of enabled quantizers; with ``output_dir`` (Model Optimizer's argument) writes it to
    ``output_dir/.quant_summary.txt``.

    Safe to call from one rank (``if rank == 0: mtq.print_quant_summary(model)``): by default it enters no collective
    and, in a multi-process job, describes this rank's quantizers: an expert quantizer's line counts this rank's
    local experts, and the expert table lists them (its first line says so).

    Args:
        model: a quantized model (wrappers are fine).
        output_dir: write the summary to ``output_dir/.quant_summary.txt`` instead of printing it.
        file: where to print (``sys.stdout`` by default; ``False``: print nothing, only return the text).
        gather: a collective: every rank must call it. The summary then describes the whole model: each expert
            quantizer's line counts every rank's experts with the range of all their amaxes, the expert table
            holds every expert of every rank, and every stage's quantizers are listed once under the whole model's
            names (pipeline stages: global layer numbers; two ``all_gather_object``), the same at any tensor /
            expert / pipeline parallel layout.

    Returns:
        The summary text (on every rank).
    """
    amaxes = _expert_amaxes(model)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    gathered = gather and distributed
    whole = global_name_of(model) if gathered else (lambda name: name)  # a pipeline stage: global layer names
    if gathered:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {whole(name): v for name, v in amaxes.items()})
        amaxes = {}
        for part in parts:
            for name, (on, cells) in part.items():
                amaxes.setdefault(name, (on, {}))[1].update(cells)
    lines = [] if gathered or not distributed else [
        f"rank {dist.get_rank()}'s quantizers, with its local experts (every rank's: "
        "print_quant_summary(model, gather=True), which every rank calls)"]
    entries: list[tuple[str, bool, str]] = []
    for name, q, _ in named_quantizers(model):
        name = whole(name)
        cells = amaxes.get(name, (False, None))[1]
        if gathered and cells is not None and isinstance(q, ExpertQuantizer):  # every rank's experts, as the table
            known = [c for c in cells.values() if c is not None]
            span = (min(c[0] for c in known), max(c[1] for c in known)) if known else None
            entries.append((name, q.is_enabled, q.describe_experts(len(cells), span)))
        else:
            entries.append((name, q.is_enabled, q.extra_repr()))
    if gathered:  # every rank's quantizers (pipeline stages hold different ones), each once: this rank's line first
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, entries)
        own = {name: row for name, *row in entries}
        merged = {name: (on, text) for part in parts for name, on, text in part}
        entries = [(name, *own.get(name, row)) for name, row in merged.items()]
    enabled = sum(on for _, on, _ in entries)
    total = len(entries)
    lines += [f"{name:<80} {text}" for name, _, text in entries]
    rows = {name: cells for name, (on, cells) in amaxes.items() if on}
    if rows:
        experts = sorted({g for cells in rows.values() for g in cells})
        scope = "every rank's experts" if gathered or not distributed else f"rank {dist.get_rank()}'s local experts"
        lines.append(f"expert amax by global expert index ({scope}: {_ranges(experts)}):")
        for name, cells in rows.items():
            amax = {g: "None" if c is None else f"{c[1]:.4g}" for g, c in cells.items()}
            lines.append(f"  {name:<78} " + " ".join(f"{g}:{amax[g]}" for g in sorted(cells)))
    lines.append(f"{enabled} of {total} quantizers enabled")
    text = "\n".join(lines)
    if not is_rank0():
        return text
    if output_dir is not None:
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, ".quant_summary.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        print(f"Quant summary saved to {path}", file=file, flush=True)
    elif file is not False:
        print(text, file=file, flush=True)
    return text
