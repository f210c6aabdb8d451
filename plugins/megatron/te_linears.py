"""Megatron's Transformer Engine dense linears (``TELinear``, ``TEColumnParallelLinear``, ``TERowParallelLinear``,
``TELayerNormColumnParallelLinear``): what ``build_megatron_model(spec="te")`` and Megatron-LM's TE spec use for
attention, dense MLPs, shared experts and MLA's projections. Quantized like Megatron's own column/row-parallel
linears (same quantizer names, amax reductions and checkpoint entries: :class:`.modules._QuantParallelLinearMixin`).

TE's ``Linear`` fetches its weight through ``_get_weight_tensors()``: while the layer's own forward runs (TE's GEMM,
its tensor-parallel communication and bias handling) that hook returns the fake-quantized weight, and the input is
fake-quantized before the call, as for TE's grouped linears (:mod:`modelopt_moe.plugins.transformer_engine`).

``TELayerNormColumnParallelLinear`` fuses the norm into its GEMM, so the GEMM's input (the normalised activation)
never leaves TE. While its input quantizer is enabled the layer runs unfused instead: the norm in torch (fp32 math,
TE's formula: RMSNorm or LayerNorm, ``zero_centered_gamma``), the input quantizer on its output, then the
column-parallel GEMM with Megatron's own communication (the sequence-parallel all-gather of the quantized
activation, or the identity whose backward all-reduces). Weight-only configs keep TE's fused kernel.
TE's own FP8 must be off while fake quant runs (both would quantize).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.extensions.transformer_engine import (
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TELinear,
    TERowParallelLinear,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from modelopt_moe.quantization.conversion import QuantModuleRegistry
from modelopt_moe.quantization.nn.functional import apply_quantized_gemm
from modelopt_moe.quantization.nn.row_scale import row_scale_of

from ..transformer_engine import TEParamDtypeMixin, refuse_fp8_autocast, refuse_fused_wgrad
from .modules import _QuantParallelLinearMixin

__all__ = [
    "QuantTELinear", "QuantTEColumnParallelLinear", "QuantTERowParallelLinear", "QuantTELayerNormColumnParallelLinear",
    "CLASSES", "register",
]


class QuantTELinear(TEParamDtypeMixin, _QuantParallelLinearMixin):
    """Quantized Megatron ``TELinear`` (one weight, TE's own forward); as built directly (MLA's down projections)
    it is ``duplicated``: every tensor-parallel rank holds the whole weight."""

    _fake_quant_weight = None
    sharded_axis = None
    # Megatron's TE linears do not keep ``is_expert``. Dense TE linears are not experts; an expert's TE linear
    # (SequentialMLP built with TE linears) holds views of the layer's quantizers, which the layer reduces.
    is_expert = False

    def _setup_quantizers(self, config):
        name = type(self).__name__
        if len(getattr(self, "weight_names", ("weight",))) != 1:
            raise NotImplementedError(f"{name}: a TE linear with several weights {list(self.weight_names)} "
                                      "(parameters_split) is not supported; build it with one weight")
        refuse_fused_wgrad(self)
        super(_QuantParallelLinearMixin, self)._setup_quantizers(config)

    def tensor_split(self) -> tuple[int, int] | None:
        """The weight axis split over tensor-parallel ranks and their number; None when TE does not split it."""
        if self.sharded_axis is None:
            return None
        return self.sharded_axis, self.tp_size

    def _get_weight_tensors(self):
        if self._fake_quant_weight is not None:
            return [self._fake_quant_weight]
        return self._original_cls._get_weight_tensors(self)

    def _te_gemm(self, *args, **kwargs):
        """``gemm(x, w)``: the layer's own forward on input ``x`` with weight ``w`` (through the weight hook)."""
        def gemm(x, w):
            self.__dict__["_fake_quant_weight"] = w  # not nn.Module's setattr: w may be the Parameter itself
            try:
                return _QuantParallelLinearMixin.forward(self, x, *args, **kwargs)
            finally:
                self.__dict__["_fake_quant_weight"] = None
        return gemm

    def forward(self, x, *args, **kwargs):
        """Megatron's forward (``(out, bias or None)``) with the quantizers applied to its operands.

        Raises:
            RuntimeError: Transformer Engine's FP8 autocast is on.
        """
        refuse_fp8_autocast(self)
        if not any(q.is_enabled for q in (self.input_quantizer, self.weight_quantizer, self.output_quantizer)):
            return _QuantParallelLinearMixin.forward(self, x, *args, **kwargs)  # e.g. a TE output layer left bf16
        return apply_quantized_gemm(self, x, self.weight, self._te_gemm(*args, **kwargs), row_scale=row_scale_of(self))


class QuantTEColumnParallelLinear(QuantTELinear):
    """Quantized Megatron ``TEColumnParallelLinear``: the weight's output channels (axis 0) are split over TP."""
    sharded_axis = 0


class QuantTERowParallelLinear(QuantTELinear):
    """Quantized Megatron ``TERowParallelLinear``: the weight's input channels (axis 1) are split over TP."""
    sharded_axis = 1


class QuantTELayerNormColumnParallelLinear(QuantTELinear):
    """Quantized Megatron ``TELayerNormColumnParallelLinear`` (TE's norm fused into a column-parallel GEMM)."""

    sharded_axis = 0

    def _setup_quantizers(self, config):
        if getattr(self, "return_layernorm_output", False):
            raise NotImplementedError(f"{type(self).__name__}: return_layernorm_output=True is not supported with "
                                      "quantization")
        if getattr(self, "normalization", "RMSNorm") not in ("RMSNorm", "LayerNorm"):
            raise NotImplementedError(f"{type(self).__name__}: normalization {self.normalization!r}; expected "
                                      "'RMSNorm' or 'LayerNorm'")
        super()._setup_quantizers(config)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """The fused layer's norm in torch: fp32 math, the output in ``x``'s dtype."""
        gamma = self.layer_norm_weight.float()
        if getattr(self, "zero_centered_gamma", False):
            gamma = gamma + 1
        xf = x.float()
        if self.normalization == "RMSNorm":
            y = F.rms_norm(xf, (xf.shape[-1],), gamma, self.eps)
        else:
            beta = self.layer_norm_bias
            y = F.layer_norm(xf, (xf.shape[-1],), gamma, None if beta is None else beta.float(), self.eps)
        return y.to(x.dtype)

    def _column_gemm(self, x: torch.Tensor, w: torch.Tensor):
        """The column-parallel GEMM on the normalised input, with Megatron's communication; Megatron's return."""
        group = self.tp_group
        if self.tp_size > 1:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
            else:
                x = copy_to_tensor_model_parallel_region(x, group=group)
        bias = self.bias if getattr(self, "use_bias", False) else None
        if getattr(self, "te_return_bias", False):
            return F.linear(x, w.to(x.dtype)), bias
        return F.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype)), None

    def forward(self, x, *args, **kwargs):
        """Megatron's forward: TE's fused kernel while the input quantizer is off, else the norm, the input
        quantizer and the GEMM unfused (module docstring).

        Raises:
            RuntimeError: Transformer Engine's FP8 autocast is on.
        """
        refuse_fp8_autocast(self)
        if not self.input_quantizer.is_enabled:
            return super().forward(x, *args, **kwargs)
        self.is_first_microbatch = False  # as Megatron's forward (TE's weight caches are off: FP8 is off)
        return apply_quantized_gemm(self, self._norm(x), self.weight, self._column_gemm)


CLASSES = {
    TELinear: QuantTELinear,
    TEColumnParallelLinear: QuantTEColumnParallelLinear,
    TERowParallelLinear: QuantTERowParallelLinear,
    TELayerNormColumnParallelLinear: QuantTELayerNormColumnParallelLinear,
}


def register() -> None:
    """Registers the quantized classes of Megatron's TE dense linears."""
    for original, quantized in CLASSES.items():
        QuantModuleRegistry.register(original, quantized)
