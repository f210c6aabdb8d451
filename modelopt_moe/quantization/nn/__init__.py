"""Quantized wrappers that need no framework: ``torch.nn.Linear`` and the grouped expert linear.

:func:`register` adds them to the class registry, as every framework plugin's ``register()`` adds its own; the core's
one registration call (``conversion.register_framework_plugins``, made by ``mtq.quantize`` and every restore) makes
it. Importing this package registers nothing.
"""

from torch import nn

from ..quant_module import QuantModuleRegistry
from .experts import ExpertQuantizers
from .functional import apply_quantized_gemm
from .grouped_linear import GroupedLinear, QuantGroupedLinearMixin
from .linear import QuantLinearMixin

__all__ = ["register", "ExpertQuantizers", "apply_quantized_gemm", "GroupedLinear", "QuantGroupedLinearMixin",
           "QuantLinearMixin", "CLASSES"]

CLASSES = {nn.Linear: QuantLinearMixin, GroupedLinear: QuantGroupedLinearMixin}


def register() -> None:
    """Adds the framework-free wrappers to the class registry, as defaults: a class a user registered first keeps
    the user's mixin."""
    for original, mixin in CLASSES.items():
        QuantModuleRegistry.register(original, mixin, replace=False)
