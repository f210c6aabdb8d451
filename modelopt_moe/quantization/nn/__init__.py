"""Quantized wrappers that need no framework (importing this registers them with the class registry)."""

from .experts import ExpertQuantizers  # noqa: F401
from .functional import apply_quantized_gemm  # noqa: F401
from .grouped_linear import GroupedLinear, QuantGroupedLinearMixin  # noqa: F401
from .linear import QuantLinearMixin  # noqa: F401
