"""Quantized ``torch.nn.Linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant_module import QuantModuleMixin
from .functional import apply_quantized_gemm

__all__ = ["QuantLinearMixin"]


class QuantLinearMixin(QuantModuleMixin):
    """``nn.Linear`` with input / weight / output quantizers and the configured backward mode."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``F.linear(input, weight, bias)`` with the quantizers applied to its operands and output."""
        return apply_quantized_gemm(self, input, self.weight, lambda x, w: F.linear(x, w, self.bias))

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        """``dp`` for the input and output quantizers (activations differ across data-parallel ranks); none for
        weights."""
        # Activations differ across data-parallel ranks; weights are replicated there.
        return ("dp",) if quantizer_name in ("input_quantizer", "output_quantizer") else ()

