"""Module conversion: ``convert`` swaps every registered module to its quantized class and applies a config's rules.

The class registry and the quantized-module mixin live in :mod:`.quant_module` (re-exported here). Classes enter the
registry through ONE explicit call, :func:`register_framework_plugins`, which :func:`convert` (so ``mtq.quantize`` and
every restore) makes: it registers the framework-free wrappers (``quantization/nn``) and the plugin of every framework
the program has imported, the same way (each has a ``register()``); every registry lookup makes it first. The core
finds the framework plugins through the package's entry points (group :data:`PLUGIN_ENTRY_POINTS`), never by
importing ``modelopt_moe.plugins``; importing this package imports no framework and registers nothing.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from collections.abc import Callable
from importlib import metadata

import torch
from torch import nn

from ..numerics import get_format
from . import nn as framework_free
from .block_checks import block_2d_problems
from .config import ConfigError, QuantCfgEntry, QuantizeConfig, QuantizerAttributeConfig
from .quant_module import (  # noqa: F401  _rebuild_quantized: the name pickles of quantized modules reference
    QuantModuleMixin,
    QuantModuleRegistry,
    _rebuild_quantized,
    is_quantized,
    named_quantizers,
    own_quantizers,
    parent_class_names,
    quantized_class,
    register_wrapper,
    rule_name,
    unwrap_model,
    wrapper_names,
)
from .tensor_quantizer import TensorQuantizer
from .utils import warn_once
from .weight_operands import set_weight_amax_update

__all__ = [
    "QuantModuleRegistry",
    "QuantModuleMixin",
    "PLUGIN_ENTRY_POINTS",
    "register_framework_plugins",
    "register_wrapper",
    "unwrap_model",
    "wrapper_names",
    "convert",
    "is_quantized",
    "named_quantizers",
    "own_quantizers",
    "apply_quant_cfg",
    "apply_quant_cfg_entries",
    "rule_name",
    "set_quantizer_by_pattern",
    "matching_quantizers",
    "parent_class_names",
]

# The entry-point group through which the core finds framework plugins (pyproject.toml declares modelopt_moe's own):
# each entry is a function ``register(require=None) -> list[str]`` that registers the plugins of the frameworks the
# program has imported (and those named in ``require``) and returns the names registered so far.
PLUGIN_ENTRY_POINTS = "modelopt_moe.plugins"


@functools.cache
def _plugin_registrars() -> tuple[Callable, ...]:
    entries = sorted(metadata.entry_points(group=PLUGIN_ENTRY_POINTS), key=lambda e: e.name)
    if not entries:
        raise RuntimeError(f"modelopt_moe: no framework plugins found in the installed package metadata (entry-point "
                           f"group {PLUGIN_ENTRY_POINTS!r}); the installation is incomplete or out of date: reinstall "
                           "modelopt_moe (pip install -e . in a source checkout)")
    return tuple(entry.load() for entry in entries)


def register_framework_plugins(require: str | tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Registers the framework-free wrappers (``nn.Linear``, ``GroupedLinear``) and the quantized classes (and
    parallel groups, export adapters) of every framework the program has imported; ``require`` names plugins to
    import and register even if their framework is not imported yet.

    The core's one registration call: made by :func:`convert` (``mtq.quantize``, every restore) and by
    :mod:`modelopt_moe.export` (``require="megatron"`` for ``build_megatron_model``, which has no model yet to tell
    the framework). Idempotent and cheap. A plugin imports its framework; the core never does.

    Args:
        require: plugin name(s) (``"megatron"``, ``"transformer_engine"``, ``"megatron.te_experts"``).

    Returns:
        The names of the registered framework plugins.

    Raises:
        ValueError: an unknown plugin name. ImportError: a required plugin's framework is not installed.
        RuntimeError: the installed package metadata lists no plugins (an incomplete installation).
    """
    framework_free.register()
    names: set[str] = set()
    for register in _plugin_registrars():
        names.update(register(require=require))
    return sorted(names)


QuantModuleRegistry.resolve_with(register_framework_plugins)  # lookups see what the call registers (no call here)


def convert(model: nn.Module, config: QuantizeConfig, apply_rules: bool = True) -> list[str]:
    """Swaps every registered module to its quantized class and applies ``config``.

    Args:
        model: the model, converted in place.
        config: the rules, expert layouts, backward mode and kernel choice.
        apply_rules: apply ``config.quant_cfg`` (False: every quantizer keeps its default attributes, 8-bit per
            tensor and enabled, as Model Optimizer's ``replace_quant_module`` leaves them).

    Returns:
        Names of the converted modules.

    Raises:
        ValueError: nothing in ``model`` is quantizable.
        ConfigError: a quantizer's attributes cannot work on its module (naming the module, the format and shape).
    """
    register_framework_plugins()
    converted = []
    for name, module in list(model.named_modules()):
        mixin = QuantModuleRegistry.mixin_for(type(module))
        if mixin is None:
            continue
        module.__class__ = quantized_class(type(module), mixin)
        module._setup(config)
        converted.append(name)
    for module in model.modules():
        if is_quantized(module):
            module._after_convert()
    if not converted and not any(is_quantized(m) for m in model.modules()):
        kinds = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"quantize: nothing quantizable in {type(model).__name__}; registered classes are "
            f"{sorted(c.__name__ for c in QuantModuleRegistry.registered())} (is the plugin for your framework "
            "imported?), "
            f"the model has {kinds}"
        )
    if apply_rules:
        apply_quant_cfg(model, config)
    return converted


def _set_attributes(full_name: str, q: TensorQuantizer, attrs, ste: str | None = None) -> None:
    """``q.set_from_attribute_config(attrs)``; an attribute set the quantizer cannot take is a ConfigError naming
    the quantizer."""
    try:
        q.set_from_attribute_config(attrs)
    except ValueError as e:
        raise ConfigError(f"{full_name}: {e}") from None
    cfg = q.cfg
    if ste is not None:
        q.ste = "clipped" if ste == "clipped" or not cfg.pass_through_bwd else "pass_through"
    elif not cfg.pass_through_bwd:
        q.ste = "clipped"


def apply_quant_cfg(model: nn.Module, config: QuantizeConfig) -> None:
    """Applies the ``quant_cfg`` rules to every quantizer; a quantizer no rule names is disabled. A rule that
    configures quantizers but matches none warns on rank 0 with the closest names (a ConfigError with
    ``config.strict``); then the quantizers are checked against their modules' shapes.

    Raises:
        ConfigError: an attribute a quantizer cannot take, a format its module's shapes cannot take (both naming
            the quantizer), or (``strict``) a rule that matches nothing.
    """
    found = list(named_quantizers(model))
    report_unmatched_entries(config.quant_cfg, found, config.strict)
    for full_name, q, module in found:
        attrs = config.resolve(rule_name(full_name), parent_class_names(module))
        _set_attributes(full_name, q, attrs if attrs is not None else QuantizerAttributeConfig(enable=False),
                        config.backward.ste)
        if isinstance(q, TensorQuantizer):  # an expert's view follows its quantizer
            q.kernel = config.kernel
    for full_name, q, module in found:
        rule = rule_name(full_name)
        mode = config.weight_amax_update if rule.endswith("weight_quantizer") else (
            config.input_amax_update if rule.endswith("input_quantizer") else "static")
        set_weight_amax_update(full_name, q, module, mode)
    for module in model.modules():
        if is_quantized(module):
            module.quant_backward = config.backward.model_copy()
            module.quant_kernel = config.kernel
            module.quant_gemm = config.gemm
            module.quant_autoswitch = config.autoswitch.model_copy() if config.autoswitch else None
    check_quantizer_shapes(model)


def apply_quant_cfg_entries(model: nn.Module, entries: list[QuantCfgEntry], strict: bool = False) -> None:
    """Model Optimizer's ``set_quantizer_by_cfg``: applies ``entries`` in order to the quantizers they match and
    leaves the others alone. An entry with ``cfg`` replaces the matched quantizers' attributes (enabled unless it
    says ``enable: false``); an entry with only ``enable`` switches them on or off and keeps their format.

    Raises:
        ConfigError: as :func:`apply_quant_cfg`.
    """
    found = list(named_quantizers(model))
    report_unmatched_entries(entries, found, strict)
    for entry in entries:
        for full_name, q, module in found:
            if not entry.matches(rule_name(full_name), parent_class_names(module)):
                continue
            if entry.cfg is not None:
                attrs = entry.cfg if entry.enable is None else entry.cfg.model_copy(update={"enable": entry.enable})
                _set_attributes(full_name, q, attrs)
            elif entry.enable is not None:
                q.enable() if entry.enable else q.disable()
    check_quantizer_shapes(model)


def _closest_names(pattern: str, names: list[str], n: int = 3) -> list[str]:
    """Quantizer names closest to a wildcard ``pattern``: its literal text compared with every dotted suffix of
    every name (``*wieght_quantizer`` finds ``...fc1.weight_quantizer``)."""
    literal = pattern.replace("*", "").replace("?", "").strip(".")
    by_suffix: dict[str, str] = {}
    for name in names:
        parts = name.split(".")
        for i in range(len(parts)):
            by_suffix.setdefault(".".join(parts[i:]), name)
    hits = difflib.get_close_matches(literal, list(by_suffix), n=n * 4, cutoff=0.6)
    out = list(dict.fromkeys(by_suffix[h] for h in hits))
    return out[:n] or names[:n]


def report_unmatched_entries(entries: list[QuantCfgEntry], found, strict: bool) -> list[str]:
    """Names every entry that configures quantizers (``cfg``, or ``enable: true``) but matches none of ``found``
    (``(name, quantizer, module)``): a warning on rank 0, or a ConfigError when ``strict``. Entries that only
    disable are exclusion lists written for many model families (Model Optimizer's presets) and are not reported.
    Returns the messages."""
    names = [rule_name(n) for n, _, _ in found]
    parents = [parent_class_names(m) for _, _, m in found]
    messages = []
    for i, entry in enumerate(entries):
        if not entry.configures:
            continue
        if any(entry.matches(n, p) for n, p in zip(names, parents, strict=True)):
            continue
        by_name = [n for n in names if fnmatch.fnmatchcase(n, entry.quantizer_name)]
        if by_name:
            seen = sorted({p[0] for n, p in zip(names, parents, strict=True) if n in by_name})
            messages.append(f"quant_cfg.{i}: quantizer_name {entry.quantizer_name!r} matches {len(by_name)} "
                            f"quantizers but parent_class {entry.parent_class!r} none of their modules ({seen})")
        else:
            close = _closest_names(entry.quantizer_name, sorted(set(names)))
            messages.append(f"quant_cfg.{i}: quantizer_name {entry.quantizer_name!r} matches no quantizer; closest "
                            f"names: {close}")
    if messages:
        text = "\n  ".join(messages)
        if strict:
            raise ConfigError(f"quant_cfg entries that match nothing (strict: true):\n  {text}")
        warn_once(f"quant_cfg entries that match nothing (they quantize nothing; set strict: true to make this an "
                  f"error):\n  {text}")
    return messages


def _shape_targets(name: str, module: nn.Module) -> list[tuple[str, nn.Module, tuple[int, ...], tuple | None]]:
    """``(quantizer prefix, holder of the quantizers, weight shape, (split axis, TP size) or None)`` of a quantized
    module's GEMMs."""
    gemms = module.expert_gemms()
    if gemms:
        etp = module.expert_grid().etp_size
        return [(".".join(p for p in (name, g.name) if p), g.quantizers, tuple(g.weight_shape), (g.sharded_axis, etp))
                for g in gemms if g.weight_shape]
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() >= 1 and "weight_quantizer" in module._modules:
        return [(name, module, tuple(weight.shape), module.tensor_split())]
    return []


def _input_dim_parts(split: tuple[int, int] | None, wshape: tuple[int, ...]) -> int:
    """Into how many tensor-parallel parts the weight's input dim (its last) is split: the TP size where the module
    is row-parallel, else 1."""
    if split is None or split[0] % len(wshape) != len(wshape) - 1:
        return 1
    return split[1]


def _cut_blocks(full: str, spec, dim: int, parts: int, wshape) -> list[str]:
    """Padded blocks (MX) of an input dim split over ``parts`` tensor-parallel ranks: a block cut by the split would
    make the result depend on the TP size (each rank pads its own part)."""
    if parts <= 1 or dim % spec.block_length == 0:
        return []
    total, b = dim * parts, spec.block_length
    works = [t for t in range(1, total + 1) if total % t == 0 and (total // t) % b == 0 and t & (t - 1) == 0]
    return [f"{full}: {spec.label} quantizes blocks of {b} along the input dim, which tensor parallelism splits into "
            f"{parts} parts of {dim} of {total} here (weight shape {wshape}, TP {parts}): a block would be cut and the "
            f"result would depend on the TP size; use TP in {works} for this model, or another format for this "
            "module"]


def check_quantizer_shapes(model: nn.Module) -> None:
    """What cannot work, found when quantizers are configured rather than at the first forward: an NVFP4 quantizer
    on a tensor whose last dim is not a multiple of 16 (int blocks are zero-padded instead), an MX block cut by the
    tensor-parallel split of an input dim, a per-channel axis outside the weight's dims.

    Raises:
        ConfigError: naming each quantizer, its format and the module's shape.
    """
    problems = []
    for name, module in model.named_modules():
        if not is_quantized(module):
            continue
        for prefix, holder, wshape, split in _shape_targets(name, module):
            # Last dims: the weight's; the input's is the weight's input features, the output's its output ones.
            last = {"weight_quantizer": wshape[-1], "input_quantizer": wshape[-1],
                    "output_quantizer": wshape[0] if len(wshape) > 1 else wshape[-1]}
            for kind, dim in last.items():
                q = getattr(holder, kind, None)
                if not isinstance(q, TensorQuantizer) or not q.is_enabled:
                    continue
                full = f"{prefix}.{kind}" if prefix else kind
                spec = get_format(q.fmt)
                if spec.block_length is not None and dim % spec.block_length and not spec.pads:
                    problems.append(f"{full}: {spec.label} quantizes blocks of {spec.block_length} along the last "
                                    f"dim, which is {dim} here (weight shape {wshape}); use another format for this "
                                    "module or disable it")
                elif spec.pads and kind != "output_quantizer":
                    problems += _cut_blocks(full, spec, dim, _input_dim_parts(split, wshape), wshape)
                if q.cfg.block_2d is not None:
                    problems += block_2d_problems(full, kind, q.cfg.block_2d, wshape, split)
                axes = q.axis if isinstance(q.axis, tuple) else () if q.axis is None else (q.axis,)
                if kind == "weight_quantizer" and any(not -len(wshape) <= a < len(wshape) for a in axes):
                    problems.append(f"{full}: axis={q.axis} is outside the weight's {len(wshape)} dims "
                                    f"(shape {wshape})")
    if problems:
        raise ConfigError("quantizers that cannot work on their modules:\n  " + "\n  ".join(problems))


def matching_quantizers(model: nn.Module, wildcard_or_filter: str | Callable[[str], bool],
                        parent_class: str | type | None = None) -> list[tuple[str, TensorQuantizer, nn.Module]]:
    """``(full name, quantizer, module)`` of the quantizers a wildcard (matched against the full name, or the name
    a per-expert view's rules use) or a filter function ``f(full_name) -> bool`` selects, optionally only those
    whose module is a ``parent_class`` (a class, a class-name wildcard or a Model Optimizer registry name).

    Raises:
        TypeError: neither a string nor a callable.
    """
    if isinstance(wildcard_or_filter, str):
        def selected(name: str) -> bool:
            return fnmatch.fnmatchcase(name, wildcard_or_filter) or fnmatch.fnmatchcase(rule_name(name),
                                                                                        wildcard_or_filter)
    elif callable(wildcard_or_filter):
        selected = wildcard_or_filter
    else:
        raise TypeError(f"expected a wildcard string or a filter function name -> bool, got "
                        f"{type(wildcard_or_filter).__name__}")
    out = []
    for name, q, module in named_quantizers(model):
        if not selected(name):
            continue
        if parent_class is not None:
            if isinstance(parent_class, type):
                if not isinstance(module, parent_class):
                    continue
            elif not QuantCfgEntry(quantizer_name="*", parent_class=parent_class, enable=True).matches(
                    name, parent_class_names(module)):
                continue
        out.append((name, q, module))
    return out


def set_quantizer_by_pattern(model: nn.Module, pattern: str | Callable[[str], bool], enable: bool) -> int:
    """Enables or disables every quantizer whose full name matches ``pattern`` (a wildcard, or a filter function
    ``f(full_name) -> bool``); returns how many matched."""
    found = matching_quantizers(model, pattern)
    for _, q, _ in found:
        q.enable() if enable else q.disable()
    return len(found)
