"""Grouped expert linears: N expert weights, an input split into N row blocks by ``m_splits``, expert quantizers.

The framework-free core. :class:`GroupedLinear` is a plain grouped linear with Transformer Engine's parameter
names (``weight0..weight{N-1}``, ``bias0..``) and call (``forward(x, m_splits)``); :class:`QuantGroupedLinearMixin`
quantizes it and is reused by the Transformer Engine / Megatron adapters in ``plugins/``.

Layouts (``config.experts``): ``weight_amax`` shared | vectorized | per_expert and ``input_amax`` shared |
per_expert; see :mod:`..tensor_quantizer`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ...kernels import (
    GroupedWeightSTE,
    grouped_input_fake_quant_ste,
    grouped_weight_fake_quant,
    grouped_weight_fake_quant_ste,
    kernels_available,
)
from ..config import ExpertsConfig, QuantizeConfig
from ..conversion import QuantModuleMixin, QuantModuleRegistry
from ...numerics import fake_quant
from ..tensor_quantizer import (
    ExpertQuantizerSlot,
    PerExpertQuantizer,
    TensorQuantizer,
    VectorizedQuantizer,
)
from .functional import clip_mask_of, run_quantized_gemm

__all__ = [
    "GroupedLinear",
    "ExpertQuantizers",
    "QUANTIZER_KINDS",
    "QuantGroupedLinearMixin",
    "build_expert_quantizers",
    "expert_amax_reduction",
    "fill_unseen_expert_input_amax",
    "split_sizes",
    "use_kernels",
    "quantize_expert_weights",
    "quantize_expert_inputs",
    "WeightFakeQuantCache",
    "DeviceSplits",
]


def build_expert_quantizers(module: nn.Module, num_experts: int, experts: ExpertsConfig) -> None:
    """Gives ``module`` an input, weight and output quantizer in the configured expert layouts."""
    module.weight_quantizer = {
        "shared": lambda: TensorQuantizer(),
        "vectorized": lambda: VectorizedQuantizer(num_experts),
        "per_expert": lambda: PerExpertQuantizer(num_experts),
    }[experts.weight_amax]()
    module.input_quantizer = TensorQuantizer() if experts.input_amax == "shared" else VectorizedQuantizer(num_experts)
    module.output_quantizer = TensorQuantizer()


def _is_shared(layout: nn.Module) -> bool:
    return isinstance(layout, TensorQuantizer) and not isinstance(layout, VectorizedQuantizer)


def expert_amax_reduction(layout: nn.Module, kind: str, sharded_axis: int) -> tuple[str, ...]:
    """Groups over which an expert quantizer's amax is max-reduced.

    Weights: across expert-TP ranks (a shard of the same expert) unless the amax is per channel along the sharded
    axis; a shared amax also across EP ranks (max over every expert). Inputs: across expert-data-parallel and
    expert-TP ranks (different tokens); shared also across EP.
    """
    ep = ("ep",) if _is_shared(layout) else ()
    if kind == "weight_quantizer":
        q = layout.expert(0)
        tp = () if q.axis is not None and q.axis % 2 == sharded_axis else ("etp",)
        return tp + ep
    return ("edp", "etp") + ep


def fill_unseen_expert_input_amax(layout: nn.Module, groups: dict) -> list[int]:
    """Per-expert input amax: an expert no rank routed a token to gets the shared amax (the max over all experts
    on all EP ranks). Returns the global indices of those experts (the caller warns once on rank 0).

    Every rank calls the same collective (one all_gather over ``groups["ep"]``), whatever its data.
    """
    if not isinstance(layout, VectorizedQuantizer) or not layout.is_enabled or layout.axis is not None:
        return []
    local = (layout.amax if layout.amax is not None else torch.zeros(layout.num_experts)).float()
    ep = groups.get("ep")
    if ep is not None and dist.is_initialized() and dist.get_world_size(ep) > 1:
        device = torch.device("cpu") if dist.get_backend(ep) == "gloo" else local.device
        parts = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size(ep))]
        dist.all_gather(parts, local.to(device), group=ep)
        everyone = torch.cat(parts)
    else:
        everyone = local
    unseen = (everyone <= 0).nonzero().flatten().tolist()
    shared = everyone.max().to(local.device)
    if unseen and shared > 0:
        layout.amax = torch.where(local <= 0, shared, local)
    return unseen


def split_sizes(m_splits) -> list[int]:
    """``m_splits`` (list, tuple or tensor) as host ints (the reference path needs them on the host)."""
    return m_splits.tolist() if isinstance(m_splits, torch.Tensor) else [int(m) for m in m_splits]


def use_kernels(preference: str, device: torch.device) -> bool:
    """Whether expert fake quant runs the one-launch Triton kernels (``config.kernel``: auto | triton | torch)."""
    if preference == "torch":
        return False
    available = kernels_available(device)
    if preference == "triton" and not available:
        raise RuntimeError(f"kernel='triton' but the Triton kernels cannot run on {device} (no triton, or a CPU "
                           "tensor without TRITON_INTERPRET=1); use kernel='auto' or 'torch'")
    return available and (preference == "triton" or device.type == "cuda")


def _uniform_quantizer(layout: nn.Module, num_experts: int) -> TensorQuantizer | None:
    """The quantizer that serves every expert alike, or None where the experts must be handled one by one
    (disabled, calibrating, quantization off, or per-expert children that differ)."""
    if not isinstance(layout, PerExpertQuantizer):  # one quantizer serves every expert: no per-expert checks
        ok = layout.is_enabled and not layout._if_calib and layout._if_quant
        return layout if ok and (layout.amax is not None or not layout.needs_amax) else None
    first = layout[0]
    state = _state(first)
    if not all(_state(q) == state for q in layout) or not first.is_enabled or first._if_calib or not first._if_quant:
        return None
    if first.needs_amax and any(q.amax is None for q in layout):
        return None
    return first


def _state(q: TensorQuantizer) -> tuple:
    """What must agree for per-expert children to be quantized in one launch (cheap: no pydantic compare)."""
    return q.fmt, q.axis, q.block_size, q.ste, q.is_enabled, q._if_calib, q._if_quant


def _kernel_amax(layout: nn.Module, q: TensorQuantizer, num_experts: int) -> torch.Tensor | None:
    """The amax as the kernels take it: a scalar, ``[N]`` or ``[N, C]``."""
    if not q.needs_amax:
        return None
    if _is_shared(layout):
        a = layout.amax
        return a.reshape(()) if a.numel() == 1 else a.reshape(1, -1).expand(num_experts, -1).contiguous()
    a = layout.stacked_amax(num_experts)
    return a if q.axis is None else a.reshape(num_experts, -1)


class WeightFakeQuantCache:
    """The fake-quantized expert weights, reused while neither the weights nor the amax changed.

    Keyed on each weight's identity, storage and version counter (an optimizer step or a checkpoint load bumps
    it) and on the amax tensor's identity and version (calibration, ``load_state_dict`` and ``amax = ...`` change
    it), plus the format: gradient-accumulation micro-batches then fake-quantize the weights once per step.
    """

    def __init__(self):
        self.key, self.values = None, None

    @staticmethod
    def make_key(weights, amax, q: TensorQuantizer):
        wkey = tuple((id(w), w.data_ptr(), w._version) for w in weights)
        akey = None if amax is None else (id(amax), amax.data_ptr(), amax._version)
        return wkey, akey, q.cfg, q.ste

    def lookup(self, key):
        return self.values if key == self.key else None

    def store(self, key, values):
        self.key, self.values = key, values


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream (the CPU build has no such query)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def quantize_expert_weights(layout: nn.Module, weights: list[torch.Tensor], kernel: str = "auto",
                            cache: WeightFakeQuantCache | None = None) -> list[torch.Tensor]:
    """Fake-quantizes (and calibrates) N expert weights: one kernel launch (or the reference per expert), the
    result cached across micro-batches. Calibration and mixed per-expert settings take the per-expert path."""
    q = _uniform_quantizer(layout, len(weights))
    fast = q is not None and use_kernels(kernel, weights[0].device)
    if cache is None or torch.compiler.is_compiling() or _capturing(weights[0].device):
        # No cache in traced or captured graphs (ids and version counters are not traceable, and a replay runs no
        # host code, so it must recompute from the current weights): fake-quantize on every call, by the
        # differentiable op (one launch) or per expert.
        if not fast:
            return [layout.forward_expert(i, w) for i, w in enumerate(weights)]
        amax = _kernel_amax(layout, q, len(weights))
        return grouped_weight_fake_quant_ste(list(weights), amax, q.fmt, q.block_size, q.ste)
    if q is None:
        return [layout.forward_expert(i, w) for i, w in enumerate(weights)]
    amax = _kernel_amax(layout, q, len(weights))
    key = WeightFakeQuantCache.make_key(weights, amax, q)
    values = cache.lookup(key)
    if values is None:
        with torch.no_grad():
            if fast:
                values = grouped_weight_fake_quant([w.detach() for w in weights], amax, q.fmt, q.block_size)
            else:
                values = [fake_quant(w.detach(), q.fmt, layout.expert_amax(i) if q.needs_amax else None, q.block_size)
                          for i, w in enumerate(weights)]
        cache.store(key, values)
    return list(GroupedWeightSTE.apply(amax, q.ste, values, *weights))


class DeviceSplits:
    """Host split sizes (TE passes a list) as device tensors, made once per distinct split and kept alive.

    The copy is asynchronous, from pinned memory (a pageable copy would stall the host every forward), and both
    the pinned source and the device tensor stay referenced: a CUDA graph that captured the copy replays it from
    that source.
    """

    MAX_ENTRIES = 64

    def __init__(self):
        self._entries: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, m_splits, device: torch.device):
        if isinstance(m_splits, torch.Tensor) and m_splits.device == device:
            return m_splits
        if torch.compiler.is_compiling():  # a constant of the traced graph
            return torch.tensor([int(m) for m in m_splits], dtype=torch.int64, device=device)
        key = tuple(m_splits.tolist() if isinstance(m_splits, torch.Tensor) else (int(m) for m in m_splits))
        entry = self._entries.get(key)
        if entry is None or entry[1].device != device:
            host = torch.tensor(key, dtype=torch.int64)
            if device.type == "cuda":
                host = host.pin_memory()
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.pop(next(iter(self._entries)))
            entry = self._entries[key] = (host, host.to(device, non_blocking=True))
        return entry[1]


def quantize_expert_inputs(layout: nn.Module, x: torch.Tensor, m_splits, kernel: str = "auto",
                           device_splits: DeviceSplits | None = None) -> torch.Tensor:
    """Fake-quantizes (and calibrates) the token matrix, expert by expert where the layout is per expert; one
    launch with the per-expert amax vector and device-side split offsets on the kernel path."""
    num_experts = len(m_splits)
    q = _uniform_quantizer(layout, num_experts) if layout.is_enabled else None
    if q is not None and x.dim() == 2 and use_kernels(kernel, x.device):
        splits = (device_splits or DeviceSplits())(m_splits, x.device)
        return grouped_input_fake_quant_ste(x, splits, layout.amax if q.needs_amax else None, q.fmt, q.block_size,
                                            q.ste)
    if _is_shared(layout):
        return layout(x)
    if not layout.is_enabled:
        return x
    chunks = torch.split(x, split_sizes(m_splits))
    return torch.cat([layout.forward_expert(i, c) for i, c in enumerate(chunks)])


class ExpertQuantizers(nn.Module):
    """The input / weight / output quantizers of one expert GEMM of a layer whose experts are separate modules
    (Megatron ``SequentialMLP``): each expert's linear calls them through an :class:`ExpertQuantizerSlot`."""

    def __init__(self, num_experts: int, experts: ExpertsConfig):
        super().__init__()
        self.num_experts = num_experts
        build_expert_quantizers(self, num_experts, experts)

    def slots(self, index: int) -> dict[str, ExpertQuantizerSlot]:
        return {k: ExpertQuantizerSlot(getattr(self, k), index) for k in QUANTIZER_KINDS}


QUANTIZER_KINDS = ("input_quantizer", "weight_quantizer", "output_quantizer")


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
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def expert_biases(self) -> list[torch.Tensor] | None:
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
        return self.grouped_gemm(x, m_splits, self.expert_weights())


class QuantGroupedLinearMixin(QuantModuleMixin):
    """Quantized grouped expert linear. The host class provides ``num_gemms``, ``expert_weights()`` and
    ``grouped_gemm(x, m_splits, weights)``; ``_sharded_axis`` is the weight axis split across expert-TP ranks."""

    _sharded_axis = 0
    _transient_attributes = ("_wq_cache", "_device_splits")

    def _setup_quantizers(self, config: QuantizeConfig) -> None:
        build_expert_quantizers(self, self.num_gemms, config.experts)

    def _transient(self, name: str, factory):
        """A per-module cache object, created on first use (never pickled or deep-copied)."""
        if name not in self.__dict__:
            self.__dict__[name] = factory()
        return self.__dict__[name]

    def _weight_cache(self) -> WeightFakeQuantCache:
        return self._transient("_wq_cache", WeightFakeQuantCache)

    def calibrate_weights(self) -> None:
        if self.weight_quantizer.is_enabled:
            for i, w in enumerate(self.expert_weights()):
                self.weight_quantizer.collect_expert(i, w)

    def quantized_forward(self, x: torch.Tensor, m_splits, gemm=None):
        """Quantized grouped forward; ``gemm(x_operand, weight_operands)`` defaults to :meth:`grouped_gemm`
        (adapters pass the framework's own forward)."""
        iq, wq = self.input_quantizer, self.weight_quantizer
        return run_quantized_gemm(
            self.quant_backward, x, self.expert_weights(),
            gemm=gemm or (lambda xo, wo: self.grouped_gemm(xo, m_splits, wo)),
            quantize_input=lambda t: quantize_expert_inputs(iq, t, m_splits, self.quant_kernel,
                                                            self._transient("_device_splits", DeviceSplits)),
            quantize_weight=lambda ws: quantize_expert_weights(wq, ws, self.quant_kernel, self._weight_cache()),
            input_mask=lambda t: _expert_input_mask(iq, t, m_splits),
            weight_mask=_weight_mask_fn(wq, self.expert_weights()),
            output_quantizer=self.output_quantizer,
        )

    def forward(self, x: torch.Tensor, m_splits, *args, **kwargs) -> torch.Tensor:
        return self.quantized_forward(x, m_splits)

    def amax_reduction(self, quantizer_name: str) -> tuple[str, ...]:
        kind = quantizer_name.split(".")[0]
        return expert_amax_reduction(getattr(self, kind), kind, self._sharded_axis)

    def finalize_calibration(self, groups: dict) -> list[str]:
        unseen = fill_unseen_expert_input_amax(self.input_quantizer, groups)
        return [f"input_quantizer: experts {unseen}"] if unseen else []

    def fold_weight(self) -> None:
        if self.weight_quantizer.is_enabled:
            with torch.no_grad():
                for i, w in enumerate(self.expert_weights()):
                    w.copy_(self.weight_quantizer.fake_quant_expert(i, w))
            for i in range(self.num_gemms):
                self.weight_quantizer.expert(i).disable()


def _expert_input_mask(layout, x, m_splits):
    if _is_shared(layout):
        return clip_mask_of(layout, x)
    chunks = torch.split(x, split_sizes(m_splits))
    masks = [clip_mask_of(ExpertQuantizerSlot(layout, i), c) for i, c in enumerate(chunks)]
    return None if any(m is None for m in masks) else torch.cat(masks)


def _weight_mask_fn(layout, weights):
    index = {id(w): i for i, w in enumerate(weights)}
    return lambda w: clip_mask_of(ExpertQuantizerSlot(layout, index[id(w)]), w)


QuantModuleRegistry.register(GroupedLinear, QuantGroupedLinearMixin)
