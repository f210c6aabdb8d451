"""Quantized Megatron-Core modules: ``ColumnParallelLinear`` / ``RowParallelLinear`` (attention, dense MLPs, the
linears of ``SequentialMLP`` experts) and ``SequentialMLP`` itself (layer-level expert quantizers), plus the process
groups that amax reductions use.

The quantized linears override Megatron's ``_forward_impl`` (the local GEMM, with its own sequence-parallel and
gradient communication), so everything around it (bias, TP reductions, expert communication) stays Megatron's.
Every class declares its own tensor-parallel weight axis; checkpoints come from :mod:`.sharded_state_dict`.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.utils import get_pg_rank, get_pg_size

from modelopt_moe.quantization.conversion import QuantModuleMixin
from modelopt_moe.quantization.expert_quantizer import ExpertGemm, ExpertGrid
from modelopt_moe.quantization.nn.experts import ExpertQuantizers, expert_amax_reduction, use_kernels
from modelopt_moe.quantization.nn.functional import apply_quantized_gemm
from modelopt_moe.quantization.nn.grouped_linear import QuantGroupedLinearMixin
from modelopt_moe.quantization.nn.row_scale import add_row_scaled_bias, row_scale_of
from modelopt_moe.quantization.quant_mode import QuantMode
from modelopt_moe.quantization.weight_amax import refresh_weight_amax

from .attention import QuantCoreAttentionMixin
from .router_probs import CLASSES as ROUTER_PROBS_CLASSES
from .router_probs import probs_after_down_proj, sequential_experts_forward
from .sharded_state_dict import expert_quantizers_sharded_state_dict, parallel_linear_quantizers_sharded_state_dict

__all__ = [
    "QuantColumnParallelLinear",
    "QuantRowParallelLinear",
    "QuantSequentialMLP",
    "MegatronGroupedExpertsMixin",
    "QuantMegatronColumnGroupedLinear",
    "QuantMegatronRowGroupedLinear",
    "megatron_amax_groups",
    "expert_grid_of",
    "CLASSES",
]


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


def expert_grid_of(ep, etp, edp) -> ExpertGrid:
    """This rank's place in the expert grid, from the EP, expert-TP and expert-DP groups (None: size 1)."""
    return ExpertGrid(get_pg_rank(ep), get_pg_size(ep), get_pg_rank(etp), get_pg_size(etp), get_pg_rank(edp),
                      get_pg_size(edp))


class _QuantParallelLinearMixin(QuantModuleMixin):
    """Shared by the column- and row-parallel wrappers; ``sharded_axis`` is the weight axis split across TP."""

    sharded_axis: int

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
        return apply_quantized_gemm(self, input, weight, lambda x, w: parent(x, w, *args, **kwargs),
                                    row_scale=row_scale_of(self))

    def forward(self, *args, **kwargs):
        """Megatron's forward; as an expert's ``linear_fc2`` given its tokens' router probabilities
        (:mod:`.router_probs`), the returned bias is added here as ``out + prob * bias`` (Megatron's formula)."""
        scale = row_scale_of(self)
        if scale is None:
            return super().forward(*args, **kwargs)
        if not self.skip_bias_add and self.bias is not None:
            raise NotImplementedError(f"{type(self).__name__}: a bias added inside the linear would not be scaled "
                                      "by the router probabilities; expert linears return theirs (skip_bias_add)")
        output, bias = super().forward(*args, **kwargs)
        return (output if bias is None else add_row_scaled_bias(output, bias, scale)), None

    @property
    def is_expert_view(self) -> bool:
        """Whether this linear is a ``SequentialMLP`` expert's: its quantizers are views of the layer's."""
        return "weight_quantizer" not in self._modules

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        tp, dp = ("etp", "edp") if self.is_expert else ("tp", "dp")
        if quantizer_name != "weight_quantizer":
            return (dp, tp)
        q = self.weight_quantizer
        # A per-channel amax along the TP-sharded axis belongs to this rank's channels only.
        return () if q.axis is not None and q.axis % 2 == self.sharded_axis else (tp,)

    def input_amax_grad_groups(self, quantizer_name: str) -> tuple[str, ...]:
        """A learned input amax's gradient is summed over the ranks that hold other elements of the input: the TP
        ranks of a row-parallel input (other channels) or, under sequence parallelism, of a column-parallel one (other
        tokens; without it every TP rank holds the same input and the same gradient); an expert's, the expert-TP
        ranks and, for a ``shared`` (one per layer) amax, the expert-parallel ranks (other experts)."""
        if quantizer_name != "input_quantizer":
            return super().input_amax_grad_groups(quantizer_name)
        if self.is_expert_view:
            return ("etp",) + (("ep",) if self.input_quantizer.owner.layout == "shared" else ())
        return ("tp",) if self.sharded_axis == 1 or self.sequence_parallel else ()

    def tensor_split(self) -> tuple[int, int] | None:
        """The weight axis split over this linear's tensor-parallel group, and the group's size."""
        return self.sharded_axis, get_pg_size(self.tp_group)

    def calibrate_weights(self) -> None:
        if not self.is_expert_view:  # an expert's: the SequentialMLP calibrates all its experts
            super().calibrate_weights()

    def weights_to_calibrate(self):
        return [] if self.is_expert_view else super().weights_to_calibrate()

    def fold_weight(self) -> None:
        if not self.is_expert_view:  # an expert's: the SequentialMLP folds all its experts
            super().fold_weight()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's entries, plus this linear's quantizer amaxes (an expert's: the layer saves them)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if not self.is_expert_view:
            sd.update(parallel_linear_quantizers_sharded_state_dict(self, prefix, sharded_offsets, metadata))
        return sd


class QuantColumnParallelLinear(_QuantParallelLinearMixin):
    """Quantized Megatron ``ColumnParallelLinear``: the weight's output channels (axis 0) are split over TP ranks."""
    sharded_axis = 0


class QuantRowParallelLinear(_QuantParallelLinearMixin):
    """Quantized Megatron ``RowParallelLinear``: the weight's input channels (axis 1) are split over TP ranks."""
    sharded_axis = 1


class QuantSequentialMLP(QuantModuleMixin):
    """Megatron ``SequentialMLP`` experts with layer-level expert quantizers.

    The layer owns ``linear_fc1`` / ``linear_fc2`` :class:`ExpertQuantizers` (the same quantizer names as
    ``TEGroupedMLP``'s ``linear_fc1`` / ``linear_fc2``, so configs and checkpoints are shared); each local expert's
    linear calls view ``i`` of them. Megatron's own forward runs unchanged.
    """

    _SHARDED_AXIS = {"linear_fc1": 0, "linear_fc2": 1}  # column- / row-parallel

    def _setup_quantizers(self, config):
        for name in self._SHARDED_AXIS:
            setattr(self, name, ExpertQuantizers(self.num_local_experts, config.experts))

    def _after_convert(self):
        for i, expert in enumerate(self.local_experts):
            for name in self._SHARDED_AXIS:
                linear = getattr(expert, name)
                for kind, view in getattr(self, name).views(i).items():
                    linear._modules.pop(kind, None)  # its own quantizer is replaced by the layer-level one
                    linear.__dict__[kind] = view

    def expert_gemms(self) -> list[ExpertGemm]:
        """The layer's two expert GEMMs, ``linear_fc1`` (column-parallel) and ``linear_fc2`` (row-parallel)."""
        gemms = []
        for name, axis in self._SHARDED_AXIS.items():
            weights = [getattr(expert, name).weight for expert in self.local_experts]
            shape = tuple(weights[0].shape) if weights else None
            gemms.append(ExpertGemm(name, getattr(self, name), self.num_local_experts, axis, shape, weights))
        return gemms

    def expert_grid(self) -> ExpertGrid:
        """This rank's place in the expert-parallel grid, from the layer's process groups."""
        return expert_grid_of(self.ep_group, self.tp_group, self.dp_group)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs):
        """Megatron's forward; a ``dynamic`` weight amax is first recomputed for every local expert at once (its
        experts' linears then quantize with their row of it), and each expert's ``linear_fc2`` applies its tokens'
        router probabilities after its input quantization (:mod:`.router_probs`)."""
        for gemm in self.expert_gemms():
            q = gemm.quantizers.weight_quantizer
            if q.mode is QuantMode.REFRESHED and gemm.weights:
                refresh_weight_amax(self, f"{gemm.name}.weight_quantizer", q, gemm.weights,
                                    fast=use_kernels(self.quant_kernel, gemm.weights[0].device))
        if probs_after_down_proj(self, self.linear_fc2):
            return sequential_experts_forward(self, super().forward, permuted_local_hidden_states, tokens_per_expert,
                                              permuted_probs, *args, **kwargs)
        return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)

    def calibrate_weights(self) -> None:
        """Max-calibrates each local expert's row of both weight quantizers from its weights (no data needed)."""
        for name in self._SHARDED_AXIS:
            q = getattr(self, name).weight_quantizer
            if q.is_enabled:
                for i, expert in enumerate(self.local_experts):
                    q.collect_expert(i, getattr(expert, name).weight)

    def weights_to_calibrate(self):
        """Both layer-level weight quantizers, each with its GEMM's local expert weights in expert order."""
        return [(f"{name}.weight_quantizer", getattr(self, name).weight_quantizer,
                 [getattr(expert, name).weight for expert in self.local_experts]) for name in self._SHARDED_AXIS]

    def fold_weight(self) -> None:
        """Replaces every local expert's weights by their fake-quantized values and disables the weight quantizers."""
        for name in self._SHARDED_AXIS:
            q = getattr(self, name).weight_quantizer
            if q.is_enabled:
                with torch.no_grad():
                    for i, expert in enumerate(self.local_experts):
                        w = getattr(expert, name).weight
                        w.copy_(q.fake_quant_expert(i, w))
                q.disable()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's expert entries plus the layer-level amaxes under the global expert axis, with the keys
        ``TEGroupedMLP`` would have (``{prefix}experts.linear_fc1.weight_quantizer._amax``)."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        grid = self.expert_grid()
        for gemm in self.expert_gemms():
            sd.update(expert_quantizers_sharded_state_dict(
                self, gemm, grid, f"{prefix}{gemm.name}.", f"{prefix}experts.{gemm.name}.", sharded_offsets,
                metadata))
        return sd

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        """The groups the amax of quantizer ``linear_fc1.*`` / ``linear_fc2.*`` is max-reduced over
        (:func:`~modelopt_moe.quantization.nn.experts.expert_amax_reduction`)."""
        gemm, kind = quantizer_name.split(".")[:2]
        return expert_amax_reduction(getattr(getattr(self, gemm), kind), kind, self._SHARDED_AXIS[gemm])

    def layer_sync_moe_local_experts_amax(self, sync_weight_amax: bool = False) -> None:
        """Model Optimizer's name: every local expert takes the max of the local experts' input amaxes (and weight
        amaxes with ``sync_weight_amax``), elementwise for per-channel amaxes. This rank only, no collective (the
        EP reduction is calibration's, :func:`~modelopt_moe.quantization.calibration.sync_amax`)."""
        for name in self._SHARDED_AXIS:
            quantizers = getattr(self, name)
            kinds = ("input_quantizer", "weight_quantizer") if sync_weight_amax else ("input_quantizer",)
            for kind in kinds:
                q = getattr(quantizers, kind)
                if q.amax is not None:
                    q.amax = q.amax.amax(dim=0, keepdim=True).expand_as(q.amax)

    def finalize_calibration(self, groups: dict) -> list[str]:
        """Gives the experts no rank calibrated an input amax, for both GEMMs; returns notes naming them."""
        notes = []
        for name in self._SHARDED_AXIS:
            unseen = getattr(self, name).input_quantizer.fill_unseen_experts(groups)
            if unseen:
                notes.append(f"{name}.input_quantizer: experts {unseen}")
        return notes


class MegatronGroupedExpertsMixin:
    """For a quantized grouped expert linear inside a Megatron model (``TEGroupedMLP``'s ``linear_fc1`` /
    ``linear_fc2``): the expert grid from its process groups, and its amaxes on the global expert axis in its
    ``sharded_state_dict`` (``TEGroupedMLP`` renames ``linear_fc1.`` to ``<mlp>.experts.linear_fc1.``, the same keys
    as ``SequentialMLP``'s, so checkpoints move between the two). Put it before the grouped-linear mixin."""

    def expert_grid(self) -> ExpertGrid:
        """This rank's place in the expert-parallel grid, from the layer's process-group collection or Megatron's global
        groups."""
        pgc = getattr(self, "_pg_collection", None)
        if pgc is not None and getattr(pgc, "ep", None) is not None:
            return expert_grid_of(pgc.ep, getattr(pgc, "expt_tp", None), getattr(pgc, "expt_dp", None))
        return expert_grid_of(parallel_state.get_expert_model_parallel_group(),
                              parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
                              parallel_state.get_expert_data_parallel_group(check_initialized=False))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's entries, plus the expert quantizers' amaxes on the global expert axis."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        grid = self.expert_grid()
        for gemm in self.expert_gemms():
            sd.update(expert_quantizers_sharded_state_dict(self, gemm, grid, prefix, prefix, sharded_offsets,
                                                           metadata))
        return sd

    def forward(self, x, m_splits, *args, **kwargs):
        """The host's forward (``(out, bias or None)``); as ``TEGroupedMLP``'s ``linear_fc2`` given the router
        probabilities (:mod:`.router_probs`), the returned per-expert biases are added here as ``out + prob * bias``
        (Megatron's ``_apply_bias``), and no bias is returned."""
        scale = row_scale_of(self)
        if scale is None:
            return super().forward(x, m_splits, *args, **kwargs)
        if getattr(self, "apply_bias", False) or (not getattr(self, "te_return_bias", False) and
                                                  getattr(self, "use_bias", False)):
            raise NotImplementedError(f"{type(self).__name__}: a bias added inside the grouped GEMM would not be "
                                      "scaled by the router probabilities; TEGroupedMLP's linear_fc2 returns its "
                                      "biases (skip_bias_add=True)")
        out, bias = super().forward(x, m_splits, *args, **kwargs)
        return (out if bias is None else add_row_scaled_bias(out, bias, scale, m_splits)), None


class QuantMegatronColumnGroupedLinear(MegatronGroupedExpertsMixin, QuantGroupedLinearMixin):
    """A framework-free grouped linear (``modelopt_moe.quantization.nn.GroupedLinear`` subclass) used as
    ``TEGroupedMLP``'s column-parallel ``linear_fc1``: register your class with this mixin."""

    sharded_axis = 0


class QuantMegatronRowGroupedLinear(MegatronGroupedExpertsMixin, QuantGroupedLinearMixin):
    """As :class:`QuantMegatronColumnGroupedLinear`, for the row-parallel ``linear_fc2``."""

    sharded_axis = 1


CLASSES = {
    ColumnParallelLinear: QuantColumnParallelLinear,
    RowParallelLinear: QuantRowParallelLinear,
    SequentialMLP: QuantSequentialMLP,
    DotProductAttention: QuantCoreAttentionMixin,  # the KV cache's quantizers
    **ROUTER_PROBS_CLASSES,
}
