"""What the pure-torch fallbacks of the grouped ops share: each expert's (or token row's) amax in the shape
:func:`~modelopt_moe.numerics.fake_quant` broadcasts, and its range keyword. The fallbacks themselves are in each op
module; they are the reference the kernels are tested against, bit for bit.
"""

from __future__ import annotations

import torch

from ..numerics import get_format


def expert_amax(amax: torch.Tensor | None, i: int) -> torch.Tensor | None:
    """Expert ``i``'s amax in the shape formats.fake_quant broadcasts: scalar, or [C, 1] per channel."""
    if amax is None or amax.dim() == 0:
        return amax
    return amax[i] if amax.dim() == 1 else amax[i].unsqueeze(-1)


def per_row_amax(x: torch.Tensor, m_splits: torch.Tensor, amax: torch.Tensor | None) -> torch.Tensor | None:
    """Per-row amax [T, 1] of tokens ``x`` for per-expert amax (no host sync: output_size is given), else amax
    unchanged."""
    if amax is None or amax.dim() == 0:
        return amax
    rows = torch.repeat_interleave(amax.float(), m_splits.long(), output_size=x.shape[0])
    return rows.unsqueeze(-1)


def int_kwargs(fmt: str, narrow_range: bool) -> dict:
    """``fake_quant``'s range keyword for int formats (none for float formats, which reject it)."""
    return {"narrow_range": narrow_range} if get_format(fmt).integer else {}
