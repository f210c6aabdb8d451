"""Megatron-Core support: quantized ``ColumnParallelLinear`` / ``RowParallelLinear`` (attention and the linears of
``SequentialMLP`` experts) and the parallel groups for amax reduction.

The quantized linears override Megatron's ``_forward_impl`` (the local GEMM, with its own sequence-parallel and
gradient communication), so everything around it (bias, TP reductions, expert communication) stays Megatron's.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP

from modelopt_moe.quantization.calibration import register_group_provider
from modelopt_moe.quantization.conversion import QuantModuleMixin, QuantModuleRegistry
from modelopt_moe.quantization.nn.functional import apply_quantized_gemm
from modelopt_moe.quantization.nn.grouped_linear import (
    ExpertQuantizers,
    expert_amax_reduction,
    fill_unseen_expert_input_amax,
)

__all__ = ["QuantColumnParallelLinear", "QuantRowParallelLinear", "QuantSequentialMLP", "megatron_amax_groups"]


def megatron_amax_groups() -> dict | None:
    """Megatron's process groups by the names quantized modules use, or None before initialisation.

    ``tp``/``dp`` for dense layers; ``etp``/``edp``/``ep`` for experts (``dp`` includes context parallel ranks,
    whose activations also differ).
    """
    if not parallel_state.model_parallel_is_initialized():
        return None
    return {
        "tp": parallel_state.get_tensor_model_parallel_group(),
        "dp": parallel_state.get_data_parallel_group(with_context_parallel=True),
        "ep": parallel_state.get_expert_model_parallel_group(),
        "etp": parallel_state.get_expert_tensor_parallel_group(),
        "edp": parallel_state.get_expert_data_parallel_group(),
    }


register_group_provider(megatron_amax_groups)


class _QuantParallelLinearMixin(QuantModuleMixin):
    """Shared by the column- and row-parallel wrappers; ``_sharded_axis`` is the weight axis split across TP."""

    _sharded_axis: int

    def _setup_quantizers(self, config):
        if self.gradient_accumulation_fusion:
            raise ValueError(
                f"{type(self).__name__}: gradient_accumulation_fusion=True accumulates into weight.main_grad inside "
                "the GEMM, which a fake-quantized weight does not have; set gradient_accumulation_fusion=False for "
                "QAT with modelopt_moe"
            )
        super()._setup_quantizers(config)

    def _forward_impl(self, input, weight, *args, **kwargs):
        parent = super()._forward_impl
        return apply_quantized_gemm(self, input, weight, lambda x, w: parent(x, w, *args, **kwargs))

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        tp, dp = ("etp", "edp") if self.is_expert else ("tp", "dp")
        if quantizer_name != "weight_quantizer":
            return (dp, tp)
        q = self.weight_quantizer
        # A per-channel amax along the TP-sharded axis belongs to this rank's channels only.
        return () if q.axis is not None and q.axis % 2 == self._sharded_axis else (tp,)

    def fold_weight(self) -> None:
        if self.weight_quantizer.is_enabled:
            with torch.no_grad():
                self.weight.copy_(self.weight_quantizer.fake_quant(self.weight))
            self.weight_quantizer.disable()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's entries, with the quantizer amaxes sharded by ``plugins/megatron_checkpoint.py``."""
        from .megatron_checkpoint import parallel_linear_quantizers_sharded_state_dict

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sd.update(parallel_linear_quantizers_sharded_state_dict(self, prefix, sharded_offsets, metadata,
                                                                sharded_axis=self._sharded_axis))
        return sd


class QuantColumnParallelLinear(_QuantParallelLinearMixin):
    _sharded_axis = 0


class QuantRowParallelLinear(_QuantParallelLinearMixin):
    _sharded_axis = 1


QuantModuleRegistry.register(ColumnParallelLinear, QuantColumnParallelLinear)
QuantModuleRegistry.register(RowParallelLinear, QuantRowParallelLinear)


class QuantSequentialMLP(QuantModuleMixin):
    """Megatron ``SequentialMLP`` experts with layer-level expert quantizers.

    The layer owns ``linear_fc1`` / ``linear_fc2`` :class:`ExpertQuantizers` (the same quantizer names as
    ``TEGroupedMLP``'s ``linear_fc1`` / ``linear_fc2``, so configs and checkpoints are shared); each local expert's
    linear calls expert ``i`` of them through slots. Megatron's own forward runs unchanged.
    """

    _SHARDED_AXIS = {"linear_fc1": 0, "linear_fc2": 1}  # column- / row-parallel

    def _setup_quantizers(self, config):
        for name in self._SHARDED_AXIS:
            setattr(self, name, ExpertQuantizers(self.num_local_experts, config.experts))

    def _after_convert(self):
        for i, expert in enumerate(self.local_experts):
            for name in self._SHARDED_AXIS:
                linear = getattr(expert, name)
                for kind, slot in getattr(self, name).slots(i).items():
                    if kind in linear._modules:
                        del linear._modules[kind]  # its own quantizer is replaced by the layer-level one
                    linear.__dict__[kind] = slot

    def calibrate_weights(self) -> None:
        pass  # each expert linear calibrates its weight through its slot

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's expert entries plus the layer-level amaxes under the global expert axis, with the keys
        ``TEGroupedMLP`` would have (``plugins/megatron_checkpoint.py``)."""
        from .megatron_checkpoint import sequential_mlp_quantizers_sharded_state_dict

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sd.update(sequential_mlp_quantizers_sharded_state_dict(self, prefix, sharded_offsets, metadata))
        return sd

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        gemm, kind = quantizer_name.split(".")[:2]
        return expert_amax_reduction(getattr(getattr(self, gemm), kind), kind, self._SHARDED_AXIS[gemm])

    def finalize_calibration(self, groups: dict) -> list[str]:
        notes = []
        for name in self._SHARDED_AXIS:
            unseen = fill_unseen_expert_input_amax(getattr(self, name).input_quantizer, groups)
            if unseen:
                notes.append(f"{name}.input_quantizer: experts {unseen}")
        return notes


QuantModuleRegistry.register(SequentialMLP, QuantSequentialMLP)
