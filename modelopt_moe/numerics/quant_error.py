"""Quantization-error statistics of an operand: the reference the autoswitch kernels match.

For an operand ``x`` and its fake-quantized value ``y`` (same shape, ``y`` in the dtype the GEMM reads), four sums
over the elements whose ``x`` is not NaN:

* ``nonzero``: elements with ``x != 0``;
* ``underflow``: those of them with ``y == 0`` (a non-zero value that quantizes to zero);
* ``sq_error``: ``sum((y - x)**2)`` (the difference and its square in fp32, summed in fp64);
* ``sq_input``: ``sum(x**2)`` (likewise).

From them: ``underflow_pct = 100 * underflow / nonzero`` (0 when nothing is non-zero) and the MSE relative to the
operand's mean square ``rel_mse = sq_error / sq_input`` (0 when ``sq_input`` is 0). Counts are exact everywhere;
the two sums depend on the summation order (the kernels add fp32 tile sums), so fast paths agree with this
reference to a relative 1e-5, not bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["STAT_FIELDS", "quant_error_sums", "underflow_pct", "relative_mse"]

STAT_FIELDS = ("nonzero", "underflow", "sq_error", "sq_input")


def quant_error_sums(x: torch.Tensor, y: torch.Tensor, keep_rows: bool = False) -> torch.Tensor:
    """The four sums of ``(x, y)`` as float64 ``[4]``, or ``[rows, 4]`` per row of the first dim with ``keep_rows``.

    Raises:
        ValueError: ``x`` and ``y`` differ in shape.
    """
    if x.shape != y.shape:
        raise ValueError(f"quant_error_sums: x has shape {tuple(x.shape)} but y has {tuple(y.shape)}")
    xf, yf = x.detach().float(), y.detach().float()
    if keep_rows:
        xf, yf = xf.reshape(xf.shape[0], -1), yf.reshape(yf.shape[0], -1)
    else:
        xf, yf = xf.reshape(1, -1), yf.reshape(1, -1)
    ok = ~torch.isnan(xf)
    nz = ok & (xf != 0)
    uf = nz & (yf == 0)
    d = torch.where(ok, yf - xf, torch.zeros_like(xf))
    xx = torch.where(ok, xf, torch.zeros_like(xf))
    out = torch.stack([nz.sum(1, dtype=torch.float64), uf.sum(1, dtype=torch.float64),
                       (d * d).sum(1, dtype=torch.float64), (xx * xx).sum(1, dtype=torch.float64)], dim=-1)
    return out if keep_rows else out[0]


def underflow_pct(sums: torch.Tensor) -> torch.Tensor:
    """``100 * underflow / nonzero`` of ``[..., 4]`` sums (0 where nothing is non-zero)."""
    return 100.0 * sums[..., 1] / sums[..., 0].clamp(min=1.0)


def relative_mse(sums: torch.Tensor) -> torch.Tensor:
    """``sq_error / sq_input`` of ``[..., 4]`` sums (0 where the input is all zero)."""
    ss = sums[..., 3]
    return torch.where(ss > 0, sums[..., 2] / torch.where(ss > 0, ss, torch.ones_like(ss)), torch.zeros_like(ss))
