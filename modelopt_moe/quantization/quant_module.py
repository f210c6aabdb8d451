"""Quantized modules: the mixin every quantized wrapper derives from, the class registry, and which modules (and
quantizers) of a model are quantized.

The quantized class of ``Foo`` is ``QuantFoo(FooMixin, Foo)``, created once and cached. Swapping ``__class__``
keeps every parameter, buffer and attribute of the original module (and the state-dict keys), so a model converts
without copying weights. Such classes are created at run time, so quantized modules pickle through
:func:`_rebuild_quantized`, which re-creates the class from the original class and the mixin.

Below the wrappers (``quantization/nn``, the plugins) and :mod:`.conversion`, which swaps classes and applies configs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from .config_schema import QuantizeConfig
from .expert_quantizer import ExpertGemm, ExpertGrid
from .tensor_quantizer import TensorQuantizer

__all__ = [
    "QuantModuleMixin",
    "QuantModuleRegistry",
    "quantized_class",
    "register_wrapper",
    "unwrap_model",
    "wrapper_names",
    "is_quantized",
    "named_quantizers",
    "own_quantizers",
    "rule_name",
    "parent_class_names",
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
        self.quant_gemm = config.gemm
        self.quant_autoswitch = config.autoswitch.model_copy() if config.autoswitch else None
        self._setup_quantizers(config)

    def _after_convert(self) -> None:
        """Called once every module of the model is converted (e.g. experts wire their linears to the layer's
        quantizers)."""

    def calibrate_weights(self) -> None:
        """Max-calibrates the weight quantizer(s) straight from the weights (no data needed)."""
        if self.weight_quantizer.is_enabled:
            self.weight_quantizer.collect(self.weight)

    def weights_to_calibrate(self) -> list[tuple[str, TensorQuantizer, list[torch.Tensor]]]:
        """``(relative quantizer name, weight quantizer, weights)`` for each weight quantizer this module calibrates
        from its weights: ``[weight]`` for a plain quantizer, expert ``i``'s weight at ``i`` for an expert
        quantizer (what weight calibration algorithms search over, :mod:`.calib`)."""
        return [("weight_quantizer", self.weight_quantizer, [self.weight])]

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        """Names of the parallel groups (``"tp"``, ``"dp"``, ``"ep"``, ...) over which this module's quantizer
        ``quantizer_name`` (relative name) must max-reduce its amax. Plain modules: none."""
        return ()

    def input_amax_grad_groups(self, quantizer_name: str) -> tuple[str, ...]:
        """Names of the groups over which the gradient of this module's learned input amax ``quantizer_name`` is
        summed in the backward (:mod:`.input_amax`): those its amax is reduced over, less the data-parallel ones
        (``dp``, ``edp``), which the framework's gradient reduction covers as it covers the GEMM's weights."""
        return tuple(n for n in self.amax_reduction(quantizer_name) if n not in ("dp", "edp"))

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

    def tensor_split(self) -> tuple[int, int] | None:
        """``(weight axis, size)`` of this module's tensor-parallel weight split, or None (not split; framework
        adapters answer from their groups)."""
        return None

    # Attributes that are caches: never pickled or deep-copied (they hold ids and derived tensors).
    _transient_attributes: tuple[str, ...] = ()

    def __reduce_ex__(self, protocol):
        state = dict(self.__getstate__())
        for name in self._transient_attributes:
            state.pop(name, None)
        return _rebuild_quantized, (self._original_cls, self._mixin_cls), state


_QUANT_CLASSES: dict[tuple[type, type], type] = {}


def quantized_class(original: type, mixin: type) -> type:
    """``Quant<original>(mixin, original)``, created once per pair."""
    key = (original, mixin)
    if key not in _QUANT_CLASSES:
        name = f"Quant{original.__name__}"
        _QUANT_CLASSES[key] = type(name, (mixin, original), {"_original_cls": original, "_mixin_cls": mixin,
                                                              "__module__": original.__module__})
    return _QUANT_CLASSES[key]


def _rebuild_quantized(original: type, mixin: type):
    cls = quantized_class(original, mixin)
    return cls.__new__(cls)


class _Registry:
    """Original module class -> quantized mixin. Lookups are by exact class, then by base class.

    Every read (``cls in registry``, :meth:`get`, ``registry[cls]``, iteration, :meth:`registered`) first makes the
    one registration call (:func:`~.conversion.register_framework_plugins`, installed with :meth:`resolve_with`),
    so the registry holds the framework-free wrappers and the plugins of every framework imported so far, as Model
    Optimizer's registry does once its plugins are imported: ``ColumnParallelLinear in mtq.QuantModuleRegistry``
    holds as soon as ``megatron.core`` is imported, before or after ``mtq``. Importing registers nothing and
    imports no framework."""

    def __init__(self):
        self._map: dict[type, type] = {}
        self._resolve: Callable[[], object] | None = None
        self._resolving = False

    def resolve_with(self, resolve: Callable[[], object]) -> None:
        """Installs the registration call every read makes first (the core's conversion module installs it)."""
        self._resolve = resolve

    def _resolved(self) -> dict[type, type]:
        if self._resolve is not None and not self._resolving:
            self._resolving = True  # a plugin's register() may read the registry
            try:
                self._resolve()
            finally:
                self._resolving = False
        return self._map

    def register(self, original: type, mixin: type, *, replace: bool = True) -> None:
        """Quantizes ``original`` (and its subclasses without a registration of their own) with ``mixin``.

        Args:
            original: the module class to quantize.
            mixin: the :class:`QuantModuleMixin` subclass that quantizes it.
            replace: replace an earlier registration of ``original`` (False: keep it; the framework-free wrappers
                are registered so, as defaults a user's own registration wins over).

        Raises:
            TypeError: ``mixin`` is not a :class:`QuantModuleMixin`.
        """
        if not issubclass(mixin, QuantModuleMixin):
            raise TypeError(f"{mixin.__name__} must subclass QuantModuleMixin")
        if replace or original not in self._map:
            self._map[original] = mixin

    def unregister(self, original: type) -> None:
        self._map.pop(original, None)

    def mixin_for(self, cls: type) -> type | None:
        """The mixin that quantizes ``cls`` (its own registration or its nearest registered base's); None for an
        unregistered or already quantized class."""
        if issubclass(cls, QuantModuleMixin):
            return None  # already converted
        registered = self._resolved()
        for base in cls.__mro__:
            if base in registered:
                return registered[base]
        return None

    def get(self, cls: type, default: type | None = None) -> type | None:
        """:meth:`mixin_for`, or ``default`` where ``cls`` is not quantizable."""
        mixin = self.mixin_for(cls)
        return default if mixin is None else mixin

    def __getitem__(self, cls: type) -> type:
        mixin = self.mixin_for(cls)
        if mixin is None:
            raise KeyError(f"{cls.__name__} is not registered for quantization; registered classes: "
                           f"{sorted(c.__name__ for c in self._map)}")
        return mixin

    def __contains__(self, cls: type) -> bool:
        return self.mixin_for(cls) is not None

    def __iter__(self) -> Iterator[type]:
        return iter(list(self._resolved()))

    def __len__(self) -> int:
        return len(self._resolved())

    def registered(self) -> dict[type, type]:
        """``{original class: mixin}`` of every registration (a copy)."""
        return dict(self._resolved())


QuantModuleRegistry = _Registry()


_WRAPPERS: set[type] = {torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel}


def register_wrapper(cls: type) -> None:
    """Declares ``cls`` a model wrapper (``wrapper.module`` is the model): quantization state names the model's
    modules as the unwrapped model does, so a checkpoint saved through a wrapper loads into a bare model and back."""
    _WRAPPERS.add(cls)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside any registered wrappers (torch DDP; Megatron's DDP and ``Float16Module``)."""
    while isinstance(model, tuple(_WRAPPERS)):
        model = model.module
    return model


def wrapper_names(model: nn.Module) -> list[str]:
    """The class names of the registered wrappers around ``model``, outermost first (empty for a bare model): what
    calls that must run before wrapping (``mtq.quantize``, a checkpoint's first restore) name in their refusal."""
    names = []
    while isinstance(model, tuple(_WRAPPERS)):
        names.append(type(model).__name__)
        model = model.module
    return names


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is a quantized module (converted by ``mtq.quantize``)."""
    return isinstance(module, QuantModuleMixin)


def own_quantizers(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, TensorQuantizer]]:
    """``(relative name, quantizer)`` of the quantizers a quantized module owns: those among its submodules, but not
    inside a nested quantized module (e.g. an expert layer around its quantized linears), which owns its own."""
    for name, child in module._modules.items():
        if child is None or is_quantized(child):
            continue
        if isinstance(child, TensorQuantizer):
            yield prefix + name, child
        yield from own_quantizers(child, f"{prefix}{name}.")


def named_quantizers(model: nn.Module) -> Iterator[tuple[str, TensorQuantizer, nn.Module]]:
    """Yields ``(full name, quantizer, owning quantized module)`` in a deterministic (module) order; each quantizer
    once, with its nearest quantized module as owner."""
    for mod_name, module in model.named_modules():
        if not is_quantized(module):
            continue
        for q_name, q in own_quantizers(module):
            yield (f"{mod_name}.{q_name}" if mod_name else q_name), q, module


def rule_name(full_name: str) -> str:
    """The name quant_cfg rules match: a per-expert view (``weight_quantizer.3``) follows its quantizer's."""
    head, _, tail = full_name.rpartition(".")
    return head if tail.isdigit() and head.endswith("_quantizer") else full_name


def parent_class_names(module: nn.Module) -> tuple[str, ...]:
    """The names a ``parent_class`` rule matches for a quantizer of ``module``: its original class and every base
    (Model Optimizer matches with ``isinstance``, so a subclass of ``nn.Linear`` is an ``"nn.Linear"``)."""
    cls = getattr(module, "_original_cls", type(module))
    return tuple(c.__name__ for c in cls.__mro__ if c not in (object, nn.Module))
