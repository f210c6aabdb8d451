"""Fake quantization of the operands of N expert GEMMs with one :class:`ExpertQuantizer` per operand.

Framework-free helpers used by the grouped expert linear (:mod:`.grouped_linear`) and by the Megatron
``SequentialMLP`` adapter: building the quantizers from the config, which groups reduce their amax, which kernels
run, and the forward of a token matrix split by ``m_splits``. The N expert weights: :mod:`.expert_weights`.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels import (
    GroupedInputSTE,
    expert_row_sums,
    grouped_input_fake_quant_scaled_ste,
    grouped_input_fake_quant_stats,
    grouped_input_fake_quant_ste,
    kernels_available,
)
from ...kernels import use_kernels as kernel_rule
from ...numerics import clip_limit, scale_rows
from ..config_schema import ExpertsConfig
from ..expert_quantizer import ExpertQuantizer
from ..input_amax import learned_input_amax, learned_input_values
from ..quant_mode import QuantMode
from ..tensor_quantizer import clip_mask
from .row_scale import rows_of

__all__ = [
    "QUANTIZER_KINDS",
    "ExpertQuantizers",
    "build_expert_quantizers",
    "expert_amax_reduction",
    "split_sizes",
    "use_kernels",
    "quantize_expert_inputs",
    "expert_input_clip_mask",
    "DeviceSplits",
]

QUANTIZER_KINDS = ("input_quantizer", "weight_quantizer", "output_quantizer")


def build_expert_quantizers(module: nn.Module, num_experts: int, experts: ExpertsConfig) -> None:
    """Gives ``module`` an input, weight and output :class:`ExpertQuantizer` in the configured layouts (an output
    is one tensor of every expert, so its quantizer is ``shared``)."""
    module.weight_quantizer = ExpertQuantizer(num_experts, experts.weight_amax)
    module.input_quantizer = ExpertQuantizer(num_experts, "shared" if experts.input_amax == "shared" else "vectorized",
                                             config_name=experts.input_amax)
    module.output_quantizer = ExpertQuantizer(num_experts, "shared")


class ExpertQuantizers(nn.Module):
    """The input / weight / output quantizers of one expert GEMM whose experts are separate modules (Megatron
    ``SequentialMLP``): expert ``i``'s linear calls view ``i`` of each (:meth:`views`)."""

    def __init__(self, num_experts: int, experts: ExpertsConfig):
        super().__init__()
        self.num_experts = num_experts
        build_expert_quantizers(self, num_experts, experts)

    def views(self, index: int) -> dict[str, nn.Module]:
        """Expert ``index``'s view of each quantizer, by kind (``input_quantizer``, ``weight_quantizer``,
        ``output_quantizer``)."""
        return {kind: getattr(self, kind).view(index) for kind in QUANTIZER_KINDS}


def expert_amax_reduction(q: ExpertQuantizer, kind: str, sharded_axis: int) -> tuple[str, ...]:
    """Groups over which an expert quantizer's amax is max-reduced.

    Weights: across expert-TP ranks (shards of the same experts) unless the amax is per channel along the sharded
    axis; inputs and outputs: across expert-data-parallel and expert-TP ranks (other tokens). ``shared``: also
    across EP ranks (the max over every expert).
    """
    ep = ("ep",) if q.layout == "shared" else ()
    if kind == "weight_quantizer":
        tp = () if q.axis is not None and q.axis % 2 == sharded_axis else ("etp",)
        return tp + ep
    return ("edp", "etp") + ep


def split_sizes(m_splits) -> list[int]:
    """``m_splits`` (list, tuple or tensor) as host ints (the reference path needs them on the host)."""
    return m_splits.tolist() if isinstance(m_splits, torch.Tensor) else [int(m) for m in m_splits]


def use_kernels(preference: str, device: torch.device) -> bool:
    """Whether expert fake quant runs the one-launch Triton kernels (``config.kernel``: auto | triton | torch): the
    kernels' rule (:func:`modelopt_moe.kernels.use_kernels`, which dense quantizers follow too)."""
    return kernel_rule(preference, device, kernels_available(device))


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
        """``m_splits`` as an int64 tensor on ``device``: as given when it is one already, else the kept copy of that
        split."""
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


def quantize_expert_inputs(q: ExpertQuantizer, x: torch.Tensor, m_splits, kernel: str = "auto",
                           device_splits: DeviceSplits | None = None, *, with_stats: bool = False,
                           row_scale: torch.Tensor | None = None, owner: nn.Module | None = None):
    """Fake-quantizes (and calibrates) the token matrix ``x`` whose row blocks ``m_splits`` belong to the experts.

    Calibrated amax on the kernel path (per expert, or ``shared``: ``[N]`` equal entries): one launch with the
    ``[N]`` amax and device-side split offsets; none read (``type: dynamic`` FP8 1x128 groups, MX): one launch too
    (:func:`_one_launch`). A ``shared`` amax elsewhere: the whole matrix at once (reference).
    Otherwise expert by expert. ``with_stats`` also returns each expert's quantization-error sums over its rows
    (``(y, float64 [N, 4] or None)``); on the kernel path from the same launch (a ``shared`` amax too: every expert's
    entry holds the same value, so the bits are the same).

    ``row_scale`` (one value per row: an expert down projection's router probabilities, see :mod:`.row_scale`): the
    result is ``scale_rows(Q(x), row_scale)``; ``x`` itself is what the quantizer calibrates on and quantizes (and
    the statistics measure). On the kernel path the product is part of the same launch.

    A learned amax (``input_amax_update: learned``): the same values, computed with the amax as a constant, put into
    the graph with the amax's gradient (:mod:`..input_amax`), summed over the groups ``owner`` (the module holding
    ``q`` as ``input_quantizer``; None: no reduction) names.
    """
    if row_scale is not None:
        row_scale = rows_of(row_scale, x, "quantize_expert_inputs")
    if q.mode is QuantMode.LEARNED and x.dim() == 2:
        y = _quantize_expert_inputs_learned(q, x, m_splits, kernel, device_splits, owner)
        out = y if row_scale is None else scale_rows(y, row_scale)
        return (out, expert_row_sums(x, y, (device_splits or DeviceSplits())(m_splits, x.device))) if with_stats \
            else out
    if with_stats:
        y, sums = _quantize_expert_inputs_stats(q, x, m_splits, kernel, device_splits)
        return (y if row_scale is None else scale_rows(y, row_scale)), sums
    if _one_launch(q) and x.dim() == 2 and use_kernels(kernel, x.device):
        # One launch, shared amax too (its [N] entries are all equal): the reference on the whole token matrix would
        # run a chain of elementwise kernels with fp32 temporaries on every micro-batch.
        splits = (device_splits or DeviceSplits())(m_splits, x.device)
        amax = q.amax if q.needs_amax else None
        if row_scale is not None:
            return grouped_input_fake_quant_scaled_ste(x, splits, amax, q.fmt, row_scale, q.block_size, q.ste,
                                                       q.narrow_range)
        return grouped_input_fake_quant_ste(x, splits, amax, q.fmt, q.block_size, q.ste, q.narrow_range)
    y = _quantize_expert_inputs_reference(q, x, m_splits)
    return y if row_scale is None else scale_rows(y, row_scale)


def _one_launch(q: ExpertQuantizer) -> bool:
    """Whether the whole token matrix goes through one launch: the amax settled before the call, or none read (a
    ``type: dynamic`` format that takes every scale from the data, e.g. FP8 1x128 groups: each row's groups are its
    own, whatever expert the row belongs to, so the launch gives each expert's bits)."""
    return q.mode.settled or (q.mode is QuantMode.DYNAMIC and not q.needs_amax)


def _quantize_expert_inputs_learned(q: ExpertQuantizer, x: torch.Tensor, m_splits, kernel: str,
                                    device_splits: DeviceSplits | None, owner: nn.Module | None) -> torch.Tensor:
    """:func:`quantize_expert_inputs` of a learned amax (no row scale): the values of the static path with the
    learned amax, and its gradient."""
    amax = learned_input_amax(q.amax)
    sizes = split_sizes(m_splits)
    with torch.no_grad():
        xd = x.detach()
        if use_kernels(kernel, x.device):
            splits = (device_splits or DeviceSplits())(m_splits, x.device)
            y = grouped_input_fake_quant_ste(xd, splits, amax, q.fmt, q.block_size, q.ste, q.narrow_range)
        elif q.layout == "shared":
            y = q.fake_quant(xd, q.row_of(amax, 0))
        else:
            y = torch.cat([q.fake_quant_expert(i, c, q.row_of(amax, i)) for i, c in enumerate(torch.split(xd, sizes))])
    return learned_input_values(owner, "input_quantizer", q, x, y, sizes)


def _quantize_expert_inputs_stats(q: ExpertQuantizer, x: torch.Tensor, m_splits, kernel: str,
                                  device_splits: DeviceSplits | None):
    """:func:`quantize_expert_inputs` with ``with_stats`` (no row scale): ``(y, sums or None)``."""
    if not q.is_enabled:
        return x, None
    splits = (device_splits or DeviceSplits())(m_splits, x.device)
    if q.mode.settled and x.dim() == 2 and q.amax is not None and use_kernels(kernel, x.device):
        amax = q.amax.detach() if q.needs_amax else None
        with torch.no_grad():
            y, sums = grouped_input_fake_quant_stats(x.detach(), splits, amax, q.fmt, q.block_size, q.narrow_range)
        return GroupedInputSTE.apply(x, splits, amax, q.ste, y), sums
    y = quantize_expert_inputs(q, x, m_splits, kernel, device_splits)
    return y, (expert_row_sums(x, y, splits) if q.is_quantizing else None)


def _quantize_expert_inputs_reference(q: ExpertQuantizer, x: torch.Tensor, m_splits) -> torch.Tensor:
    """The torch path of :func:`quantize_expert_inputs`: the whole matrix (``shared``) or expert by expert."""
    if not q.is_enabled:
        return x
    if q.layout == "shared":
        return q(x)
    return torch.cat(q.forward_experts(list(torch.split(x, split_sizes(m_splits)))))


def expert_input_clip_mask(q: ExpertQuantizer, x: torch.Tensor, m_splits) -> torch.Tensor | None:
    """The clipped-STE mask of the token matrix (``|x| <= amax`` of each row's expert), or None (no clipping)."""
    if not q.clips:
        return None
    if q.axis is not None:
        chunks = torch.split(x, split_sizes(m_splits))
        return torch.cat([clip_mask(c, q.expert_amax(i)) for i, c in enumerate(chunks)])
    rows = torch.repeat_interleave(q.amax.to(x.device), torch.as_tensor(split_sizes(m_splits), device=x.device),
                                   output_size=x.shape[0])
    return x.abs() <= clip_limit(rows).unsqueeze(-1)

