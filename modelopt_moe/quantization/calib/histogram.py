"""Activation calibration over histograms (Model Optimizer's ``HistogramCalibrator`` with
``compute_amax("percentile" | "mse")``): ``{"method": "histogram", "histogram_method": "percentile"}`` or ``"mse"``.

After max calibration and its reduction across ranks, every histogrammed activation amax is the same on all the
ranks it reduces over: that is the histograms' common range ``[0, amax]``. A second pass of the forward loop (with
the same routing) adds ``|x|`` of every tensor each quantizer sees into ``num_bins`` bins over that range (per expert
for the ``[N]`` expert quantizers: each expert's own tokens; ``shared``: one histogram of every expert's); the
histograms are a ``sum`` statistic over the groups the amax is max-reduced over, so every layout counts the same
values. Then each amax is computed from its histogram as Model Optimizer computes it:

* ``percentile``: the left edge of the bin where the cumulative fraction (float64) reaches ``percentile / 100``;
* ``mse``: the bin center ``c_i`` (``i = start_bin, start_bin + stride, ...``) minimizing
  ``mean((Q(centers; c_i) - centers)**2 * counts)``, the first of equal errors.

An input replicated over tensor-parallel ranks (a column-parallel linear's) is counted once per rank: every count
scales by the same factor, which neither rule depends on. An expert (or quantizer) no rank saw keeps its amax.

Histogrammed: enabled, static activation quantizers whose amax is the per-tensor element scale (per tensor, or per
expert). Weights keep max calibration; per-channel, blocked and two-level (NVFP4, MX) activation quantizers keep max
calibration (Model Optimizer's histograms are per tensor only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...numerics import fake_quant, get_format
from ..config_schema import HistogramCalibConfig
from ..expert_quantizer import ExpertQuantizer
from ..quant_module import is_quantized, own_quantizers
from ..tensor_quantizer import TensorQuantizer
from .calibrator import Calibrator, Statistic, reduce_statistics

__all__ = ["HistogramCalibrator", "histogrammed", "add_to_histogram", "percentile_amax", "mse_amax"]


def histogrammed(q: TensorQuantizer) -> bool:
    """Whether activation quantizer ``q`` calibrates over histograms: enabled, static, calibrated, and its amax is
    the per-tensor (per-expert) element scale."""
    return (q.is_enabled and not q.is_dynamic and q.needs_amax and q.amax is not None and q.axis is None
            and q.block_sizes is None and q.block_size is None and get_format(q.fmt).block_scale is None)


def add_to_histogram(hist: torch.Tensor, x: torch.Tensor, amax: float) -> None:
    """Adds ``|x|`` (NaN skipped; values above ``amax`` in the last bin) into ``hist`` (int64, ``num_bins`` bins
    over ``[0, amax]``, ``torch.histc``'s binning)."""
    values = x.detach().float().abs().reshape(-1)
    values = values[~torch.isnan(values)].clamp(max=amax).cpu()
    if values.numel():
        hist += torch.histc(values, bins=hist.numel(), min=0, max=amax).long()


def _edges(amax: torch.Tensor, num_bins: int) -> torch.Tensor:
    """The bin edges over ``[0, amax]`` (float32, as Model Optimizer makes them)."""
    return torch.linspace(0, float(amax), num_bins + 1)


def percentile_amax(hist: torch.Tensor, amax: torch.Tensor, percentile: float) -> torch.Tensor:
    """The left edge of the bin where the cumulative fraction of ``hist`` reaches ``percentile / 100``."""
    cdf = torch.cumsum(hist.double() / hist.sum().double(), dim=0)
    idx = int(torch.searchsorted(cdf, torch.tensor([percentile / 100], dtype=torch.float64)))
    return _edges(amax, hist.numel())[idx]


def mse_amax(hist: torch.Tensor, amax: torch.Tensor, fmt: str, int_kwargs: dict, start_bin: int,
             stride: int) -> torch.Tensor:
    """The bin center of least ``mean((Q(centers) - centers)**2 * counts)`` among ``start_bin, +stride, ...``."""
    edges = _edges(amax, hist.numel())
    centers = (edges[1:] + edges[:-1]) / 2
    counts = hist.float()
    candidates = torch.arange(start_bin, centers.numel(), stride)
    # Every candidate at once (in chunks), elementwise as one at a time: the same errors bit for bit.
    errors = torch.cat([((fake_quant(centers.expand(len(chunk), -1), fmt, centers[chunk].unsqueeze(1), None,
                                     **int_kwargs) - centers) ** 2 * counts).mean(dim=1)
                        for chunk in candidates.split(256)])
    return centers[candidates[int(torch.argmin(errors))]]


class HistogramCalibrator(Calibrator):
    """Activation amaxes from histograms over a common range, summed across ranks (see the module docstring)."""

    name = "histogram"
    options = HistogramCalibConfig

    def refine(self, model: torch.nn.Module, groups: dict, forward_loop: Callable | None = None,
               routing: Callable | None = None) -> None:
        """Histograms of every histogrammed activation quantizer from a second pass of ``forward_loop`` (inside
        ``routing()``, the first pass's routing; without a forward loop, nothing to do), summed across ranks (one
        collective per group name, the same on every rank), then each amax computed from its histogram."""
        if forward_loop is None:
            return
        entries = []  # (module, relative name, quantizer, histograms [rows, num_bins])
        for module in model.modules():
            if not is_quantized(module):
                continue
            for rel, q in own_quantizers(module):
                if rel.endswith("weight_quantizer") or not histogrammed(q):
                    continue
                rows = 1 if not isinstance(q, ExpertQuantizer) or q.layout == "shared" else q.num_experts
                entries.append((module, rel, q, torch.zeros(rows, self.config.num_bins, dtype=torch.int64)))
        if not entries:
            return
        self._collect(model, entries, forward_loop, routing)
        statistics = []
        for module, rel, q, hists in entries:

            def store(total, q=q):
                q.amax = self._compute(q, total)

            statistics.append(Statistic(hists, "sum", module.amax_reduction(rel), store))
        reduce_statistics(statistics, groups)

    def _collect(self, model, entries, forward_loop, routing) -> None:
        """The second pass: each histogrammed quantizer hands its tensors to its histograms; every quantizer passes
        its tensors through unquantized, as in the first pass, so each sees the tensors it calibrated on."""
        for _, _, q, hists in entries:
            amaxes = q.amax.detach().float().reshape(-1).cpu()

            def observe(x, index, hists=hists, amaxes=amaxes):
                rows = range(hists.shape[0]) if index is None or hists.shape[0] == 1 else (index,)
                for r in rows:
                    add_to_histogram(hists[r], x, float(amaxes[r]))

            q.calib_observer = observe
        enabled = [q for m in model.modules() if is_quantized(m) for _, q in own_quantizers(m) if q.is_enabled]
        try:
            for q in enabled:
                q.disable_quant()
            for _, _, q, _ in entries:
                q.enable_calib()
            with torch.no_grad(), routing():
                forward_loop(model)
        finally:
            for _, _, q, _ in entries:
                q.calib_observer = None
                q.disable_calib()
            for q in enabled:
                q.enable_quant()

    def _compute(self, q: TensorQuantizer, hists: torch.Tensor) -> torch.Tensor:
        """The amax of each row's histogram (a row no rank saw keeps its amax)."""
        initial = q.amax.detach().float()
        flat = initial.reshape(-1).cpu().clone()
        for r in range(hists.shape[0]):
            if int(hists[r].sum()) == 0 or float(flat[r]) <= 0:
                continue
            if self.config.histogram_method == "percentile":
                flat[r] = percentile_amax(hists[r], flat[r], self.config.percentile)
            else:
                flat[r] = mse_amax(hists[r], flat[r], q.fmt, q.int_kwargs, self.config.start_bin, self.config.stride)
        if hists.shape[0] == 1:
            flat[:] = flat[0]
        return flat.reshape(initial.shape).to(initial.device)
