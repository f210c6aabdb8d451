"""Transformer Engine support: quantized ``transformer_engine.pytorch.GroupedLinear`` (Megatron's TE grouped linears
build on it in ``plugins/megatron/te_experts.py``).

The wrapper fake-quantizes the input (shared or per expert, split by ``m_splits``; as Megatron's ``TEGroupedMLP``
``linear_fc2``, times the tokens' router probabilities in the same launch, see
``modelopt_moe.quantization.nn.row_scale``) and the N expert weights, then runs the layer's own forward (Megatron's
wrapper and TE's grouped GEMM, with TE's communication and bias handling), which fetches its weights through
``_get_weight_tensors()``: that hook returns the fake-quantized weights while the GEMM runs. TE's own FP8 must be
off while fake quant runs (both would quantize).

With ``gemm: te_fp8`` a calibrated layer runs its forward GEMM as a real FP8 GEMM in TE instead, with our static
scales and the configured backward (:mod:`.te_fp8`); calibration still runs the fake-quant path.
"""

from __future__ import annotations

import functools
import inspect

import torch
import transformer_engine.pytorch as te

from modelopt_moe.quantization.conversion import QuantModuleRegistry
from modelopt_moe.quantization.nn.grouped_linear import QuantGroupedLinearMixin
from modelopt_moe.quantization.nn.row_scale import row_scale_of
from modelopt_moe.quantization.tensor_quantizer import TensorQuantizer

from . import te_fp8

try:  # TE >= 2.8 moved FP8GlobalStateManager
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
except ImportError:  # pragma: no cover - older TE
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

__all__ = ["QuantTEGroupedLinear", "TEParamDtypeMixin", "register", "refuse_fp8_autocast", "refuse_fused_wgrad"]


def refuse_fp8_autocast(module) -> None:
    """Raises while TE's own FP8 autocast is on: both it and the fake quantizers would quantize.

    Raises:
        RuntimeError: naming the module.
    """
    if FP8GlobalStateManager.is_fp8_enabled():
        raise RuntimeError(
            f"{type(module).__name__}: Transformer Engine FP8 autocast is on while modelopt_moe fake quantization "
            "is active; turn TE's fp8_autocast off (the fake quantizers already emulate the low precision)"
        )


def refuse_fused_wgrad(module, alternative: str = "") -> None:
    """Raises for a TE layer built with ``fuse_wgrad_accumulation``: TE's backward would add the weight gradient into
    ``weight.main_grad`` of the weights its forward saw, the fake-quantized copies, which have none.

    Raises:
        ValueError: naming the module, the setting and what to set instead (``alternative``: another way out).
    """
    if getattr(module, "fuse_wgrad_accumulation", False):
        raise ValueError(
            f"{type(module).__name__}: fuse_wgrad_accumulation=True (Megatron: gradient_accumulation_fusion) "
            "accumulates the weight gradient into weight.main_grad inside TE's GEMM, which a fake-quantized "
            "weight does not have; set gradient_accumulation_fusion=False (Megatron-LM: "
            f"--no-gradient-accumulation-fusion) for QAT with modelopt_moe{alternative}"
        )


class TEParamDtypeMixin:
    """TE's parameter dtype check on the TE layer's own parameters, not on its quantizers' (the quantized TE grouped
    and dense linears derive from it).

    Outside autocast, TE's ``set_activation_dtype`` (called by ``prepare_forward`` in every forward) raises a
    ``TypeError`` for any parameter of ``self.named_parameters()`` whose dtype is not the input's. That walk recurses
    into the quantizers, whose learned amaxes (``_amax``, ``_block_amax``: ``*_amax_update: learned``) are fp32
    parameters on purpose (the precision of a learned scale matters): a bf16 model would fail at its first forward. The
    check exists for the tensors TE's kernels read (weights, biases, a fused norm's weights): this runs TE's check on
    every parameter outside the quantizers, records the dtype as TE does, and TE's own method then finds it recorded
    (it checks only when the dtype changes). The amaxes stay parameters of the module tree, so the optimizer, DDP and
    checkpoints see them as before; hiding them from ``named_parameters`` would hide them from those too.
    """

    def set_activation_dtype(self, inp: torch.Tensor) -> None:
        """TE's ``set_activation_dtype`` with its parameter check limited to the parameters outside the quantizers.

        Raises:
            TypeError: outside autocast, a parameter outside the quantizers whose dtype is not the input's (TE's error,
                naming the module).
        """
        dtype = inp.dtype
        if (not torch.is_autocast_enabled("cuda") and getattr(self, "activation_dtype", None) != dtype
                and not getattr(self, "allow_different_data_and_param_types", False)):
            in_quantizers = {id(p) for m in self.modules() if isinstance(m, TensorQuantizer)
                             for p in m.parameters(recurse=False)}
            for name, param in self.named_parameters():
                if id(param) not in in_quantizers and param.dtype != dtype:
                    raise TypeError(f"{type(self).__name__}: data types for parameters must match when outside of "
                                    f"autocasted region; found input dtype {dtype} and {name!r} dtype {param.dtype}")
            self.__dict__["activation_dtype"] = dtype  # as TE's fast_setattr
        super().set_activation_dtype(inp)


@functools.cache
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


@functools.cache
def _split_arg_names(cls: type) -> tuple[str, str]:
    """Names of the input and split-size parameters of ``cls.forward`` (TE renames them between releases)."""
    params = [p for p in _forward_signature(cls).parameters if p != "self"]
    split = next((p for p in params if p in ("m_splits", "split_sizes", "tokens_per_expert")), None)
    if split is None or not params or params[0] == split:
        raise TypeError(f"{cls.__name__}.forward{inspect.signature(cls.forward)}: cannot find the input and "
                        "m_splits arguments")
    return params[0], split


class QuantTEGroupedLinear(TEParamDtypeMixin, QuantGroupedLinearMixin):
    """Quantized TE ``GroupedLinear`` (and Megatron's TE grouped linears, which subclass it)."""

    _fake_quant_weights = None
    _transient_attributes = (*QuantGroupedLinearMixin._transient_attributes, "_te_fp8_quantizers")

    @property
    def sharded_axis(self) -> int:
        """TE's own tensor-parallel mode (Megatron's TE grouped linears declare theirs per class)."""
        return 1 if getattr(self, "parallel_mode", None) == "row" else 0

    def _setup_quantizers(self, config):
        if getattr(self, "single_grouped_weight", False):
            raise NotImplementedError(
                f"{type(self).__name__}: single_grouped_weight=True (one GroupedTensor for all experts) is not "
                "supported yet; build the layer with single_grouped_weight=False (Megatron: "
                "moe_single_grouped_weight=False)"
            )
        if config.gemm != te_fp8.GEMM:  # te_fp8 returns the weight gradient in .grad
            refuse_fused_wgrad(self, ", or use gemm: te_fp8")
        super()._setup_quantizers(config)

    def expert_weights(self):
        """The N expert weights as TE holds them (never the fake-quantized copies of a running forward)."""
        return self._original_cls._get_weight_tensors(self)

    def _get_weight_tensors(self):
        if self._fake_quant_weights is not None:
            return self._fake_quant_weights
        return self._original_cls._get_weight_tensors(self)

    def forward(self, *args, **kwargs):
        """TE's ``GroupedLinear.forward`` (same arguments, same return) with the quantizers applied to its operands.

        Raises:
            RuntimeError: Transformer Engine's FP8 autocast is on.
            NotImplementedError: the router probabilities scale the input while TE adds the bias inside the GEMM.
        """
        refuse_fp8_autocast(self)
        if row_scale_of(self) is not None and getattr(self, "apply_bias", False):
            raise NotImplementedError(f"{type(self).__name__}: the router probabilities scale the GEMM's input, so a "
                                      "bias added inside the GEMM would not be scaled; return the biases instead "
                                      "(return_bias=True; Megatron: skip_bias_add=True)")
        bound = _forward_signature(self._original_cls).bind(self, *args, **kwargs)
        x_name, split_name = _split_arg_names(self._original_cls)
        x, m_splits = bound.arguments[x_name], bound.arguments[split_name]
        if te_fp8.engaged(self):
            others = {k: v for k, v in bound.arguments.items() if k not in ("self", x_name, split_name)}
            return te_fp8.forward(self, x, m_splits, **others)

        def gemm(x_operand, weights):
            bound.arguments[x_name] = x_operand
            self._fake_quant_weights = list(weights)
            try:
                return self._original_cls.forward(*bound.args, **bound.kwargs)
            finally:
                self._fake_quant_weights = None

        return self.quantized_forward(x, m_splits, gemm=gemm)

    def finalize_calibration(self, groups: dict) -> list[str]:
        """Completes the experts' input amaxes; with ``gemm: te_fp8``, checks that the FP8 GEMM can run this layer.

        Raises:
            ConfigError: ``gemm: te_fp8`` with settings its GEMM cannot run (raised in ``mtq.quantize``, not at the
                first step).
        """
        notes = super().finalize_calibration(groups)
        if te_fp8.engaged(self):
            te_fp8.check(self)  # a config the FP8 GEMM cannot run fails in mtq.quantize, not at the first step
        return notes


def register() -> None:
    """Adds the quantized TE ``GroupedLinear`` to the registry (called by the core once TE is imported)."""
    QuantModuleRegistry.register(te.GroupedLinear, QuantTEGroupedLinear)
