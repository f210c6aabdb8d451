"""Module conversion: a registry maps a module class to its quantized mixin; ``convert`` swaps classes in place.

The quantized class of ``Foo`` is ``QuantFoo(FooMixin, Foo)``, created once and cached. Swapping ``__class__``
keeps every parameter, buffer and attribute of the original module (and the state-dict keys), so a model converts
without copying weights. Such classes are created at run time, so quantized modules pickle through
:func:`_rebuild_quantized`, which re-creates the class from the original class and the mixin.

Framework plugins (``modelopt_moe.plugins``: Megatron-Core, Transformer Engine) add their classes through ONE explicit
call, :func:`register_framework_plugins`, which :func:`convert` (so ``mtq.quantize`` and every restore) and registry
lookups make: it registers the plugin of every framework the program has imported. Importing this package imports
no framework.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator

import torch
from torch import nn

from .config import QuantizeConfig, QuantizerAttributeConfig
from .expert_quantizer import ExpertGemm, ExpertGrid
from .tensor_quantizer import TensorQuantizer

__all__ = [
    "QuantModuleRegistry",
    "QuantModuleMixin",
    "register_framework_plugins",
    "register_wrapper",
    "unwrap_model",
    "convert",
    "is_quantized",
    "named_quantizers",
    "apply_quant_cfg",
    "rule_name",
    "set_quantizer_by_pattern",
]


class QuantModuleMixin:
    """Base of every quantized wrapper. It declares every hook the core calls; subclasses override what applies."""

    _original_cls: type
    _mixin_cls: type

    def _setup_quantizers(self, config: QuantizeConfig) -> None:
        """Creates this module's quantizers (plain modules: input, weight and output)."""
        self.input_quantizer = TensorQuantizer()
        self.weight_quantizer = TensorQuantizer()
        self.output_quantizer = TensorQuantizer()

    def _setup(self, config: QuantizeConfig) -> None:
        self.quant_backward = config.backward.model_copy()
        self.quant_kernel = config.kernel
        self.quant_autoswitch = config.autoswitch.model_copy() if config.autoswitch else None
        self._setup_quantizers(config)

    def _after_convert(self) -> None:
        """Called once every module of the model is converted (e.g. experts wire their linears to the layer's
        quantizers)."""

    def calibrate_weights(self) -> None:
        """Max-calibrates the weight quantizer(s) straight from the weights (no data needed)."""
        if self.weight_quantizer.is_enabled:
            self.weight_quantizer.collect(self.weight)

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        """Names of the parallel groups (``"tp"``, ``"dp"``, ``"ep"``, ...) over which this module's quantizer
        ``quantizer_name`` (relative name) must max-reduce its amax. Plain modules: none."""
        return ()

    def finalize_calibration(self, groups: dict) -> list[str]:
        """After the amax reduction: fix what calibration left incomplete; returns notes for one rank-0 warning."""
        return []

    def fold_weight(self) -> None:
        """Replaces the weight by its fake-quantized value and disables the weight quantizer."""
        if self.weight_quantizer.is_enabled:
            with torch.no_grad():
                self.weight.copy_(self.weight_quantizer.fake_quant(self.weight))
            self.weight_quantizer.disable()

    def expert_gemms(self) -> list[ExpertGemm]:
        """The expert GEMMs whose quantizers this module holds (none for a dense module)."""
        return []

    def expert_grid(self) -> ExpertGrid:
        """This rank's place among the expert-parallel ranks (framework adapters answer from their groups)."""
        return ExpertGrid()

    # Attributes that are caches: never pickled or deep-copied (they hold ids and derived tensors).
    _transient_attributes: tuple[str, ...] = ()

    def __reduce_ex__(self, protocol):
        state = dict(self.__getstate__())
        for name in self._transient_attributes:
            state.pop(name, None)
        return _rebuild_quantized, (self._original_cls, self._mixin_cls), state


_QUANT_CLASSES: dict[tuple[type, type], type] = {}


def _quantized_class(original: type, mixin: type) -> type:
    key = (original, mixin)
    if key not in _QUANT_CLASSES:
        name = f"Quant{original.__name__}"
        _QUANT_CLASSES[key] = type(name, (mixin, original), {"_original_cls": original, "_mixin_cls": mixin,
                                                              "__module__": original.__module__})
    return _QUANT_CLASSES[key]


def _rebuild_quantized(original: type, mixin: type):
    cls = _quantized_class(original, mixin)
    return cls.__new__(cls)


class _Registry:
    """Original module class -> quantized mixin. Lookups are by exact class, then by base class."""

    def __init__(self):
        self._map: dict[type, type] = {}

    def register(self, original: type, mixin: type) -> None:
        if not issubclass(mixin, QuantModuleMixin):
            raise TypeError(f"{mixin.__name__} must subclass QuantModuleMixin")
        self._map[original] = mixin

    def unregister(self, original: type) -> None:
        self._map.pop(original, None)

    def mixin_for(self, cls: type) -> type | None:
        if issubclass(cls, QuantModuleMixin):
            return None  # already converted
        for base in cls.__mro__:
            if base in self._map:
                return self._map[base]
        return None

    def __contains__(self, cls: type) -> bool:
        register_framework_plugins()
        return self.mixin_for(cls) is not None


QuantModuleRegistry = _Registry()


def register_framework_plugins() -> list[str]:
    """Registers the quantized classes (and parallel groups) of every framework the program has imported.

    The core's one call into ``modelopt_moe.plugins``: made by :func:`convert` (``mtq.quantize``, every restore) and
    by registry lookups; idempotent and cheap. Returns the names of the registered plugins.
    """
    from .. import plugins

    return plugins.register_imported()


# Classes that wrap a model as ``.module`` without changing its state-dict keys (plugins add their frameworks').
_WRAPPERS: set[type] = {torch.nn.parallel.DistributedDataParallel}


def register_wrapper(cls: type) -> None:
    """Declares ``cls`` a model wrapper (``wrapper.module`` is the model): quantization state names the model's
    modules as the unwrapped model does, so a checkpoint saved through a wrapper loads into a bare model and back."""
    _WRAPPERS.add(cls)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside any registered wrappers (torch DDP; Megatron's DDP and ``Float16Module``)."""
    while isinstance(model, tuple(_WRAPPERS)):
        model = model.module
    return model


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QuantModuleMixin)


def convert(model: nn.Module, config: QuantizeConfig) -> list[str]:
    """Swaps every registered module to its quantized class and applies ``config``.

    Returns:
        Names of the converted modules.

    Raises:
        ValueError: nothing in ``model`` is quantizable.
    """
    register_framework_plugins()
    converted = []
    for name, module in list(model.named_modules()):
        mixin = QuantModuleRegistry.mixin_for(type(module))
        if mixin is None:
            continue
        module.__class__ = _quantized_class(type(module), mixin)
        module._setup(config)
        converted.append(name)
    for module in model.modules():
        if is_quantized(module):
            module._after_convert()
    if not converted and not any(is_quantized(m) for m in model.modules()):
        kinds = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"quantize: nothing quantizable in {type(model).__name__}; registered classes are "
            f"{sorted(c.__name__ for c in QuantModuleRegistry._map)} (is the plugin for your framework imported?), "
            f"the model has {kinds}"
        )
    apply_quant_cfg(model, config)
    return converted


def named_quantizers(model: nn.Module) -> Iterator[tuple[str, TensorQuantizer, nn.Module]]:
    """Yields ``(full name, quantizer, owning quantized module)`` in a deterministic (module) order."""
    for mod_name, module in model.named_modules():
        if not is_quantized(module):
            continue
        for q_name, q in module.named_modules():
            if isinstance(q, TensorQuantizer) and q_name:
                yield (f"{mod_name}.{q_name}" if mod_name else q_name), q, module


def rule_name(full_name: str) -> str:
    """The name quant_cfg rules match: a per-expert view (``weight_quantizer.3``) follows its quantizer's."""
    head, _, tail = full_name.rpartition(".")
    return head if tail.isdigit() and head.endswith("_quantizer") else full_name


def apply_quant_cfg(model: nn.Module, config: QuantizeConfig) -> None:
    """Applies the ``quant_cfg`` rules to every quantizer; a quantizer no rule names is disabled."""
    for full_name, q, module in named_quantizers(model):
        parent = module._original_cls.__name__
        attrs = config.resolve(rule_name(full_name), parent)
        q.set_from_attribute_config(attrs if attrs is not None else QuantizerAttributeConfig(enable=False))
        q.ste = config.backward.ste
    from .weight_amax import set_weight_amax_update  # imports this module

    for full_name, q, module in named_quantizers(model):
        weight = rule_name(full_name).endswith("weight_quantizer")
        set_weight_amax_update(full_name, q, module, config.weight_amax_update if weight else "static")
    for module in model.modules():
        if is_quantized(module):
            module.quant_backward = config.backward.model_copy()
            module.quant_kernel = config.kernel
            module.quant_autoswitch = config.autoswitch.model_copy() if config.autoswitch else None


def set_quantizer_by_pattern(model: nn.Module, pattern: str, enable: bool) -> int:
    """Enables or disables every quantizer whose full name matches ``pattern``; returns how many matched."""
    n = 0
    for full_name, q, _ in named_quantizers(model):
        if fnmatch.fnmatchcase(full_name, pattern) or fnmatch.fnmatchcase(rule_name(full_name), pattern):
            q.enable() if enable else q.disable()
            n += 1
    return n
