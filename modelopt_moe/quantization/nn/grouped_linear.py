"""Grouped expert linears: N expert weights, an input split into N row blocks by ``m_splits``.

The framework-free core. :class:`GroupedLinear` is a plain grouped linear with Transformer Engine's parameter
names (``weight0..weight{N-1}``, ``bias0..``) and call (``forward(x, m_splits)``); :class:`QuantGroupedLinearMixin`
quantizes it (and any host class with the same three methods: the Transformer Engine and Megatron adapters in
``plugins/`` reuse it). The expert quantizers and their amax layouts: :mod:`..expert_quantizer`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...numerics import scale_rows
from ..autoswitch import SampledGemm, gemm_sampler
from ..config import QuantizeConfig
from ..expert_quantizer import ExpertGemm
from ..quant_module import QuantModuleMixin
from .expert_weights import expert_weight_clip_mask, quantize_expert_weights
from .experts import (
    DeviceSplits,
    build_expert_quantizers,
    expert_amax_reduction,
    expert_input_clip_mask,
    quantize_expert_inputs,
    split_sizes,
)
from .functional import run_quantized_gemm
from .row_scale import row_scale_of, rows_of

__all__ = ["GroupedLinear", "QuantGroupedLinearMixin"]


class GroupedLinear(nn.Module):
    """A plain grouped expert linear (no quantization), Transformer Engine's parameter names and call.

    ``forward(x, m_splits)``: rows ``[sum(m_splits[:i]), sum(m_splits[:i+1]))`` of ``x`` go through expert ``i``.
    """

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        for i in range(num_gemms):
            w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)))

    def expert_weights(self) -> list[torch.Tensor]:
        """The N expert weights ``weight0`` .. ``weight{N-1}``, ``[out_features, in_features]`` each."""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def expert_biases(self) -> list[torch.Tensor] | None:
        """The N expert biases, or None without biases."""
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else None

    def grouped_gemm(self, x: torch.Tensor, m_splits, weights: list[torch.Tensor]) -> torch.Tensor:
        """``cat_i(x_i @ w_i^T + b_i)``: one GEMM per expert (the reference; fast adapters use the framework's)."""
        biases = self.expert_biases()
        outs = []
        for i, (chunk, w) in enumerate(zip(torch.split(x, split_sizes(m_splits)), weights, strict=True)):
            y = chunk @ w.t()
            outs.append(y + biases[i] if biases is not None else y)
        return torch.cat(outs) if outs else x.new_empty(0, self.out_features)

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        """Rows ``[sum(m_splits[:i]), sum(m_splits[:i+1]))`` of ``x`` through expert ``i``: ``[T, out_features]``."""
        return self.grouped_gemm(x, m_splits, self.expert_weights())


class QuantGroupedLinearMixin(QuantModuleMixin):
    """Quantized grouped expert linear. The host class provides ``num_gemms``, ``expert_weights()`` and
    ``grouped_gemm(x, m_splits, weights)``, which its own ``forward`` calls: the mixin quantizes the operands of that
    call, so the host's forward (its return convention, bias handling) runs unchanged. Adapters of classes without
    ``grouped_gemm`` (Transformer Engine's) call :meth:`quantized_forward` with the framework's GEMM.
    :attr:`sharded_axis` is the weight axis split across expert-TP ranks (declared per registered class)."""

    sharded_axis = 0
    _transient_attributes = ("_device_splits",)

    def _setup_quantizers(self, config: QuantizeConfig) -> None:
        build_expert_quantizers(self, self.num_gemms, config.experts)

    def _splits_cache(self) -> DeviceSplits:
        """The split-size cache, created on first use (never pickled or deep-copied)."""
        if "_device_splits" not in self.__dict__:
            self.__dict__["_device_splits"] = DeviceSplits()
        return self.__dict__["_device_splits"]

    def expert_gemms(self) -> list[ExpertGemm]:
        """The one expert GEMM of this module, whose quantizers it holds itself."""
        weights = self.expert_weights()
        return [ExpertGemm("", self, int(self.num_gemms), self.sharded_axis, tuple(weights[0].shape), list(weights))]

    def calibrate_weights(self) -> None:
        """Max-calibrates each expert's row of the weight quantizer from its weight (no data needed)."""
        if self.weight_quantizer.is_enabled:
            for i, w in enumerate(self.expert_weights()):
                self.weight_quantizer.collect_expert(i, w)

    def weights_to_calibrate(self):
        """The weight quantizer with the N expert weights, in expert order."""
        return [("weight_quantizer", self.weight_quantizer, self.expert_weights())]

    def grouped_gemm(self, x: torch.Tensor, m_splits, weights: list[torch.Tensor]):
        """The host's grouped GEMM on fake-quantized operands (with the configured backward mode)."""
        if row_scale_of(self) is not None and self.expert_biases() is not None:
            raise NotImplementedError(f"{type(self).__name__}: the router probabilities scale the GEMM's input, so a "
                                      "bias added inside the GEMM would not be scaled; return the biases instead")
        host = super().grouped_gemm
        return self.quantized_forward(x, m_splits, lambda xo, wo: host(xo, m_splits, wo), weights)

    def quantized_forward(self, x: torch.Tensor, m_splits, gemm, weights: list[torch.Tensor] | None = None):
        """Runs ``gemm(x_operand, weight_operands)`` on the fake-quantized input and expert weights (default:
        :meth:`expert_weights`). As an expert down projection given the router probabilities
        (:func:`.row_scale.down_proj_row_scale`), the input operand is ``scale_rows(Q(x), prob)``."""
        iq, wq = self.input_quantizer, self.weight_quantizer
        weights = self.expert_weights() if weights is None else weights
        kernel, splits = self.quant_kernel, self._splits_cache()
        scale = row_scale_of(self)
        if scale is not None:
            scale = rows_of(scale, x, type(self).__name__)
        operand = None if scale is None else (lambda t: scale_rows(t, scale))
        sampler = gemm_sampler(self)
        sample = None
        if sampler is not None and (iq.is_quantizing or wq.is_quantizing):
            device_splits = splits(m_splits, x.device)

            def select_input(decision, t, tq):
                if decision is None:
                    return tq
                rows = torch.repeat_interleave(decision, device_splits, output_size=t.shape[0])
                return torch.where(rows.unsqueeze(-1), t, tq)

            def select_weight(decision, ws, wqs):
                if decision is None:
                    return wqs
                return [torch.where(decision[i], w, q) for i, (w, q) in enumerate(zip(ws, wqs, strict=True))]

            sample = SampledGemm(
                sampler,
                lambda t: quantize_expert_inputs(iq, t, m_splits, kernel, splits, with_stats=True, row_scale=scale,
                                                 owner=self),
                lambda ws: quantize_expert_weights(wq, ws, kernel, owner=self, with_stats=True),
                select_input, select_weight)
        # backward.weight_operands: recompute -> the recipe of the weight operands, whose GEMM saves only their place
        recipes = [] if self.quant_backward.weight_operands == "recompute" else None

        def gemm_saving_recipes(xo, wo):
            if not recipes:
                return gemm(xo, wo)
            with recipes[-1].saving():
                return gemm(xo, wo)

        return run_quantized_gemm(
            self.quant_backward, x, weights, gemm=gemm_saving_recipes,
            quantize_input=lambda t: quantize_expert_inputs(iq, t, m_splits, kernel, splits, row_scale=scale,
                                                            owner=self),
            quantize_weight=lambda ws: quantize_expert_weights(wq, ws, kernel, owner=self, recompute_into=recipes),
            input_mask=lambda t: expert_input_clip_mask(iq, t, m_splits),
            weight_mask=expert_weight_clip_mask(wq, weights),
            output_quantizer=self.output_quantizer,
            sample=sample,
            input_operand=operand,
            kernel=kernel,
        )

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        """The groups an expert quantizer's amax is max-reduced over (:func:`~.experts.expert_amax_reduction`)."""
        kind = quantizer_name.split(".")[0]
        return expert_amax_reduction(getattr(self, kind), kind, self.sharded_axis)

    def finalize_calibration(self, groups: dict) -> list[str]:
        """Gives the experts no rank calibrated an input amax (:meth:`~.ExpertQuantizer.fill_unseen_experts`); returns a
        note naming them."""
        unseen = self.input_quantizer.fill_unseen_experts(groups)
        return [f"input_quantizer: experts {unseen}"] if unseen else []

    def fold_weight(self) -> None:
        """Replaces each expert weight by its fake-quantized value and disables the weight quantizer."""
        q = self.weight_quantizer
        if q.is_enabled:
            with torch.no_grad():
                for i, w in enumerate(self.expert_weights()):
                    w.copy_(q.fake_quant_expert(i, w))
            q.disable()

